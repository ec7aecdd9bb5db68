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
    log_s = _target_log_probs(student_logits, temperature)
    log_t = _target_log_probs(teacher_logits, temperature)
    # kl_div(input=log q, target=log p, log_target=True) = sum p * (log p - log q) = KL(p || q)
    return F.kl_div(log_s, log_t, log_target=True, reduction="sum") * temperature**2


def kd_and_lm_sums(student_logits: torch.Tensor, teacher_logits: torch.Tensor,
                   input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kd_loss_sum at temperature 1, lm_loss_sum's cross-entropy) from one log_softmax of the student's logits.

    Shapes as kd_loss_sum's; input_ids [batch, seq]. The KL is kd_loss_sum's bit for bit (the same log-probabilities
    into the same kl_div). The cross-entropy is read off those log-probabilities, -sum log q(target), without a graph:
    for pure distillation (alpha_kd 1), which reports it and trains none of it. It equals F.cross_entropy's sum up
    to the order of the additions. Saves the cross-entropy's own log_softmax and copy of the logits (~2% of a CPU
    step on stories260K: results/quality-curve.md, round two, tenth part)."""
    log_s = _target_log_probs(student_logits, 1.0)
    kd = F.kl_div(log_s, _target_log_probs(teacher_logits, 1.0), log_target=True, reduction="sum")
    with torch.no_grad():
        lm = -log_s.gather(1, input_ids[:, 1:].reshape(-1, 1)).sum()
    return kd, lm


def _target_log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of every position with a target: [batch * (seq - 1), vocab] in float32 (no division
    at T = 1, where it changes no bit and costs a pass over the logits, forward and backward)."""
    flat = logits[:, :-1].float().reshape(-1, logits.size(-1))
    return F.log_softmax(flat if temperature == 1 else flat / temperature, dim=-1)
