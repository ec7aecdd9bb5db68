"""Reading sources: Hub ids from a local cache, .bin checkpoints, broken indexes and files."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from local_hub import LocalHub
from tiny import load, logits
from uptrain.convert.io.source import auxiliary_files, open_checkpoint
from uptrain.convert.__main__ import main

IDS = torch.tensor([[1, 403, 407, 261, 378, 13, 55]])


def hub_cache(tmp_path: Path, source: Path, repo: str = "uptrain-test/stories", commit: str = "0" * 40) -> Path:
    """A huggingface_hub cache holding `source` as repo `repo` at `main`, laid out as the Hub client does."""
    root = tmp_path / "hub"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    (repo_dir / "blobs").mkdir()
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in sorted(source.iterdir()):  # content-addressed blobs, the snapshot made of symlinks
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        shutil.copyfile(file, repo_dir / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    return root


def run_cli(args: list[str], cache: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "uptrain.convert", *args], capture_output=True, text=True, env=env)


def test_hub_id_from_the_local_cache_in_offline_mode(mha8, gqa4, tmp_path):
    cache = hub_cache(tmp_path, mha8)
    proc = run_cli(["uptrain-test/stories", "--kv-heads", "4", "--out", str(tmp_path / "out")], cache)
    assert proc.returncode == 0, proc.stderr
    assert "source              uptrain-test/stories" in proc.stdout
    torch.testing.assert_close(logits(load(tmp_path / "out"), IDS), logits(load(gqa4), IDS), rtol=0, atol=1e-5)
    assert json.loads((tmp_path / "out" / "uptrain_conversion.json").read_text())["source"] == "uptrain-test/stories"


def test_sharded_hub_checkpoint_in_the_cache_converts(mha8, gqa4, tmp_path):
    """The cache's files are symlinks into blobs/: shards named by the index are still inside the folder."""
    src = tmp_path / "two-shards"
    load(mha8).save_pretrained(src, max_shard_size="600KB")
    assert len(list(src.glob("*.safetensors"))) == 2
    proc = run_cli(["uptrain-test/stories", "--kv-heads", "4", "--out", str(tmp_path / "out")], hub_cache(tmp_path, src))
    assert proc.returncode == 0, proc.stderr
    torch.testing.assert_close(logits(load(tmp_path / "out"), IDS), logits(load(gqa4), IDS), rtol=0, atol=1e-5)


def test_hub_id_not_cached_says_so_and_suggests_a_local_path(mha8, tmp_path):
    cache = hub_cache(tmp_path, mha8)
    for args in (["uptrain-test/missing"], ["uptrain-test/stories", "--revision", "v2"]):
        proc = run_cli([*args, "--kv-heads", "4", "--out", str(tmp_path / "out")], cache)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1
        # offline, the Hub was not tried: say so, not "cannot reach"
        assert "not in the local Hub cache (offline: HF_HUB_OFFLINE=1)" in proc.stderr, proc.stderr
        assert "cannot reach" not in proc.stderr and "local checkpoint folder" in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("typo", ["examples/stories260K-mha", "./examples/stories260K-mha",
                                  "examples/Stories260K-mha8", "ABSOLUTE/examples/stories260K-mhb8"])
