"""shard=fsdp2: the trainer's own FSDP2 (fully_shard per decoder layer + root) on two real CPU
processes (accelerate launch --multi_gpu, gloo), against one unsharded process, same global batch.

accelerate's FSDP2 does not run on CPU (it falls back to DDP), hence the trainer's own path.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from tiny import weights
from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import (DEMO, PAIR_STEPS as STEPS, train_in_process, GQA4, need_models, pair_args, read_metrics,
                           tiny_overrides, train_losses)
from test_train_multiproc import launch_two_processes
from uptrain.train.config import load_config
from uptrain.train.state.run_state import FINISHED_FILE, complete_checkpoints

# AdamW (its state is sharded and checkpointed too); grad_norm is logged before the update, so a
# gradient off by the process count shows there. Validation on 3 blocks: uneven over 2 processes.
# Two processes x micro batch 2 x 2 accumulation = the one process's 4 x 2: the same 8 sequences,
# and the non-final micro batch runs with gradient sync off (set_requires_gradient_sync(False)).


@pytest.fixture(scope="module")
def runs(fsdp2_runs):
    """(one process, shard=fsdp2 on two processes, its overrides, its stdout): tests/conftest.py's
    session pair, which test_elastic.py resumes on other process counts too."""
    return fsdp2_runs


def test_fsdp2_matches_one_process(runs):
    single, sharded, _, stdout = runs
    assert "x 2 processes" in stdout
    assert "shard: fsdp2, fully_shard on 5 decoder layers + root over 2 processes" in stdout, stdout
    one, two = train_losses(single), train_losses(sharded)
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], abs=1e-5), step
    norms = [{r["step"]: r["grad_norm"] for r in read_metrics(d) if "grad_norm" in r} for d in (single, sharded)]
    for step in norms[0]:
        assert norms[1][step] == pytest.approx(norms[0][step], rel=1e-4), step
    val = [[(r["val_loss"], r["val_tokens"]) for r in read_metrics(d) if "val_loss" in r] for d in (single, sharded)]
    assert [t for _, t in val[1]] == [t for _, t in val[0]] == [3 * 63] * 4  # at steps 0, 2, 4 and 6
    assert [v for v, _ in val[1]] == pytest.approx([v for v, _ in val[0]], abs=1e-5)
    # Each checkpoint holds the ranks' shards (torch.distributed.checkpoint), not one model file.
    (last := complete_checkpoints(sharded)[-1])
    assert (last / "sharded_state" / ".metadata").is_file()
    assert len(list((last / "sharded_state").glob("*.distcp"))) == 2


def test_fsdp2_export_is_a_normal_model_folder(runs):
    # The final folder is gathered from the shards: every weight present, equal to the unsharded
    # run's (whose final validation the sharded model also matched), and from_pretrained gives
    # the same logits.
    single, sharded, _, _ = runs
    w_one, w_two = weights(single / "model"), weights(sharded / "model")
    assert w_one.keys() == w_two.keys()
    start = weights(GQA4)
    assert max((w_one[k] - start[k]).abs().max().item() for k in w_one if k in start) > 1e-3
    for name in w_one:
        torch.testing.assert_close(w_two[name], w_one[name], atol=1e-5, rtol=1e-4, msg=name)
    model, info = AutoModelForCausalLM.from_pretrained(sharded / "model", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ref = AutoModelForCausalLM.from_pretrained(single / "model")
    ids = torch.randint(0, model.config.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


# Resuming a sharded run: on the same two processes, test_fsdp2_bf16_resume_reproduces_the_run below
# (bf16 policy, fp32 master weights and AdamW state, 1e-6); the fp32 run of this module's pair
# resumes on 1 and then 2 processes in tests/train/test_elastic.py (1e-5 against one process).
# One launch per guarantee: an fp32 resume on the same two processes ran the same code again.


def assert_resume_reproduces(sharded, args) -> None:
    """Drop the finished run's checkpoints after step 2 and its final model, resume from checkpoint 2
    on two processes: every step's loss is the uninterrupted run's (1e-6)."""
    before = train_losses(sharded)
    shutil.rmtree(sharded / "model")
    (sharded / FINISHED_FILE).unlink()  # as if interrupted before the end
    for checkpoint in complete_checkpoints(sharded)[1:]:
        shutil.rmtree(checkpoint)
    assert [p.name for p in complete_checkpoints(sharded)] == ["checkpoint-00000002"]
    proc = launch_two_processes(args + ["resume=latest"])
    assert "resuming from" in proc.stdout
    after = train_losses(sharded)
    assert sorted(after) == list(range(1, STEPS + 1))
    for step in after:
        assert after[step] == pytest.approx(before[step], abs=1e-6), step


def test_fsdp2_refuses_what_it_does_not_cover():
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    from uptrain.errors import UsageError
    from uptrain.train.plan.checked import check_fsdp2

    config = load_config(DEMO, tiny_overrides("runs/x", shard="fsdp2"))
    plain = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, mixed_precision="no")
    check_fsdp2(config, plain)
    check_fsdp2(config, SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, mixed_precision="bf16"))
    check_fsdp2(config, SimpleNamespace(distributed_type=DistributedType.NO, mixed_precision="no"))  # one process
    for kind in (DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(UsageError, match="multi-process launch"):
            check_fsdp2(config, SimpleNamespace(distributed_type=kind, mixed_precision="no"))
    with pytest.raises(UsageError, match="fp16"):
        check_fsdp2(config, SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, mixed_precision="fp16"))
    with pytest.raises(UsageError, match="shard must be"):
        load_config(DEMO, tiny_overrides("runs/x", shard="fsdp1"))


# --- bf16 (MixedPrecisionPolicy), activation checkpointing per decoder layer ---

# bf16 keeps 8 bits of mantissa (relative step 2^-8 = 0.4%): the sharded bf16 policy (bf16 weights
# in forward and backward) and the one-process bf16 autocast (fp32 weights, bf16 matmuls) round
# differently; over 6 AdamW steps the losses stay within 1% of each other.
BF16_REL = 1e-2


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory, runs):
    tmp = tmp_path_factory.mktemp("fsdp2-bf16")
    single, sharded = tmp / "single", tmp / "sharded"
    train_in_process(pair_args(single, mixed_precision="bf16"))
    args = pair_args(sharded, sharded=True, mixed_precision="bf16")
    proc = launch_two_processes(args)
    return single, sharded, args, proc.stdout


def test_fsdp2_bf16_matches_one_process_bf16(bf16_runs, runs):
    single, sharded, _, stdout = bf16_runs
    assert "mixed precision bf16 (parameters and compute bf16; gradients reduced and master weights fp32)" in stdout
    one, two = train_losses(single), train_losses(sharded)
    assert sorted(two) == sorted(one) == list(range(1, STEPS + 1))
    for step in one:
        assert two[step] == pytest.approx(one[step], rel=BF16_REL), step
    # ... and it did run in bf16: the fp32 sharded run's losses differ by more than fp32 rounding.
    fp32 = train_losses(runs[1])
    assert max(abs(two[s] - fp32[s]) for s in fp32) > 1e-4
    # Master weights stay fp32: the sharded checkpoint and the optimizer state hold fp32 tensors.
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(complete_checkpoints(sharded)[-1] / "sharded_state")).read_metadata()
    dtypes = {key.split(".")[0]: set() for key in meta.state_dict_metadata}
    for key, item in meta.state_dict_metadata.items():
        if hasattr(item, "properties"):
            dtypes[key.split(".")[0]].add(item.properties.dtype)
    assert dtypes["model"] == {torch.float32}, dtypes
    assert torch.float32 in dtypes["optim"] and torch.bfloat16 not in dtypes["optim"], dtypes


def test_fsdp2_bf16_resume_reproduces_the_run(bf16_runs):
    assert_resume_reproduces(*bf16_runs[1:3])


def test_fsdp2_activation_checkpointing_gives_the_same_losses(runs, tmp_path):
    # gradient_checkpointing=true under shard=fsdp2: each decoder layer is wrapped in torch's
    # checkpoint_wrapper before fully_shard (torchtitan's order); recomputation in backward gives
    # the same gradients in fp32, up to summation order.
    _, sharded, _, _ = runs
    args = pair_args(tmp_path / "ac", sharded=True, gradient_checkpointing="true")
    proc = launch_two_processes(args)
    assert "activation checkpointing on 5 decoder layers" in proc.stdout, proc.stdout
    plain, checkpointed = train_losses(sharded), train_losses(tmp_path / "ac")
    assert sorted(checkpointed) == sorted(plain)
    for step in plain:
        assert checkpointed[step] == pytest.approx(plain[step], abs=1e-6), step
    w_plain, w_ac = weights(sharded / "model"), weights(tmp_path / "ac" / "model")
    assert w_plain.keys() == w_ac.keys()  # no checkpoint_wrapper prefix in the exported names
    for name in w_plain:
        torch.testing.assert_close(w_ac[name], w_plain[name], atol=1e-5, rtol=1e-4, msg=name)


def test_compile_without_a_cpp_compiler_is_refused_in_one_line(tmp_path):
    # torch.compile (inductor) on CPU needs a C++ compiler; without one the run would fail deep
    # inside the first step. CXX names a compiler that does not exist (inductor reads it).
    import os
    import subprocess
    import sys

    from train_helpers import REPO

    need_models()
    run_dir = tmp_path / "run"
    env = {**os.environ, "CXX": str(tmp_path / "no-such-g++"), "PYTHONPATH": str(REPO)}
    args = tiny_overrides(run_dir, steps=1, compile="true", **{"optim.warmup_steps": 0})
    proc = subprocess.run([sys.executable, "-m", "uptrain.train", str(DEMO), *args], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "compile=true" in proc.stderr and "C++ compiler" in proc.stderr
    assert not run_dir.exists()
