"""Reading real text into training blocks: documents, token blocks, schedule (uptrain.data)."""

from __future__ import annotations

import json
import re

import datasets
import pytest
from transformers import AutoTokenizer

from uptrain.data import DataSource, documents, split_documents
from uptrain.data.blocks import require_blocks, token_blocks
from uptrain.data.schedule import StreamSchedule, schedule_blocks
from uptrain.errors import UsageError

from conftest import EXAMPLE_MHA8, TRAIN_TXT as TRAIN, VALID_TXT as VALID
from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture: build_data makes an Accelerator)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(EXAMPLE_MHA8)  # stories260K's tokenizer (all its forms share it)


def test_blocks_are_the_documents_joined_by_eos(tokenizer):
    docs = ["Once upon a time there was a cat.", "The dog ran.", "Lily smiled at the sun and the sky."]
    blocks = token_blocks(datasets.Dataset.from_dict({"text": docs}), tokenizer, seq_len=8)
    stream = []
    for doc in docs:
        stream += tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]
    assert len(blocks) == len(stream) // 8
    assert all(len(row) == 8 for row in blocks["input_ids"])
    flat = [t for row in blocks["input_ids"] for t in row]
    assert flat == stream[: len(flat)]  # order kept, only the tail that fills no block dropped
    assert tokenizer.eos_token_id in flat


def test_real_file_packs_and_splits(tokenizer):
    docs = documents(DataSource(files=[str(VALID)]))
    blocks = token_blocks(docs, tokenizer, seq_len=64)
    n_tokens = sum(len(tokenizer(t)["input_ids"]) + 1 for t in docs["text"])
    assert len(blocks) == n_tokens // 64 or len(blocks) == n_tokens // 64 - 1  # one map batch: <= 1 short
    train_docs, val_docs = split_documents(docs, 0.1, 0)
    train, val = token_blocks(train_docs, tokenizer, seq_len=64), token_blocks(val_docs, tokenizer, seq_len=64)
    assert len(train) + len(val) <= len(blocks) <= len(train) + len(val) + 1  # each part drops its tail
    assert not set(map(tuple, train["input_ids"])) & set(map(tuple, val["input_ids"]))


def test_schedule_is_seeded_and_repeats_only_when_asked():
    blocks = datasets.Dataset.from_dict({"input_ids": [[i, i] for i in range(10)]})
    a = schedule_blocks(blocks, 10, seed=3, repeat_data=False)["input_ids"]
    assert a == schedule_blocks(blocks, 10, seed=3, repeat_data=False)["input_ids"]
    assert sorted(r[0] for r in a) == list(range(10)) and a != blocks["input_ids"]
    with pytest.raises(UsageError, match="repeat_data"):
        schedule_blocks(blocks, 11, seed=3, repeat_data=False)
    rows = schedule_blocks(blocks, 25, seed=3, repeat_data=True)["input_ids"]
    assert rows[:10] == a and sorted(r[0] for r in rows[10:20]) == list(range(10))
    assert rows[10:20] != a  # each epoch is reshuffled


def test_source_without_full_block_is_a_usage_error(tokenizer, tmp_path):
    short = tmp_path / "short.txt"
    short.write_text("Hi.\n")
    with pytest.raises(UsageError, match="no full block"):
        require_blocks(token_blocks(documents(DataSource(files=[str(short)])), tokenizer, seq_len=512), 512, "short.txt")


