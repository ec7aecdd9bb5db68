"""Tokenization and packing of real text into training blocks (uptrain.packing)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
from transformers import AutoTokenizer

from uptrain.train.sources import DataSource, load_texts
from uptrain.errors import UsageError
from uptrain.train.packing import StreamSchedule, load_blocks, pack_texts, schedule_blocks, split_blocks

SHARED = Path(__file__).resolve().parents[2].parent / "shared"
MODEL = SHARED / "data" / "models" / "stories260K-gqa4"
VALID = SHARED / "data" / "corpora" / "tinystories-valid-sample.txt"
TRAIN = SHARED / "data" / "corpora" / "tinystories-train-sample.txt"


@pytest.fixture(scope="module")
def tokenizer():
    if not MODEL.exists():
        pytest.skip(f"needs {MODEL} (../shared is absent on this machine)")
    return AutoTokenizer.from_pretrained(MODEL)


def test_blocks_are_the_documents_joined_by_eos(tokenizer):
    docs = ["Once upon a time there was a cat.", "The dog ran.", "Lily smiled at the sun and the sky."]
    blocks = pack_texts(datasets.Dataset.from_dict({"text": docs}), tokenizer, seq_len=8)
    stream = []
    for doc in docs:
        stream += tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id]
    assert len(blocks) == len(stream) // 8
    assert all(len(row) == 8 for row in blocks["input_ids"])
    flat = [t for row in blocks["input_ids"] for t in row]
    assert flat == stream[: len(flat)]  # order kept, only the tail that fills no block dropped
    assert tokenizer.eos_token_id in flat


def test_real_file_packs_and_splits(tokenizer):
    if not VALID.exists():
        pytest.skip(f"needs {VALID}")
    blocks = load_blocks(DataSource(files=[str(VALID)]), tokenizer, seq_len=64)
    n_tokens = sum(len(tokenizer(t)["input_ids"]) + 1 for t in load_texts(DataSource(files=[str(VALID)]))["text"])
    assert len(blocks) == n_tokens // 64 or len(blocks) == n_tokens // 64 - 1  # one map batch: <= 1 short
    train, val = split_blocks(blocks, None, 0.1, seed=0)
    assert len(train) + len(val) == len(blocks) and len(val) == round(0.1 * len(blocks))
    assert not set(map(tuple, train["input_ids"])) & set(map(tuple, val["input_ids"]))
    given = blocks.select(range(3))
    assert split_blocks(blocks, given, 0.1, seed=0) == (blocks, given)


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
        load_blocks(DataSource(files=[str(short)]), tokenizer, seq_len=512)


def test_stream_gives_the_blocks_of_the_whole_file_in_order(tokenizer, tmp_path):
    # Same text, same map batches: the lazily packed stream is the packed dataset, block for block.
    # (The trainer's order still differs: a whole dataset is shuffled globally by the seed, a
    # stream is read in order or through a seeded shuffle buffer.)
    if not TRAIN.exists():
        pytest.skip(f"needs {TRAIN}")
    lines = [line for line in TRAIN.read_text().splitlines() if line.strip()] * 2  # > one map batch
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"story": line}) + "\n" for line in lines))
    whole = load_blocks(DataSource(files=[str(jsonl)], text_field="story"), tokenizer, seq_len=64)["input_ids"]
    whole = list(whole)
    assert len(lines) > 1000  # more than one map batch of documents
    source = DataSource(files=[str(jsonl)], text_field="story", streaming=True)

    def blocks(n, **kw):
        return [row["input_ids"].tolist() for row in StreamSchedule(source, tokenizer, 64, n, seed=0, **kw)]

    assert blocks(len(whole), repeat_data=False) == whole
    assert blocks(len(whole), repeat_data=False, skip=len(whole) - 5) == whole[-5:]  # resume: the rest
    with pytest.raises(UsageError, match="ended after .* set data.repeat_data=true"):
        blocks(len(whole) + 1, repeat_data=False)
    assert blocks(len(whole) + 3, repeat_data=True) == whole + whole[:3]  # next epoch, same order
    shuffled = blocks(len(whole) + 20, repeat_data=True, shuffle_buffer=50)
    assert shuffled == blocks(len(whole) + 20, repeat_data=True, shuffle_buffer=50)  # seeded
    assert shuffled[:len(whole)] != whole and sorted(shuffled[:len(whole)]) == sorted(whole)
    assert shuffled[len(whole):] != shuffled[:20]  # each epoch is reshuffled (seed + epoch)
