"""Each layer's attention output matched to the teacher's during uptraining (`distill.attention_match`).

`--refine` tunes each converted attention module before training so that its output matches the
source's; this keeps the same pull on during training, beside the distillation KL: per micro batch,
the student's and the teacher's attention outputs on the same tokens (each model on its own
residual stream), their squared distance summed over target tokens and normalised per layer by the
teacher output's mean square (so layers of any scale weigh alike), averaged over layers. Modules and
tensors only: the trainer decides the weight (issue 61 measured it: results/quality-curve.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn


@contextmanager
def attention_outputs(model: nn.Module, on: bool = True) -> Iterator[list[Tensor]]:
    """The output of each decoder layer's attention module ([batch, seq, hidden], before the residual
    add) on the forwards inside the block, appended in layer order to the yielded list (empty when
    `on` is false: no hooks). The outputs keep their graph: a loss on the student's trains through them."""
    outputs: list[Tensor] = []
    if not on:
        yield outputs
        return
    from uptrain.convert.math.refine import attention_modules

    def keep(_module, _args, output):
        outputs.append(output[0] if isinstance(output, tuple) else output)

    handles = [m.register_forward_hook(keep) for m in attention_modules(model)]
    try:
        yield outputs
    finally:
        for h in handles:
            h.remove()


def attention_match_sum(student: list[Tensor], teacher: list[Tensor]) -> Tensor:
    """Sum over target tokens of the layer-mean of |s - t|^2 / mean_tokens |t|^2.

    student, teacher: one [batch, seq, hidden] tensor per layer, in layer order (the same layers,
    the same tokens). The last position is left out, as in `kd_loss_sum`, so all losses count the
    same tokens. Float32 whatever the autocast dtype. 0 for a student exactly on the teacher."""
    if len(student) != len(teacher) or not student:
        raise ValueError(f"attention outputs of {len(student)} student and {len(teacher)} teacher layers: "
                         "one forward of each, on the same layers, is needed")
    total = torch.zeros((), device=student[0].device)
    for s, t in zip(student, teacher):
        s, t = s[:, :-1].float(), t[:, :-1].detach().float()  # [batch, seq - 1, hidden]
        scale = t.pow(2).sum(-1).mean().clamp_min(1e-12)  # the teacher's mean square per token
        total = total + (s - t).pow(2).sum(-1).sum() / scale
    return total / len(student)