def test_stream_gives_the_blocks_of_the_whole_file_in_order(tokenizer, tmp_path):
    # Same text, same map batches: the lazily packed stream is the packed dataset, block for block.
    # (The trainer's order still differs: a whole dataset is shuffled globally by the seed, a
    # stream is read in order or through a seeded shuffle buffer.)
    lines = [line for line in TRAIN.read_text().splitlines() if line.strip()] * 2  # > one map batch
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"story": line}) + "\n" for line in lines))
    whole = token_blocks(documents(DataSource(files=[str(jsonl)], text_field="story")), tokenizer, seq_len=64)["input_ids"]
    whole = list(whole)
    assert len(lines) > 1000  # more than one map batch of documents
    source = DataSource(files=[str(jsonl)], text_field="story", streaming=True)

    def blocks(n, **kw):
        stream = token_blocks(documents(source), tokenizer, 64)
        return [row["input_ids"].tolist() for row in StreamSchedule(stream, n, seed=0, **kw)]

    assert blocks(len(whole), repeat_data=False) == whole
    assert blocks(len(whole), repeat_data=False, skip=len(whole) - 5) == whole[-5:]  # resume: the rest
    with pytest.raises(UsageError, match="ended after .* set data.repeat_data=true"):
        blocks(len(whole) + 1, repeat_data=False)
    assert blocks(len(whole) + 3, repeat_data=True) == whole + whole[:3]  # next epoch, same order
    shuffled = blocks(len(whole) + 20, repeat_data=True, shuffle_buffer=50)
    assert shuffled == blocks(len(whole) + 20, repeat_data=True, shuffle_buffer=50)  # seeded
    assert shuffled[:len(whole)] != whole and sorted(shuffled[:len(whole)]) == sorted(whole)
    assert shuffled[len(whole):] != shuffled[:20]  # each epoch is reshuffled (seed + epoch)


# ---------------------------------------------------------------- text units and document split

UNITS_TEXT = "Tom ran.\nHe fell.\n\nSue sang.\n\n\nThe end.\n"


@pytest.mark.parametrize("unit, expected", [
    ("line", ["Tom ran.", "He fell.", "Sue sang.", "The end."]),
    ("paragraph", ["Tom ran.\nHe fell.", "Sue sang.", "The end."]),  # a blank line ends a document
    ("file", ["Tom ran.\nHe fell.\n\nSue sang.\n\n\nThe end."]),
])
@pytest.mark.parametrize("streaming", [False, True])
def test_text_units_split_a_txt_file_into_documents(tmp_path, unit, expected, streaming):
    path = tmp_path / "doc.txt"
    path.write_text(UNITS_TEXT)
    texts = documents(DataSource(files=[str(path)], text_unit=unit, streaming=streaming))
    assert [row["text"] for row in texts] == expected


def test_default_text_unit_is_the_paragraph_and_a_bad_one_is_a_usage_error(tmp_path):
    path = tmp_path / "doc.txt"
    path.write_text(UNITS_TEXT)
    assert DataSource(files=[str(path)]).text_unit == "paragraph"
    with pytest.raises(UsageError, match="text_unit 'sentence'.*line, paragraph, file"):
        documents(DataSource(files=[str(path)], text_unit="sentence"))


def test_shipped_samples_read_as_whole_stories():
    # Each TinyStories story is one document: its paragraphs stay together, nothing else joins it.
    train = documents(DataSource(files=[str(TRAIN)]))["text"]
    valid = documents(DataSource(files=[str(VALID)]))["text"]
    assert (len(train), len(valid)) == (246, 19)
    assert train[0].startswith("One day, a little girl named Lily found a needle") and train[0].count("\n") == 2
    assert train[0].endswith("because they had shared and worked together.")
    assert train[1].startswith("Once upon a time, there was a little car named Beep.")


def _marked_documents(n: int) -> list[str]:
    """`n` documents of two paragraphs; every sentence of document i carries the marker [i]."""
    return [f"[{i}] Tom saw a red ball. [{i}] He ran to it.\n[{i}] The ball was big. [{i}] Tom was happy."
            for i in range(n)]


def _markers(tokenizer, block: list[int]) -> set[int]:
    return {int(m) for m in re.findall(r"\[(\d+)\]", tokenizer.decode(block))}


