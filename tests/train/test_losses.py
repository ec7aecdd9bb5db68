"""uptrain/train/model/losses.py: pure distillation's KL and reported cross-entropy from one log_softmax
(`kd_and_lm_sums`) against the two separate losses, over many shapes, vocabularies and scales."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from uptrain.train.model.losses import kd_and_lm_sums, kd_loss_sum, lm_loss_sum


def _cases():
    gen = torch.Generator().manual_seed(0)
    shapes = [(1, 2, 7), (2, 5, 32), (4, 128, 512), (3, 17, 1000), (16, 9, 512)]
    for i in range(30):
        batch, seq, vocab = shapes[i % len(shapes)] if i < len(shapes) else (
            int(torch.randint(1, 5, (1,), generator=gen)), int(torch.randint(2, 40, (1,), generator=gen)),
            int(torch.randint(2, 700, (1,), generator=gen)))
        scale = [0.1, 1.0, 8.0][i % 3]
        student = torch.randn(batch, seq, vocab, generator=gen) * scale
        teacher = torch.randn(batch, seq, vocab, generator=gen) * scale
        if i % 2:  # the teacher cache hands over log-probabilities, not logits
            teacher = torch.log_softmax(teacher, -1).half().float()
        ids = torch.randint(0, vocab, (batch, seq), generator=gen)
        yield student, teacher, ids


def _old_kd(student: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """kd_loss_sum at temperature 1 as it was written before: the division by T kept."""
    vocab = student.size(-1)
    log_s = F.log_softmax(student[:, :-1].float().reshape(-1, vocab) / 1.0, dim=-1)
    log_t = F.log_softmax(teacher[:, :-1].float().reshape(-1, vocab) / 1.0, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="sum") * 1.0**2


@pytest.mark.parametrize("case", list(range(30)))
def test_one_log_softmax_gives_the_kl_bit_for_bit_and_the_cross_entropy(case):
    student, teacher, ids = list(_cases())[case]
    mine = student.clone().requires_grad_()
    kd, lm = kd_and_lm_sums(mine, teacher, ids)
    kd.backward()
    before = student.clone().requires_grad_()
    old = _old_kd(before, teacher)
    old.backward()
    assert torch.equal(kd, old) and torch.equal(mine.grad, before.grad)  # what trains: unchanged to the bit
    assert torch.equal(kd_loss_sum(student, teacher, 1.0), old)  # and kd_loss_sum itself without the division
    assert not lm.requires_grad  # reported, not trained
    assert lm.item() == pytest.approx(lm_loss_sum(student, ids)[0].item(), rel=1e-6, abs=1e-6)


def test_the_temperature_still_divides():
    gen = torch.Generator().manual_seed(1)
    student, teacher = torch.randn(2, 6, 11, generator=gen), torch.randn(2, 6, 11, generator=gen)
    p, q = F.softmax(teacher[:, :-1] / 2.0, -1), F.softmax(student[:, :-1] / 2.0, -1)
    assert kd_loss_sum(student, teacher, 2.0).item() == pytest.approx(4.0 * (p * (p.log() - q.log())).sum().item(),
                                                                      rel=1e-5)
