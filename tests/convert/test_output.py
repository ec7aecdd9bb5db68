"""What a converted folder says about itself (model card) and how it reaches the disk (fsync)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import yaml
from transformers import AutoConfig

from test_source import hub_cache, run_cli
from tiny import random_model, save
from uptrain.convert import convert
from uptrain.convert.__main__ import main

SOURCE_CARD = """---
license: apache-2.0
language:
- en
tags:
- stories
- tiny
datasets:
- roneneldan/TinyStories
---
# stories260K

The source's own card text.
"""


def front_matter(card: str) -> dict:
    assert card.startswith("---\n"), card[:80]
    return yaml.safe_load(card.split("---\n", 2)[1])


def test_card_keeps_the_source_metadata_and_names_the_base_model(mha8, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(mha8, src)
    (src / "README.md").write_text(SOURCE_CARD)
    cache = hub_cache(tmp_path, src)
    proc = run_cli(["uptrain-test/stories", "--kv-heads", "2", "--out", str(tmp_path / "out")], cache)
    assert proc.returncode == 0, proc.stderr
    meta = front_matter((tmp_path / "out" / "README.md").read_text())
    assert meta["license"] == "apache-2.0" and meta["language"] == ["en"]
    assert meta["datasets"] == ["roneneldan/TinyStories"]
    assert {"stories", "tiny", "gqa", "uptrain"} <= set(meta["tags"])
    assert meta["base_model"] == "uptrain-test/stories" and meta["base_model_relation"] == "finetune"
    assert meta["library_name"] == "transformers"


def test_card_of_a_local_folder_without_a_card(mha8, tmp_path):
    convert(str(mha8), tmp_path / "out", 2)
    card = (tmp_path / "out" / "README.md").read_text()
    meta = front_matter(card)
    assert "gqa" in meta["tags"] and meta["library_name"] == "transformers"
    # a local path is not a Hub id (the Hub would reject it as base_model); the card text names it instead
    assert "base_model" not in meta and "base_model_relation" not in meta
    assert str(mha8) in card and "4.0x smaller" in card


def test_falcon_card_says_the_cache_does_not_shrink(tmp_path, capsys):
    cfg = AutoConfig.for_model("falcon", hidden_size=64, num_attention_heads=8, num_kv_heads=8, num_hidden_layers=2,
                               new_decoder_architecture=True, alibi=False, bias=True, vocab_size=128)
    src = save(random_model(cfg), tmp_path / "src")
    assert main([str(src), "--kv-heads", "2", "--out", str(tmp_path / "out")]) == 0
    card = (tmp_path / "out" / "README.md").read_text()
    printed = capsys.readouterr().out
    for text in (card, printed):
        assert "1.0x smaller" not in text
        assert "does not shrink" in text


def test_every_file_and_the_folder_reach_the_disk_before_the_rename(mha8, tmp_path, monkeypatch):
    """Observe the real fsync/rename calls of a conversion (fd -> path through /proc/self/fd)."""
    events: list[tuple[str, str]] = []
    real_fsync, real_rename, real_replace = os.fsync, os.rename, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)

    def renaming(real, kind):
        def rename(a, b, *args, **kwargs):
            events.append((kind, os.fspath(a), os.fspath(b)))
            return real(a, b, *args, **kwargs)
        return rename
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", renaming(real_rename, "rename"))
    monkeypatch.setattr(os, "replace", renaming(real_replace, "rename"))
    out = (tmp_path / "out").resolve()
    convert(str(mha8), out, 4, max_shard_size="200KB")
    final = [i for i, e in enumerate(events) if e[0] == "rename" and Path(e[2]) == out]
    assert len(final) == 1, events
    tmp = Path(events[final[0]][1])
    synced_before = {Path(e[1]) for e in events[:final[0]] if e[0] == "fsync"}
    files = sorted(p.name for p in out.iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) > 1
    assert [f for f in files if tmp / f not in synced_before] == []
    assert tmp in synced_before
    assert out.parent in {Path(e[1]) for e in events[final[0] + 1:] if e[0] == "fsync"}


@pytest.mark.parametrize("exchange", [True, False])
def test_a_forced_replacement_reaches_the_disk_before_the_old_output_leaves(mha8, tmp_path, monkeypatch, exchange):
    """--force over an existing output: every new file is fsynced before the swap; on the two-step
    path the 'complete' mark is synced (parent folder) before the old output moves, and the
    parent again after the new one is in place."""
    from uptrain.convert.io import output_dir as shards
    out = (tmp_path / "out").resolve()
    convert(str(mha8), out, 4)
    events: list[tuple] = []
    real_fsync, real_rename, real_exchange = os.fsync, os.rename, shards.exchange_paths

    def fsync(fd):
        events.append(("fsync", Path(os.readlink(f"/proc/self/fd/{fd}"))))
        return real_fsync(fd)

    def rename(a, b, *args, **kwargs):
        events.append(("rename", Path(a), Path(b)))
        return real_rename(a, b, *args, **kwargs)

    def exchange_paths(a, b):
        done = real_exchange(a, b) if exchange else False
        events.append(("exchange" if done else "no exchange", Path(a), Path(b)))
        return done
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shards, "exchange_paths", exchange_paths)
    convert(str(mha8), out, 2, force=True)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    kinds = [e[0] for e in events]
    first_move = kinds.index("exchange") if "exchange" in kinds else \
        next(i for i, e in enumerate(events) if e[0] == "rename" and e[1] == out)
    if exchange and "exchange" not in kinds:
        pytest.skip("no renameat2(RENAME_EXCHANGE) on this filesystem")
    tmp = events[kinds.index("no exchange" if not exchange else "exchange")][1]
    synced = {e[1] for e in events[:first_move] if e[0] == "fsync"}
    assert {tmp / p.name for p in out.iterdir()} | {tmp} <= synced
    assert ("fsync", out.parent) in events[first_move:]
    if not exchange:  # tmp -> complete, parent synced, out -> old, complete -> out, parent synced
        renames = [e for e in events if e[0] == "rename" and e[1].parent == out.parent]  # folders, not shards
        complete, old = renames[0][2], renames[1][2]
        assert [r[1:] for r in renames] == [(tmp, complete), (out, old), (complete, out)]
        assert ".complete-" in complete.name and ".old-" in old.name
        assert events.index(("fsync", out.parent)) < events.index(renames[1])