def test_val_fraction_holds_out_whole_documents(tokenizer, tmp_path):
    from accelerate import Accelerator
    from train_helpers import DEMO, built_gqa4, tiny_overrides
    from uptrain.train.config import load_config
    from uptrain.train.setup import build_data, plan_run

    docs = _marked_documents(60)
    path = tmp_path / "marked.txt"
    path.write_text("\n\n".join(docs) + "\n")
    # A budget beyond the train blocks: the schedule's first epoch is a permutation of all of them.
    config = load_config(DEMO, tiny_overrides(tmp_path / "run", steps=20, **{
        "model": built_gqa4(), "data.train.files": f"[{path}]", "data.val": "null", "data.val_fraction": 0.2,
        "data.seq_len": 32, "data.repeat_data": "true"}))
    train, val, n_train, _, _ = build_data(config, tokenizer, plan_run(config, 1), Accelerator(cpu=True))
    assert len(train) >= n_train
    val_blocks = [list(b) for b in val["input_ids"]]
    held_out = set().union(*(_markers(tokenizer, b) for b in val_blocks))
    trained = set().union(*(_markers(tokenizer, list(b)) for b in train["input_ids"]))
    assert 0 < len(held_out) <= 0.2 * len(docs) + 1 and not held_out & trained
    # Between two EOS, the validation stream holds exactly one whole document.
    flat = [t for b in val_blocks for t in b]
    eos = [i for i, t in enumerate(flat) if t == tokenizer.eos_token_id]
    assert len(eos) >= 3
    for start, end in zip(eos, eos[1:]):
        piece = flat[start + 1:end]
        (i,) = _markers(tokenizer, piece)
        assert piece == tokenizer(docs[i])["input_ids"]


def test_an_unreachable_hub_dataset_fails_at_once_with_one_line(monkeypatch):
    """No network here: the probe's connection error is the answer, before datasets' retries."""
    import time

    from uptrain.data.source import check_hub_reachable

    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    with pytest.raises(UsageError, match="cannot reach the Hugging Face Hub to load dataset 'org/data'"):
        documents(DataSource(dataset="org/data"))
    assert time.monotonic() - start < 30  # a bound, not a timing claim: no retry loop
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    check_hub_reachable("org/data")  # offline mode: datasets reads its cache, nothing is asked


def test_a_held_out_share_without_a_full_block_is_a_usage_error(tokenizer, tmp_path):
    from accelerate import Accelerator
    from train_helpers import DEMO, built_gqa4, tiny_overrides
    from uptrain.train.config import load_config
    from uptrain.train.setup import build_data, plan_run

    path = tmp_path / "marked.txt"
    path.write_text("\n\n".join(_marked_documents(60)) + "\n")  # documents of ~40 tokens
    config = load_config(DEMO, tiny_overrides(tmp_path / "run", **{
        "model": built_gqa4(), "data.train.files": f"[{path}]", "data.val": "null", "data.val_fraction": 0.01,
        "data.repeat_data": "true"}))  # one held-out document < seq_len 64
    with pytest.raises(UsageError, match=r"held-out 0.01 of .* \(1 documents\) .*raise data.val_fraction or give data.val"):
        build_data(config, tokenizer, plan_run(config, 1), Accelerator(cpu=True))


def test_documents_held_out_of_the_training_text_are_written_for_uptrain_eval(tmp_path):
    # Without data.val the run validates on a held-out share of the training documents: they are
    # written whole to run_dir/held_out.jsonl (what the README's eval line scores), none trained on.
    from train_helpers import DEMO, need_models, tiny_overrides
    from uptrain.data import read_documents
    from uptrain.train.__main__ import main
    from uptrain.train.config import load_config

    need_models()
    run_dir = tmp_path / "run"
    assert main([str(DEMO), *tiny_overrides(run_dir, steps=2, threads=1, **{
        "data.val": "null", "data.val_fraction": 0.1, "optim.warmup_steps": 1})]) == 0
    held = [json.loads(line)["text"] for line in (run_dir / "held_out.jsonl").read_text().splitlines()]
    everything = read_documents(DataSource(files=[str(TRAIN)]))
    assert len(held) == round(0.1 * len(everything)) and set(held) <= set(everything)
    config = load_config(DEMO, tiny_overrides(run_dir, **{"data.val": "null", "data.val_fraction": 0.1}))
    train_docs, _ = split_documents(documents(config.data.train), 0.1, config.seed)
    assert not set(held) & set(train_docs["text"])  # never trained on
