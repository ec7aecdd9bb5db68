"""The step loop reads losses back only at sync points (log interval, eval, checkpoint, last
step), and a non-finite step, recorded on the device, still never reaches a checkpoint."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, need_models, read_metrics, tiny_overrides, train_losses
from uptrain.train import train
from uptrain.train.config import load_config
from uptrain.train.state.run_state import complete_checkpoints

STEPS = 8


class HostReads:
    """Counts the tensor -> Python reads (item, tolist, float, int, bool) that the trainer's own
    modules (uptrain/train/) make while active: each is a host synchronisation on a GPU. (The
    model's and the data loader's own reads are not the loop's to avoid.) Real tensors, real
    calls; the methods are only counted."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self, monkeypatch):
        self.count = 0
        self.active = False
        for name in self.NAMES:
            original = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(original))

    def _counted(self, original):
        def method(tensor, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if self.active and f"uptrain{os.sep}train{os.sep}" in caller:
                self.count += 1
            return original(tensor, *args, **kwargs)
        return method


def test_losses_are_read_back_at_log_intervals_only(tmp_path, monkeypatch):
    from uptrain.train.loop import resume_state, setup_run, train_steps

    need_models()
    config = load_config(DEMO, tiny_overrides(tmp_path / "run", steps=STEPS, **{
        "log.every": 4, "eval.at_start": "false", "optim.warmup_steps": 0}))
    run = setup_run(config)
    start, batches = resume_state(run)
    reads = HostReads(monkeypatch)
    reads.active = True
    train_steps(run, start, batches)
    reads.active = False
    # Two sync points (steps 4 and 8), one read each; per step (as before) it was 2 x 8.
    assert reads.count <= 2, reads.count
    assert [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r] == [4, 8]


def test_logged_losses_do_not_depend_on_the_log_interval(tmp_path):
    # The record at step 4 is step 4's loss (not a mean of the interval), as with log.every=1.
    need_models()
    for every in (1, 4):
        train(load_config(DEMO, tiny_overrides(tmp_path / f"every{every}", steps=STEPS, **{
            "log.every": every, "eval.at_start": "false"})))
    each, sparse = train_losses(tmp_path / "every1"), train_losses(tmp_path / "every4")
    assert sorted(sparse) == [4, 8]
    assert {step: each[step] for step in sparse} == sparse
    norms = [{r["step"]: r["grad_norm"] for r in read_metrics(tmp_path / d) if "grad_norm" in r}
             for d in ("every1", "every4")]
    assert {step: norms[0][step] for step in norms[1]} == norms[1]


def _poison_gradient(param: torch.nn.Parameter, at_call: int) -> None:
    """NaN gradients for `param` from its `at_call`-th backward on (a real autograd hook)."""
    calls = [0]

    def hook(grad):
        calls[0] += 1
        return grad * float("nan") if calls[0] >= at_call else grad

    param.register_hook(hook)


def test_a_bad_step_between_checks_never_reaches_a_checkpoint(tmp_path):
    # Checks at steps 2, 4, 6 (checkpoints) and 8 (log): the NaN gradient of step 3 is applied
    # in memory (no host sync at step 3), found at step 4's check before its checkpoint is
    # written; the error names step 3, and nothing after step 2 is saved or logged.
    from uptrain.train.loop import TrainingDiverged, resume_state, setup_run, train_steps

    need_models()
    run_dir = tmp_path / "run"
    config = load_config(DEMO, tiny_overrides(run_dir, steps=STEPS, **{
        "log.every": 8, "checkpoint.every": 2, "checkpoint.keep": 5, "eval.at_start": "false",
        "optim.warmup_steps": 0}))
    run = setup_run(config)
    inner = run.accelerator.unwrap_model(run.model)
    _poison_gradient(inner.model.layers[0].self_attn.q_proj.weight, at_call=2 * 2 + 1)  # step 3, grad_accum 2
    start, batches = resume_state(run)
    with pytest.raises(TrainingDiverged, match=r"gradient norm is nan at step 3 .*found at the check after step 4"):
        train_steps(run, start, batches)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["checkpoint-00000002"]
    records = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
    assert all(r["step"] <= 2 for r in records), records
    assert not (run_dir / "model").exists()


def test_a_bad_step_between_checks_is_not_checkpointed_by_a_stop_signal(tmp_path, monkeypatch):
    # No sync point until step 8; step 3's gradients are NaN and a SIGTERM arrives during step 3:
    # the stop makes step 3 a sync point, whose health is read (the one finite check) before the
    # update, so the run ends diverged (naming step 3) before anything of step 3 is applied or
    # written, not with a checkpoint of NaN weights that resume=latest would continue from.
    from uptrain.train.loop import TrainingDiverged, resume_state, setup_run, train_steps
    from uptrain.train.stop.preempt import StopRequest

    need_models()
    run_dir = tmp_path / "run"
    config = load_config(DEMO, tiny_overrides(run_dir, steps=STEPS, **{
        "log.every": 8, "checkpoint.every": 0, "eval.at_start": "false", "optim.warmup_steps": 0}))
    run = setup_run(config)
    inner = run.accelerator.unwrap_model(run.model)
    _poison_gradient(inner.model.layers[0].self_attn.q_proj.weight, at_call=2 * 2 + 1)  # step 3, grad_accum 2
    start, batches = resume_state(run)
    monkeypatch.setenv("UPTRAIN_TEST_SIGNAL_AT", "3:0:SIGTERM")
    with StopRequest().installed() as stop:
        stop.setup_done()
        with pytest.raises(TrainingDiverged, match=r"gradient norm is nan at step 3 .*stopped before the update"):
            train_steps(run, start, batches, stop)
    assert complete_checkpoints(run_dir) == []
    assert not (run_dir / "checkpoints").exists() or not any((run_dir / "checkpoints").iterdir())
