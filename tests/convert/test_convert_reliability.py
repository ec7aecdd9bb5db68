"""A conversion killed at any moment or out of disk leaves nothing at the output path, and the
source untouched; the rerun succeeds."""

from __future__ import annotations

import hashlib
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

from transformers import LlamaConfig

from tiny import load, random_model, save


def digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def cli(src: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "uptrain.convert", str(src), "--kv-heads", "4", "--out", str(out),
            "--max-shard-size", "20MB", *extra]


def medium_checkpoint(tmp_path: Path) -> Path:
    cfg = LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=8, vocab_size=1024)
    return save(random_model(cfg), tmp_path / "src", max_shard_size="20MB")


def test_sigkill_while_writing_leaves_no_output_and_rerun_succeeds(tmp_path):
    src = medium_checkpoint(tmp_path)
    before = digest(src)
    out = tmp_path / "out"
    proc = subprocess.Popen(cli(src, out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:  # wait until shards are being written, then kill
        partial = list(tmp_path.glob(".out.partial-*/*.safetensors"))
        if partial or proc.poll() is not None:
            break
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert partial, "the conversion finished before it could be killed; make the checkpoint bigger"
    assert not out.exists()
    assert digest(src) == before
    subprocess.run(cli(src, out), check=True, capture_output=True)
    load(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]  # the stale partial is gone


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (5_000_000, 5_000_000))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG from write(), as a full disk gives ENOSPC


def test_disk_full_gives_one_line_and_removes_the_partial_output(tmp_path):
    src = medium_checkpoint(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(cli(src, out), capture_output=True, text=True, preexec_fn=_limit_file_size)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1 and "cannot write" in proc.stderr and "File too large" in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
