"""Token blocks: the tokenization cache answers for the tokenizer's content, not its name."""

from __future__ import annotations

import json
import shutil

from transformers import AutoTokenizer

from uptrain.data import DataSource, documents
from uptrain.data.blocks import token_blocks

from conftest import EXAMPLE_MHA8, VALID_TXT


def _expected_blocks(tokenizer, texts: list[str], seq_len: int) -> list[list[int]]:
    """Blocks packed by hand: each document's tokens then EOS, cut into full blocks (one map batch)."""
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    return [stream[i * seq_len:(i + 1) * seq_len] for i in range(len(stream) // seq_len)]


def test_cache_is_keyed_by_the_tokenizer_content_not_its_folder(tmp_path):
    # Issue 23.2: tokenizer A saved in a folder, packed; tokenizer B of the same size and EOS saved
    # in the same folder (two ids swapped), packed again: the second call must give B's blocks.
    folder = tmp_path / "tokenizer"
    shutil.copytree(EXAMPLE_MHA8, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    data = tmp_path / "stories.txt"
    shutil.copy(VALID_TXT, data)
    a = AutoTokenizer.from_pretrained(folder)
    texts = documents(DataSource(files=[str(data)]))
    blocks_a = token_blocks(texts, a, seq_len=32)["input_ids"]
    assert blocks_a == _expected_blocks(a, texts["text"], 32)

    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    first, second = "▁the", "▁and"  # frequent in the stories: many blocks change
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    b = AutoTokenizer.from_pretrained(folder)
    assert (b.name_or_path, len(b), b.eos_token_id) == (a.name_or_path, len(a), a.eos_token_id)
    assert b(texts["text"][0])["input_ids"] != a(texts["text"][0])["input_ids"]

    blocks_b = token_blocks(documents(DataSource(files=[str(data)])), b, seq_len=32)["input_ids"]
    assert blocks_b == _expected_blocks(b, texts["text"], 32), "the cache gave another tokenizer's blocks"


def test_tokenizer_fingerprint_is_the_same_in_another_process():
    # The cache is only a cache if a second run (another process) computes the same key.
    import subprocess
    import sys

    from uptrain.data.blocks import tokenizer_fingerprint

    here = tokenizer_fingerprint(AutoTokenizer.from_pretrained(EXAMPLE_MHA8))
    code = ("from transformers import AutoTokenizer; from uptrain.data.blocks import tokenizer_fingerprint; "
            f"print(tokenizer_fingerprint(AutoTokenizer.from_pretrained({str(EXAMPLE_MHA8)!r})))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there and len(here) == 64


def _read_again_at(block: list[int], original: list[int]) -> int | None:
    """Where `block` reads `original`'s first P tokens again (the gap g), found by search; None if nowhere."""
    n = len(original)
    p = max(1, n // 8)
    for g in range(n - 2 * p + 1):
        if block == original[:p + g] + original[:p] + original[p + g:n - p]:
            return g
    return None


def test_read_again_keeps_the_length_reads_the_passage_at_every_distance_and_is_drawn_from_the_block():
    """`read_again` over 3,000 random blocks of 8 to 600 tokens: the same length, the block's first P
    tokens read again after g uniform in 0..len - 2P, the rest the text that followed; about `share` of
    blocks changed; the same block always drawn the same way."""
    import random

    from uptrain.data.blocks import read_again

    rng = random.Random(0)
    for share in (0.0, 0.3, 1.0):
        changed, gaps = 0, []
        for _ in range(1000):
            block = [rng.randrange(32000) for _ in range(rng.randint(8, 600))]
            out = read_again(block, share)
            assert len(out) == len(block) and out == read_again(list(block), share)
            if out != block:
                changed += 1
                g = _read_again_at(out, block)
                assert g is not None
                gaps.append(g / (len(block) - 2 * max(1, len(block) // 8)))
        assert abs(changed / 1000 - share) < 0.05
        if gaps:
            assert min(gaps) < 0.05 and max(gaps) > 0.95 and 0.4 < sum(gaps) / len(gaps) < 0.6


def test_the_trainer_reads_passages_again_in_training_blocks_only(tmp_path):
    """data.copy_repeats=1: every training block `build_data` gives is a packed block with its passage read
    again; the validation blocks are the plain packing; the share is part of the tokenization cache's key."""
    from accelerate import Accelerator
    from train_helpers import DEMO, built_gqa4, tiny_overrides
    from uptrain.train.config import load_config
    from uptrain.train.setup import build_data, plan_run

    tokenizer = AutoTokenizer.from_pretrained(EXAMPLE_MHA8)
    texts = documents(DataSource(files=[str(VALID_TXT)]))["text"]
    plain = _expected_blocks(tokenizer, texts, 64)
    for share in (1.0, 0.0):
        config = load_config(DEMO, tiny_overrides(tmp_path / f"run{share}", steps=2, **{
            "model": built_gqa4(), "data.train.files": f"[{VALID_TXT}]", "data.val.files": f"[{VALID_TXT}]",
            "data.seq_len": 64, "data.copy_repeats": share}))
        train, val, _, _, _ = build_data(config, tokenizer, plan_run(config, 1), Accelerator(cpu=True))
        assert [list(b) for b in val["input_ids"]] == plain
        by_start = {tuple(p[:8]): p for p in plain}  # a block's first P = 8 tokens stay where they were
        trained = [list(b) for b in train["input_ids"]]
        assert trained and all(tuple(b[:8]) in by_start for b in trained)
        if share:
            assert all(b != by_start[tuple(b[:8])] and _read_again_at(b, by_start[tuple(b[:8])]) is not None
                       for b in trained)
        else:
            assert all(b in plain for b in trained)
