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
