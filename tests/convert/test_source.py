"""Reading sources: Hub ids from a local cache, .bin checkpoints, broken indexes and files."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiny import load, logits
from uptrain.convert.source import auxiliary_files, open_checkpoint
from uptrain.convert.__main__ import main

IDS = torch.tensor([[1, 403, 407, 261, 378, 13, 55]])


def hub_cache(tmp_path: Path, source: Path, repo: str = "uptrain-test/stories", commit: str = "0" * 40) -> Path:
    """A huggingface_hub cache holding `source` as repo `repo` at `main`, laid out as the Hub client does."""
    root = tmp_path / "hub"
    repo_dir = root / f"models--{repo.replace('/', '--')}"
    (repo_dir / "refs").mkdir(parents=True)
    (repo_dir / "refs" / "main").write_text(commit)
    shutil.copytree(source, repo_dir / "snapshots" / commit)
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


def test_hub_id_not_cached_says_so_and_suggests_a_local_path(mha8, tmp_path):
    cache = hub_cache(tmp_path, mha8)
    for args in (["uptrain-test/missing"], ["uptrain-test/stories", "--revision", "v2"]):
        proc = run_cli([*args, "--kv-heads", "4", "--out", str(tmp_path / "out")], cache)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1
        assert "cannot reach the Hugging Face Hub" in proc.stderr and "local checkpoint folder" in proc.stderr
    assert not (tmp_path / "out").exists()


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
                     "tokenizer_config.json"]
