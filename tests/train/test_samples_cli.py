"""`python -m uptrain.train.samples MODEL --tokens N --out FILE`: the model's own text as a file of its own
(issue 60, the no-data quality path: samples -> convert --calib -> train on them, docs/own-model.md).

It writes FILE (one {"text": ...} per document, about N tokens); a real Ctrl-C ends it in one line that
names the kept batches, exit 130, and the same command continues from them to the file an uninterrupted
run writes; bad input is one line, exit 2, nothing written and no model loaded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from conftest import EXAMPLE_MHA8, REPO

MHA8 = EXAMPLE_MHA8
SMALL = ["--max-new-tokens", "64", "--batch", "4", "--seed", "5", "--threads", "1"]  # 256 tokens a batch


def _argv(out: Path, tokens: int, *extra: str) -> list[str]:
    return [str(MHA8), "--tokens", str(tokens), "--out", str(out), *SMALL, *extra]


def test_the_command_writes_the_models_samples_as_jsonl_of_about_the_tokens_asked(tmp_path, capsys):
    from transformers import AutoTokenizer
    from uptrain.train.samples import main

    out = tmp_path / "data" / "samples.jsonl"  # a parent folder that does not exist yet is made
    assert main(_argv(out, 1000)) == 0
    printed = capsys.readouterr().out
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records and all(set(r) == {"text"} and r["text"].strip() for r in records), records[:3]
    made = int(re.search(r"([\d,]+) tokens written to", printed).group(1).replace(",", ""))
    assert 1000 <= made < 1000 + 64, printed  # within one document of what was asked
    tokenizer = AutoTokenizer.from_pretrained(MHA8)
    counted = sum(len(tokenizer(r["text"], add_special_tokens=False)["input_ids"]) for r in records)
    assert 0.8 * made <= counted <= 1.1 * made, (counted, made)  # the text holds them (decoded, encoded again)
    assert re.search(r"teacher samples: generating 1,000 tokens, 4 sequences at a time on cpu", printed), printed
    assert sorted(p.name for p in out.parent.iterdir()) == ["samples.jsonl"]  # no batches, no temporary file left


def test_a_ctrl_c_names_the_kept_batches_in_one_line_and_the_rerun_ends_as_an_uninterrupted_run(tmp_path, capsys):
    from uptrain.train.samples import batches_folder, main

    out = tmp_path / "samples.jsonl"
    chunks = batches_folder(out) / "chunks"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "uptrain.train.samples", *_argv(out, 4000)], cwd=tmp_path,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and not list(chunks.glob("chunk-*.json")) and time.monotonic() < deadline:
        time.sleep(0.002)
    proc.send_signal(signal.SIGINT)  # Ctrl-C once the first batch is kept (16 batches in all)
    err = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, err[-3000:]
    kept = len(list(chunks.glob("chunk-*.json")))
    assert kept >= 1 and not out.exists(), err
    assert err.strip().splitlines() == [
        f"uptrain.train.samples: interrupted; {out} was not written; {kept} sample batch{'es' * (kept > 1)} kept "
        f"in {chunks.parent}; the same command continues from them"], err

    whole = tmp_path / "whole.jsonl"
    assert main(_argv(whole, 4000)) == 0  # never stopped: the reference
    capsys.readouterr()
    assert main(_argv(out, 4000)) == 0  # the same command again
    printed = capsys.readouterr().out
    assert f"{kept} batches kept from a stopped run" in printed, printed
    assert out.read_text() == whole.read_text() and not chunks.parent.exists()


def _refusals(tmp_path: Path) -> list[tuple[list[str], str]]:
    existing = tmp_path / "old.jsonl"
    existing.write_text('{"text": "kept"}\n')
    a_file = tmp_path / "file.txt"
    a_file.write_text("not a folder")
    out = tmp_path / "samples.jsonl"
    return [
        ([str(tmp_path / "no-model"), "--tokens", "100", "--out", str(out)], "model folder .* does not exist"),
        ([str(MHA8), "--tokens", "0", "--out", str(out)], r"argument --tokens: must be >= 1, got 0"),
        ([str(MHA8), "--tokens", "100", "--out", str(a_file / "samples.jsonl")], r"file.txt is a file, not a folder"),
        ([str(MHA8), "--tokens", "100", "--out", str(existing)], r"old.jsonl exists; .* --force"),
        ([str(MHA8), "--tokens", "100", "--out", str(tmp_path / "samples.txt")], r"name the file \.jsonl"),
        ([str(MHA8), "--tokens", "100", "--out", str(MHA8 / "samples.jsonl")], "inside the source checkpoint"),
        ([str(MHA8), "--tokens", "100", "--out", str(out), "--prompts", str(tmp_path / "none.txt")],
         "--prompts file .* does not exist"),
        ([str(MHA8), "--tokens", "100", "--out", str(out), "--top-p", "0"], r"--top-p must be in \(0, 1\]"),
    ]


def test_bad_input_is_one_line_exit_2_before_the_model_loads_and_nothing_is_written(tmp_path, capsys, monkeypatch):
    from uptrain.train.model import teacher_samples
    from uptrain.train.samples import _parser, check_args, main

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")
    monkeypatch.setattr(teacher_samples, "teacher_text_file", never)
    cases = _refusals(tmp_path)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    model_files = sorted(p.name for p in MHA8.iterdir())
    for argv, expected in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("error: ") and re.search(expected, err), (argv, err)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written, no batches folder
    assert sorted(p.name for p in MHA8.iterdir()) == model_files
    assert (tmp_path / "old.jsonl").read_text() == '{"text": "kept"}\n'
    # --force lets an existing file be replaced (at the end, whole)
    check_args(_parser().parse_args([str(MHA8), "--tokens", "100", "--out", str(tmp_path / "old.jsonl"), "--force"]))


def test_the_console_script_is_the_command():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["uptrain-samples"] == "uptrain.train.samples:main"
    source = (REPO / "uptrain" / "train" / "samples.py").read_text()
    # the stop handling is installed before torch and transformers import, as for uptrain-demo and uptrain-sweep
    assert source.index('is_command(__name__, "uptrain-samples")') < source.index("import argparse")
