"""Step statistics kept on the device and read back only at sync points, and the non-finite guard.

On a GPU every `.item()` / `.tolist()` waits for the queued kernels: reading the loss each step
stalls the pipeline once per step. The loop therefore records each step's loss, gradient norm
and finiteness on the device (`StepHealth.record`, no host transfer) and reads them back in one
transfer at sync points: every `log.every` steps, before each evaluation and checkpoint, and at
the last step (`StepHealth.read`).

The guarantee: no non-finite step ever reaches a checkpoint, a metrics record or the final
model. A step that is itself a sync point is checked before its update (the weights in memory
stay those of the last good step). A bad step between sync points is applied in memory (reading
its flag would need the per-step sync this avoids) and the run stops at the next sync point,
before anything is written: the error names the first bad step and the step at which it was
found. With `log.every: 1` every step is a sync point, as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch


class TrainingDiverged(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; the run stops before anything of that
    step is written and keeps its last good checkpoint."""


@dataclass
class StepStats:
    """What one sync point reads back: the current step's numbers and the first bad step, if any."""

    loss: float
    lm: float
    kd: float
    grad_norm: float | None
    first_bad: int | None  # 0-based step of the first non-finite step seen so far
    bad_loss: float  # its loss and gradient norm (nan when the norm was not computed)
    bad_norm: float


class StepHealth:
    """The first non-finite step, tracked on `device` without host synchronisation."""

    def __init__(self, device: torch.device):
        self.first_bad = torch.full((), -1.0, dtype=torch.float64, device=device)  # -1: none yet
        self.bad = torch.zeros(2, dtype=torch.float64, device=device)  # [loss, grad norm] of that step
        self.current = torch.zeros(4, dtype=torch.float64, device=device)  # [loss, lm, kd, grad norm]
        self.has_norm = False

    def record(self, step: int, stats: torch.Tensor, grad_norm: torch.Tensor | None, check_norm: bool = True) -> None:
        """Record step `step` (0-based). stats: [3] = (loss, lm, kd) per token; grad_norm: [] or
        None (not computed). check_norm False: a non-finite norm is not an error (fp16's loss
        scaler makes inf gradients on purpose and skips those steps itself)."""
        norm = (torch.full((), math.nan, device=stats.device) if grad_norm is None
                else grad_norm.detach().reshape(()).to(stats.device))
        self.has_norm = grad_norm is not None
        self.current = torch.cat([stats.detach().double(), norm.double().reshape(1)])
        finite = torch.isfinite(self.current[0])
        if grad_norm is not None and check_norm:
            finite &= torch.isfinite(self.current[3])
        new = ~finite & (self.first_bad < 0)
        self.first_bad = torch.where(new, torch.full_like(self.first_bad, step), self.first_bad)
        # stack, not current[[0, 3]]: a list index would be copied from the host (a sync on a GPU)
        self.bad = torch.where(new, torch.stack([self.current[0], self.current[3]]), self.bad)

    def read(self) -> StepStats:
        """One host transfer: the last recorded step's numbers and the first bad step."""
        loss, lm, kd, norm, first, bad_loss, bad_norm = torch.cat(
            [self.current, self.first_bad.reshape(1), self.bad]).tolist()
        return StepStats(loss, lm, kd, norm if self.has_norm else None,
                         None if first < 0 else int(first), bad_loss, bad_norm)


def check_finite(stats: StepStats, step: int, run_dir: Path, updated: bool, deepspeed: bool) -> None:
    """Raise TrainingDiverged when a non-finite step has been recorded up to step `step` (0-based).

    `updated`: the read comes after step `step`'s optimizer update (False: before it). A finite
    loss can come with NaN/inf gradients (e.g. an overflow in backward): both are checked.
    DeepSpeed steps inside backward, so its update of the bad step has always run.
    """
    if stats.first_bad is None:
        return
    bad = stats.first_bad
    if bad < step or updated:
        when = (f"found at the check after step {step + 1} (losses are read back every log.every steps and "
                f"before each checkpoint), before anything of that step was saved")
    else:
        when = "stopped after the update (DeepSpeed steps inside backward)" if deepspeed else "stopped before the update"
    kept = f"last good checkpoint kept in {run_dir / 'checkpoints'}"
    if not math.isfinite(stats.bad_loss):
        raise TrainingDiverged(f"loss is {stats.bad_loss} at step {bad + 1}; {when}, {kept}")
    raise TrainingDiverged(f"gradient norm is {stats.bad_norm} at step {bad + 1} (the loss, {stats.bad_loss:.4f}, "
                           f"is finite); {when}, {kept}")
