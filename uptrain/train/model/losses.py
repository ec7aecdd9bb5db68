"""Token-summed training losses: next-token cross-entropy and distillation KL.

Both return sums over target tokens (not means), so the trainer can divide by the number of
target tokens of the whole optimizer step across all processes: with gradient accumulation
and several processes, a mean of per-batch means would weight short batches too much.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss_sum(logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy and the number of target tokens.

    logits: [batch, seq, vocab]; input_ids: [batch, seq]. Position t predicts token t + 1, so
    there are batch * (seq - 1) targets. Computed in float32 whatever the autocast dtype.
    """
    pred = logits[:, :-1].float().reshape(-1, logits.size(-1))  # [batch * (seq - 1), vocab]
    target = input_ids[:, 1:].reshape(-1)  # [batch * (seq - 1)]
    return F.cross_entropy(pred, target, reduction="sum"), target.numel()


def kd_loss_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Summed T^2 * KL(teacher_T || student_T) over the target positions.

    student_logits, teacher_logits: [batch, seq, vocab] (same vocabulary). The last position has
    no target in the LM loss and is left out here too, so both losses count the same tokens.
    The T^2 factor (Hinton et al. 2015) keeps gradient size independent of the temperature.
    """
    vocab = student_logits.size(-1)
    log_s = F.log_softmax(student_logits[:, :-1].float().reshape(-1, vocab) / temperature, dim=-1)
    log_t = F.log_softmax(teacher_logits[:, :-1].float().reshape(-1, vocab) / temperature, dim=-1)
    # kl_div(input=log q, target=log p, log_target=True) = sum p * (log p - log q) = KL(p || q)
    return F.kl_div(log_s, log_t, log_target=True, reduction="sum") * temperature**2
