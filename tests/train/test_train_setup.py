"""Pure pieces of the trainer's set-up: LR schedule, plan checks, launcher facts (no training)."""

from __future__ import annotations

import pytest
import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from uptrain.errors import UsageError
from uptrain.train.config import OptimConfig
from uptrain.train.setup import lr_at


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
        scheduler.step()
        assert lrs[step] == pytest.approx(optimizer.param_groups[0]["lr"], rel=1e-12), step


def test_lr_schedule_without_warmup_and_all_warmup():
    o = OptimConfig(lr=2.0, min_lr_ratio=0.0, warmup_steps=0)
    assert lr_at(9, 10, o) == pytest.approx(0.0, abs=1e-12) and lr_at(0, 10, o) > 1.9
    o = OptimConfig(lr=2.0, min_lr_ratio=0.0, warmup_steps=5)
    assert [lr_at(s, 5, o) for s in range(5)] == pytest.approx([0.4, 0.8, 1.2, 1.6, 2.0])
