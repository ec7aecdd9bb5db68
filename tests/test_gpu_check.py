"""scripts/gpu_check.sh in its tiny CPU mode: the same paths (a quality-path conversion of a
7B-shaped layer, the source's samples, eval) and three runs as on a GPU (bf16 + compile on
one process, shard=fsdp2 over one process, accelerate's FSDP2 config), so the script does not rot
while no GPU is at hand. On CPU accelerate drops FSDP: the third run must be refused in one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from transformers import AutoModelForCausalLM

from conftest import REPO


def test_gpu_check_tiny_mode_runs_every_path(tmp_path):
    env = {**os.environ, "GPU_CHECK_TINY": "1", "GPU_CHECK_WORK": str(tmp_path), "GPU_CHECK_PYTHON": sys.executable,
           "GPU_CHECK_PEAK_TFLOPS": "0.5", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "TORCHINDUCTOR_COMPILE_THREADS": "1",  # no pool of compile workers (each a torch import) for 2 tiny layers
           # scalar C++ kernels: inductor's vectorised ones take ~15 s more of g++ on a cold cache (41 vs 56 s
           # for run 2 here); the trainer's compile path is the same, only inductor's code generation differs
           "TORCHINDUCTOR_VEC_ISA_OK": "0",
           # a cold compile every time, as on a fresh machine (inductor's default cache, /tmp/torchinductor_$USER,
           # outlives the run: a second suite run here would compile from it in half the time)
           "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor-cache")}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    one, fsdp2, accelerate_fsdp2 = summary["runs"]
    layer, samples, scored = summary["paths"]  # the paths beside the trainer, on the device the runs use
    assert all(p["returncode"] == 0 and p["device"] == "cpu" for p in summary["paths"]), summary["paths"]
    record = json.loads((tmp_path / "layer-7b-fit" / "uptrain_conversion.json").read_text())
    assert record["method"] == "fit" and record["grouping"] == "similar" and layer["kv_heads"] == 2
    assert layer["refine_error_after"] < layer["refine_error_before"], layer
    assert 2048 <= samples["tokens"] < 2048 + 256 and samples["tokens_per_s"] > 0  # at most one document past
    assert len((tmp_path / "samples.jsonl").read_text().splitlines()) == samples["documents"]
    evaluated = json.loads((tmp_path / "eval.json").read_text())[0]
    assert scored["kl_to_source"] == round(evaluated["kl_to_source"], 5) and evaluated["reference"].endswith("mha")
    assert "the launch asks for FSDP" in accelerate_fsdp2["refused_on_cpu"]
    # 6N + attention FLOPs, recomputed here: the tiny shape ties its embeddings (N = all parameters).
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "gqa2")
    assert model.config.num_key_value_heads == 2  # converted from 8 K/V heads
    n = sum(p.numel() for p in model.parameters())
    assert summary["flops_per_token"] == 6 * n + 12 * 2 * (8 * 8) * 64
    for result in (one, fsdp2):
        assert result["returncode"] == 0 and result["tokens_per_s"] > 0
        assert result["mfu"] == pytest.approx(result["tokens_per_s"] * summary["flops_per_token"] / 0.5e12, rel=1e-3)
    out = proc.stdout
    assert "tokens/s" in out and "MFU" in out and "refused on CPU as expected" in out
    log = (tmp_path / "run2.log").read_text()
    assert "torch.compile per decoder layer (2)" in log and "mixed precision bf16" in log, log[-2000:]
