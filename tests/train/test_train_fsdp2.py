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
from train_helpers import DEMO, GQA4, need_models, read_metrics, tiny_overrides, train_losses
from test_train_multiproc import launch_two_processes
from uptrain.train import train
from uptrain.train.config import load_config
from uptrain.train.run_state import FINISHED_FILE, complete_checkpoints

STEPS = 4
# AdamW (its state is sharded and checkpointed too); grad_norm is logged before the update, so a
# gradient off by the process count shows there. Validation on 3 blocks: uneven over 2 processes.
COMMON = {"eval.every": 2, "eval.batch_size": 3, "eval.max_batches": 1}
# Two processes x micro batch 2 x 2 accumulation = the one process's 4 x 2: the same 8 sequences,
# and the non-final micro batch runs with gradient sync off (set_requires_gradient_sync(False)).
SHARDED = {**COMMON, "shard": "fsdp2", "batch.micro_batch": 2, "batch.grad_accum": 2,
           "checkpoint.every": 2, "checkpoint.keep": 2}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    need_models()
    tmp = tmp_path_factory.mktemp("fsdp2")
    single, sharded = tmp / "single", tmp / "sharded"
    train(load_config(DEMO, tiny_overrides(single, steps=STEPS, **COMMON)))
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    args = tiny_overrides(sharded, steps=STEPS, **SHARDED)
    proc = launch_two_processes(args)
    return single, sharded, args, proc.stdout


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
    assert [t for _, t in val[1]] == [t for _, t in val[0]] == [3 * 63] * 3
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


def test_fsdp2_resume_reproduces_the_run(runs):
    # Interrupted after step 2: the sharded weights and AdamW state come back from the checkpoint.
    _, sharded, args, _ = runs
    before = train_losses(sharded)
    shutil.rmtree(sharded / "model")
    (sharded / FINISHED_FILE).unlink()  # as if interrupted before the end
    shutil.rmtree(complete_checkpoints(sharded)[-1])
    assert complete_checkpoints(sharded)[-1].name == "checkpoint-00000002"
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
    from uptrain.train.shard import check_fsdp2

    config = load_config(DEMO, tiny_overrides("runs/x", shard="fsdp2"))
    plain = SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, mixed_precision="no")
    check_fsdp2(config, plain)
    for kind in (DistributedType.NO, DistributedType.FSDP, DistributedType.DEEPSPEED):
        with pytest.raises(UsageError, match="multi-process launch"):
            check_fsdp2(config, SimpleNamespace(distributed_type=kind, mixed_precision="no"))
    with pytest.raises(UsageError, match="fp32 only"):
        check_fsdp2(config, SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, mixed_precision="bf16"))
    with pytest.raises(UsageError, match="compile"):
        check_fsdp2(load_config(DEMO, tiny_overrides("runs/x", shard="fsdp2", compile="true")), plain)
    with pytest.raises(UsageError, match="shard must be"):
        load_config(DEMO, tiny_overrides("runs/x", shard="fsdp1"))
