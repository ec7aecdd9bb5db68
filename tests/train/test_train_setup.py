"""Pure pieces of the trainer's set-up: LR schedule, plan checks, launcher facts (no training)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from accelerate.state import AcceleratorState
from transformers import get_cosine_with_min_lr_schedule_with_warmup, get_wsd_schedule

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, need_models, tiny_overrides
from uptrain.errors import UsageError
from uptrain.train.config import DistillConfig, OptimConfig, TrainConfig, load_config
from uptrain.train.plan.checked import DeepSpeedFacts, check_deepspeed
from uptrain.train.setup import make_accelerator
from uptrain.train.setup import lr_at
from uptrain.train.model.validate import eval_share


def test_lr_schedule_warms_up_peaks_once_and_ends_at_the_minimum():
    o = OptimConfig(lr=1e-3, min_lr_ratio=0.1, warmup_steps=4)
    steps = 20
    lrs = [lr_at(step, steps, o) for step in range(steps)]
    assert lrs[0] == pytest.approx(1e-3 / 4)  # no step is spent at lr 0
    assert lrs[3] == pytest.approx(1e-3)  # end of warm-up: the peak ...
    assert lrs.count(max(lrs)) == 1 and lrs[4] < lrs[3]  # ... used at one step only
    assert lrs[-1] == pytest.approx(1e-4)  # the last step reaches min_lr
    assert all(a > b for a, b in zip(lrs[3:], lrs[4:]))  # then strictly decreasing

    # transformers' cosine-with-min-lr schedule, its scheduler stepped before each optimizer step.
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=o.lr)
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(optimizer, o.warmup_steps, steps, min_lr_rate=o.min_lr_ratio)
    for step in range(steps):
        optimizer.step()  # (no gradient: nothing moves) keeps torch's call-order check quiet
        scheduler.step()
        assert lrs[step] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12), step


def test_wsd_schedule_holds_the_peak_then_decays_linearly_like_transformers():
    o = OptimConfig(lr=1e-3, min_lr_ratio=0.1, warmup_steps=3, schedule="wsd", decay_fraction=0.25)
    steps = 20
    lrs = [lr_at(step, steps, o) for step in range(steps)]
    assert lrs[2:15] == pytest.approx([1e-3] * 13)  # peak from the end of warm-up until the decay
    assert lrs[-1] == pytest.approx(1e-4) and all(a > b for a, b in zip(lrs[14:], lrs[15:]))  # 5 decay steps

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=o.lr)
    scheduler = get_wsd_schedule(optimizer, o.warmup_steps, num_decay_steps=5, num_training_steps=steps,
                                 decay_type="linear", min_lr_ratio=o.min_lr_ratio)
    for step in range(steps):
        optimizer.step()
        scheduler.step()
        assert lrs[step] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12), step


def test_lr_schedule_without_warmup_and_all_warmup():
    o = OptimConfig(lr=2.0, min_lr_ratio=0.0, warmup_steps=0)
    assert lr_at(9, 10, o) == pytest.approx(0.0, abs=1e-12) and lr_at(0, 10, o) > 1.9
    o = OptimConfig(lr=2.0, min_lr_ratio=0.0, warmup_steps=5)
    assert [lr_at(s, 5, o) for s in range(5)] == pytest.approx([0.4, 0.8, 1.2, 1.6, 2.0])


def test_validation_shares_cover_every_block_whatever_the_process_count():
    for n_blocks in range(0, 12):
        for world in (1, 2, 3, 8):
            shares = [eval_share(n_blocks, world, rank) for rank in range(world)]
            assert [i for share in shares for i in share] == list(range(n_blocks)), (n_blocks, world)
            assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_launcher_mixed_precision_applies_unless_the_run_config_sets_one(tmp_path, monkeypatch):
    # `accelerate launch --mixed_precision bf16` (or an accelerate config file) reaches the
    # trainer as ACCELERATE_MIXED_PRECISION; an unset run-config value must not override it.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    unset = TrainConfig(model="m", log=dataclasses.replace(TrainConfig().log, log_with=[]))
    assert unset.mixed_precision is None
    assert make_accelerator(unset, tmp_path).mixed_precision == "bf16"
    AcceleratorState._reset_state(reset_partial_state=True)
    explicit = dataclasses.replace(unset, mixed_precision="no")  # an explicit run-config value wins
    assert make_accelerator(explicit, tmp_path).mixed_precision == "no"
    AcceleratorState._reset_state(reset_partial_state=True)
    monkeypatch.delenv("ACCELERATE_MIXED_PRECISION")
    assert make_accelerator(unset, tmp_path).mixed_precision == "no"  # no launcher value: no


def test_a_bf16_run_from_the_launcher_trains_on_cpu_and_says_so(tmp_path, monkeypatch):
    need_models()
    from uptrain.train import train

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    run_dir = tmp_path / "run"
    result = train(load_config(DEMO, tiny_overrides(run_dir, steps=1, **{"mixed_precision": "null",
                                                                         "optim.warmup_steps": 0})))
    assert result["last_loss"] > 1.0
    assert "| mixed precision | bf16 |" in (run_dir / "model" / "README.md").read_text()


def _config(**changes) -> TrainConfig:
    config = TrainConfig(model="m", optim=OptimConfig(grad_clip=1.0))
    config.batch.grad_accum = 1
    for key, value in changes.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("config, facts, message", [
    (_config(), DeepSpeedFacts(2, 0.5), r"gradient_clipping \(0.5\) clips gradients, not optim.grad_clip \(1.0\)"),
    (_config(), DeepSpeedFacts(2, None), r"gradient_clipping \(0.0\) clips gradients"),
    (_config(), DeepSpeedFacts(2, "auto"), "gradient_clipping is 'auto'"),
    (_config(distill=DistillConfig(teacher="t")), DeepSpeedFacts(3, 1.0), "not supported under DeepSpeed ZeRO-3"),
    (_config(batch=dataclasses.replace(TrainConfig().batch, grad_accum=2)), DeepSpeedFacts(2, 1.0), "grad_accum=1"),
])
def test_deepspeed_refuses_what_it_would_silently_change(config, facts, message):
    with pytest.raises(UsageError, match=message):
        check_deepspeed(config, facts)


def test_deepspeed_accepts_what_holds_under_it():
    check_deepspeed(_config(), DeepSpeedFacts(3, 1.0))  # clipping as configured, no teacher
    check_deepspeed(_config(distill=DistillConfig(teacher="t")), DeepSpeedFacts(2, 1.0))  # teacher, ZeRO-2
    check_deepspeed(_config(batch=dataclasses.replace(TrainConfig().batch, grad_accum=4)), None)  # no DeepSpeed


def test_a_launch_whose_fsdp_or_deepspeed_accelerate_dropped_is_refused():
    # On CPU, accelerate launch --use_fsdp / --use_deepspeed gives MULTI_CPU + DDP (checked by hand,
    # results/RESULTS.md): the trainer refuses instead of training unsharded.
    from accelerate.utils import DistributedType

    from uptrain.errors import UsageError
    from uptrain.train.plan.checked import check_launch_honoured

    for flag, kind in (("ACCELERATE_USE_FSDP", DistributedType.FSDP), ("ACCELERATE_USE_DEEPSPEED", DistributedType.DEEPSPEED)):
        with pytest.raises(UsageError, match="drops"):
            check_launch_honoured({flag: "true"}, DistributedType.MULTI_CPU)
        check_launch_honoured({flag: "true"}, kind)  # honoured: fine
    check_launch_honoured({}, DistributedType.MULTI_CPU)
    check_launch_honoured({"ACCELERATE_USE_FSDP": "false"}, DistributedType.NO)


def _zero3_partitioned(shape: tuple[int, ...]) -> torch.nn.Parameter:
    """A parameter as DeepSpeed ZeRO-3's zero.Init leaves it on a rank: an empty 1-d tensor that
    keeps its real shape and size in ds_shape / ds_numel (the attributes DeepSpeed sets)."""
    param = torch.nn.Parameter(torch.empty(0))
    param.ds_shape, param.ds_numel = torch.Size(shape), int(torch.Size(shape).numel())
    return param


def test_weight_decay_and_parameter_counts_see_through_zero3_partitioning():
    """Matrices get weight decay and parameters count fully under ZeRO-3 too. (Seen in a real
    2-process ZeRO-3 run, results/RESULTS.md: by p.dim() every matrix lost its weight decay,
    silently, and `trainable=all` matched "no parameter".)"""
    from uptrain.train.setup import make_optimizer
    from uptrain.train.model.trainable import apply_trainable

    model = torch.nn.Module()
    model.weight, model.norm = _zero3_partitioned((8, 4)), _zero3_partitioned((4,))
    groups = make_optimizer(model, OptimConfig(weight_decay=0.1)).param_groups
    assert [(g["weight_decay"], [p.ds_shape for p in g["params"]]) for g in groups] == \
           [(0.1, [torch.Size([8, 4])]), (0.0, [torch.Size([4])])]
    assert apply_trainable(model, "all") == (36, 36)