def test_a_mistyped_local_path_names_the_near_folder_not_the_hub(typo, mha8, tmp_path, monkeypatch, capsys):
    """Issue 22: `examples/stories260K-mha` (one character off) was reported as a Hub problem."""
    (tmp_path / "examples").mkdir()
    shutil.copytree(mha8, tmp_path / "examples" / "stories260K-mha8")
    monkeypatch.chdir(tmp_path)
    typo = typo.replace("ABSOLUTE", str(tmp_path))
    assert main([typo, "--kv-heads", "4", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Hub" not in err, err
    assert f"no folder {typo}; did you mean " in err and "stories260K-mha8?" in err


@pytest.mark.parametrize("zip_format", [True, False], ids=["zip", "legacy"])
def test_bin_checkpoint_is_read_with_weights_only(mha8, gqa4, tmp_path, zip_format):
    src = tmp_path / "bin"
    shutil.copytree(mha8, src)
    state = load(mha8).state_dict()
    state.pop("lm_head.weight")  # tied, as save_pretrained leaves it out
    torch.save(state, src / "pytorch_model.bin", _use_new_zipfile_serialization=zip_format)
    (src / "model.safetensors").unlink()
    assert open_checkpoint(src).format == "bin"
    assert main([str(src), "--kv-heads", "4", "--out", str(tmp_path / "out")]) == 0
    torch.testing.assert_close(logits(load(tmp_path / "out"), IDS), logits(load(gqa4), IDS), rtol=0, atol=1e-5)


def test_safetensors_win_over_bin(mha8, tmp_path):
    src = tmp_path / "both"
    shutil.copytree(mha8, src)
    (src / "pytorch_model.bin").write_bytes(b"not a pickle: must never be opened")
    assert open_checkpoint(src).format == "safetensors"


def test_pickled_code_in_a_bin_is_refused(mha8, tmp_path, capsys):
    src = tmp_path / "evil"
    shutil.copytree(mha8, src)
    (src / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))
    torch.save({"x": Payload()}, src / "pytorch_model.bin")
    assert main([str(src), "--kv-heads", "4", "--out", str(tmp_path / "out")]) == 2
    assert "cannot read pytorch_model.bin safely" in capsys.readouterr().err
    assert not (tmp_path / "pwned").exists() and not (tmp_path / "out").exists()


def sharded_copy(mha8: Path, dst: Path) -> Path:
    shutil.copytree(mha8, dst)
    names = [t.name for t in open_checkpoint(dst).tensors]
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    return dst


def test_index_naming_a_shard_outside_the_folder_is_refused(mha8, tmp_path, capsys):
    src = sharded_copy(mha8, tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../model.safetensors"
    shutil.copy(src / "model.safetensors", tmp_path / "model.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main([str(src), "--kv-heads", "4", "--out", str(tmp_path / "out")]) == 2
    assert "outside the checkpoint folder" in capsys.readouterr().err


def test_index_naming_a_missing_shard_or_tensor(mha8, tmp_path, capsys):
    src = sharded_copy(mha8, tmp_path / "src")
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main([str(src), "--kv-heads", "4", "--out", str(tmp_path / "o1")]) == 2
    assert "which is missing" in capsys.readouterr().err
    index["weight_map"] = {"model.no_such.weight": "model.safetensors"} | {
        k: "model.safetensors" for k in index["weight_map"]}
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    assert main([str(src), "--kv-heads", "4", "--out", str(tmp_path / "o2")]) == 2
    assert "missing from their shards" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()


def test_truncated_or_corrupted_safetensors(mha8, tmp_path, capsys):
    for name, damage in (("truncated", lambda b: b[: len(b) // 2]), ("garbage", lambda b: b"\xff" * 64 + b[64:])):
        src = tmp_path / name
        shutil.copytree(mha8, src)
        (src / "model.safetensors").write_bytes(damage((mha8 / "model.safetensors").read_bytes()))
        assert main([str(src), "--kv-heads", "4", "--out", str(tmp_path / f"out-{name}")]) == 2
        err = capsys.readouterr().err
        assert "truncated or corrupted" in err and err.count("\n") == 1
        assert not (tmp_path / f"out-{name}").exists()


def test_auxiliary_files_skip_weights_code_and_rewritten_files(mha8, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(mha8, src)
    for extra in ("modeling_evil.py", "README.md", "LICENSE", "special_tokens_map.json", "pytorch_model.bin"):
        (src / extra).write_text("x")
    names = [p.name for p in auxiliary_files(src)]
    assert names == ["LICENSE", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                     "tokenizer.model", "tokenizer_config.json"]


def _plan_rows(stdout: str) -> list[str]:
    """The plan table without the lines that name the source or how it was read."""
    return [line for line in stdout.splitlines() if not line.startswith(("source", "note"))]


def test_hub_dry_run_reads_only_config_and_safetensors_headers(mha8, tmp_path, capsys):
    """A Hub id with --dry-run plans from HTTP range requests of the headers: the weights stay
    on the server. The real huggingface_hub client talks to a local server (HF_ENDPOINT)."""
    src = tmp_path / "two-shards"
    load(mha8).save_pretrained(src, max_shard_size="600KB")  # an index and two shards
    shards = sorted(p.name for p in src.glob("*.safetensors"))
    assert len(shards) == 2 and (src / "model.safetensors.index.json").is_file()
    with LocalHub({"org/stories": src}) as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_CACHE": str(tmp_path / "cache"),
               "HF_HUB_DISABLE_XET": "1", "HF_HUB_OFFLINE": "0"}
        proc = subprocess.run([sys.executable, "-m", "uptrain.convert", "org/stories", "--kv-heads", "2", "--dry-run"],
                              capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr
    capsys.readouterr()
    assert main([str(src), "--kv-heads", "2", "--dry-run"]) == 0  # a local folder: no process of its own needed
    assert _plan_rows(proc.stdout) == _plan_rows(capsys.readouterr().out)  # the same plan as from the files themselves
    sent = hub.served.body_bytes
    for shard in shards:  # each shard: one range request of the first 100 kB, never the weights
        assert sent[shard] <= 100_001 < (src / shard).stat().st_size, (shard, sent)
        assert [r for r in hub.served.requests if r[0] == "GET" and r[1].endswith(shard)] == [
            ("GET", f"/org/stories/resolve/main/{shard}", "bytes=0-100000")]
    assert set(sent) == {"config.json", "model.safetensors.index.json", *shards}  # no tokenizer, no card
    note = next(line for line in proc.stdout.splitlines() if "read the safetensors headers over HTTP" in line)
    fetched = float(note.split("HTTP: ")[1].split(" KiB")[0]) * 1024
    assert sum(sent.values()) <= fetched <= sum(sent.values()) + 4096  # + the API's file-list JSON
    assert "of weights were not downloaded" in note
    assert not list((tmp_path / "cache").rglob("*.safetensors"))


def test_hub_dry_run_offline_uses_the_cached_weights(mha8, tmp_path):
    cache = hub_cache(tmp_path, mha8)
    proc = run_cli(["uptrain-test/stories", "--kv-heads", "2", "--dry-run"], cache)
    assert proc.returncode == 0, proc.stderr
    assert "over HTTP" not in proc.stdout and "dry run: nothing written" in proc.stdout
    # offline, a cache with the config but not the weights cannot be planned: one line says so
    snapshot_file = next(p for p in cache.rglob("model.safetensors") if p.is_symlink())
    snapshot_file.resolve().unlink()  # the blob and the snapshot's symlink to it
    snapshot_file.unlink()
    proc = run_cli(["uptrain-test/stories", "--kv-heads", "2", "--dry-run"], cache)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "not in the local Hub cache (offline: HF_HUB_OFFLINE=1)" in proc.stderr
