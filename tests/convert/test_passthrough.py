"""Copying the kept tensors while torch and transformers load: the header-only listing against the
full reader, the guess against the plan, the CLI's early copy against the library path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig

from tiny import random_model, save
from uptrain.convert import RECORD_FILE, convert
from uptrain.convert import __main__ as cli
from uptrain.convert.io.passthrough import DTYPE_BYTES, kept_by_pooling, stored_tensors
from uptrain.convert.pipeline import kept_ranges, prepare
from uptrain.convert.io.source import DTYPE_NAMES, SAFETENSORS_DTYPES, open_checkpoint


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    """A Llama checkpoint in several safetensors shards with an index (0.8 MB)."""
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=512)
    return save(random_model(cfg), tmp_path_factory.mktemp("sharded") / "src", max_shard_size="200KB")


def test_header_listing_matches_the_full_reader(sharded):
    listed = stored_tensors(sharded)
    infos = open_checkpoint(sharded).tensors
    assert len(list(sharded.glob("*.safetensors"))) > 2
    assert {(t.name, t.shape, t.dtype, t.file, t.offset) for t in listed} == \
           {(i.name, i.shape, DTYPE_NAMES[i.dtype], i.file, i.offset) for i in infos}


def test_dtype_sizes_agree_with_torch():
    assert {name: dtype.itemsize for name, dtype in SAFETENSORS_DTYPES.items()} == DTYPE_BYTES


def test_unreadable_headers_give_no_listing(tmp_path, sharded):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)  # header length far beyond the file
    assert stored_tensors(tmp_path) is None
    short = tmp_path / "short"
    short.mkdir()
    data = sorted(sharded.glob("*.safetensors"))[0].read_bytes()
    (short / "model.safetensors").write_bytes(data[:-10])  # the last tensor runs past the end
    assert stored_tensors(short) is None and stored_tensors(tmp_path / "missing") is None


def test_the_guess_is_what_the_plan_copies(sharded, tmp_path):
    config = json.loads((sharded / "config.json").read_text())
    guess = kept_by_pooling(sharded, config)
    _, _, outputs, _ = prepare(str(sharded), 2)
    assert guess and set(guess) == set(kept_ranges(outputs))
    assert not any("k_proj" in t.name or "v_proj" in t.name for t in guess)
    # Falcon's registry entry depends on config values whose defaults live in transformers: no guess
    assert kept_by_pooling(sharded, config | {"model_type": "falcon"}) is None
    assert kept_by_pooling(sharded, config | {"model_type": "gpt2"}) is None


def test_the_cli_starts_copying_before_importing_torch_or_transformers():
    code = ("import sys, uptrain.convert.__main__\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'safetensors'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name != RECORD_FILE}


def test_early_copy_writes_the_same_folder_as_the_library(sharded, tmp_path, capsys):
    """The CLI (copy while planning) and `convert` (plan, then copy) write byte-identical folders."""
    assert cli.main([str(sharded), "--kv-heads", "2", "--out", str(tmp_path / "cli"), "--max-shard-size", "300KB",
                     "--verbose"]) == 0
    printed = capsys.readouterr().out
    convert(str(sharded), tmp_path / "api", 2, max_shard_size="300KB")
    assert files(tmp_path / "cli") == files(tmp_path / "api")
    records = [json.loads((tmp_path / d / RECORD_FILE).read_text()) for d in ("cli", "api")]
    assert [r["streams"]["copied_while_planning"] for r in records] == [True, False]
    streams = records[0]["streams"]
    assert streams["built_tensors"] == 6 and streams["kept_tensors"] == len(open_checkpoint(sharded).tensors) - 6
    assert "import" in records[0]["timing_s"] and "(import, plan, read, pool, write built beside" in printed
    assert printed.index("K/V heads 8 -> 2") < printed.index("wrote")


def test_a_wrong_guess_is_discarded_and_the_plan_written(sharded, tmp_path, monkeypatch):
    """Should the headers suggest keeping a tensor that the plan changes, the early copy is thrown
    away and the plan written from scratch: same folder as the library's."""
    every_tensor = stored_tensors(sharded)  # k_proj/v_proj included: wrong for a 8 -> 2 pooling
    monkeypatch.setattr(cli, "kept_by_pooling", lambda folder, config: every_tensor)
    assert cli.main([str(sharded), "--kv-heads", "2", "--out", str(tmp_path / "cli")]) == 0
    convert(str(sharded), tmp_path / "api", 2)
    assert files(tmp_path / "cli") == files(tmp_path / "api")
    assert not json.loads((tmp_path / "cli" / RECORD_FILE).read_text())["streams"]["copied_while_planning"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["api", "cli"]


def test_bad_input_found_while_copying_leaves_nothing(sharded, tmp_path, capsys):
    """--kv-heads 3 is refused by the plan, after the early copy began: exit 2, one line, no folder."""
    before = files(sharded)
    assert cli.main([str(sharded), "--kv-heads", "3", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: 3 does not divide the 8 K/V heads") and "\n" not in err
    assert list(tmp_path.iterdir()) == [] and files(sharded) == before
