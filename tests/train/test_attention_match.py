"""distill.attention_match: each layer's attention output matched to the teacher's (uptrain/train/model/attention_match.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, GQA4, MHA8, need_models, read_metrics, tiny_overrides
from conftest import perturbed_copy
from uptrain.train import train
from uptrain.train.config import load_config
from uptrain.train.model.attention_match import attention_match_sum, attention_outputs



def _reference(student, teacher):
    """The formula written out per layer, per token, in float64."""
    per_layer = []
    for s, t in zip(student, teacher):
        s, t = s[:, :-1].double(), t[:, :-1].double()
        scale = (t ** 2).sum(-1).mean()
        per_layer.append(((s - t) ** 2).sum(-1).sum() / scale)
    return sum(per_layer) / len(per_layer)


@pytest.mark.parametrize("seed", range(12))
def test_the_sum_is_the_formula_scale_free_and_blind_to_the_last_position(seed):
    g = torch.Generator().manual_seed(seed)
    layers, batch, seq = 1 + seed % 5, 1 + seed % 3, 2 + seed
    hidden = (32, 40, 64)[seed % 3] * 8  # real head counts x head_dim 8
    student = [torch.randn(batch, seq, hidden, generator=g) for _ in range(layers)]
    teacher = [s + torch.randn(s.shape, generator=g) * 0.1 * (i + 1) for i, s in enumerate(student)]
    got = attention_match_sum(student, teacher)
    assert got.item() == pytest.approx(_reference(student, teacher).item(), rel=1e-4)
    c = 10.0 ** (seed % 7 - 3)  # both scaled alike: the same value
    assert attention_match_sum([s * c for s in student], [t * c for t in teacher]).item() == pytest.approx(got.item(), rel=1e-3)
    moved = [s.clone() for s in student]
    for s in moved:
        s[:, -1] += 100.0  # the last position has no target token: left out
    assert attention_match_sum(moved, teacher).item() == pytest.approx(got.item(), rel=1e-5)
    assert attention_match_sum(teacher, teacher).item() == 0.0
    with pytest.raises(ValueError, match="layers"):
        attention_match_sum(student[:-1] if layers > 1 else [], teacher)


def test_outputs_are_each_layers_attention_and_their_gradient_reaches_the_student(tmp_path):
    need_models()
    ids = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(0))
    teacher = AutoModelForCausalLM.from_pretrained(MHA8).eval()
    same = AutoModelForCausalLM.from_pretrained(GQA4).eval()  # mha8's function with 4 K/V heads: equal outputs
    other = AutoModelForCausalLM.from_pretrained(perturbed_copy(GQA4, tmp_path / "p", seed=0)).eval()
    with torch.no_grad(), attention_outputs(teacher) as targets:
        teacher(input_ids=ids)
    assert len(targets) == teacher.config.num_hidden_layers and targets[0].shape == (2, 24, teacher.config.hidden_size)
    with torch.no_grad(), attention_outputs(same) as outputs:
        same(input_ids=ids)
    assert attention_match_sum(outputs, targets).item() < 1e-8  # the same layers paired, in order
    with attention_outputs(other) as outputs:
        other(input_ids=ids)
    loss = attention_match_sum(outputs, targets)
    assert loss.item() > 1.0
    loss.backward()
    assert other.model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0
    with attention_outputs(other, on=False) as nothing:
        other(input_ids=ids)
    other(input_ids=ids)  # after the block: the hooks are gone
    assert nothing == [] and len(outputs) == teacher.config.num_hidden_layers


def _first_step(tmp_path, name, student, weight):
    run_dir = tmp_path / name
    train(load_config(DEMO, tiny_overrides(run_dir, steps=1, **{
        "optim.warmup_steps": 0, "model": student, "distill.teacher": MHA8, "distill.alpha_kd": 0.3,
        "distill.attention_match": weight})))
    (record,) = [r for r in read_metrics(run_dir) if "loss" in r]
    return record


def test_the_trainer_adds_the_weighted_matching_to_the_loss_only(tmp_path):
    # an exact student (gqa4 = mha8's function) has nothing to match; a perturbed one adds weight x its
    # matching to the loss, the same matching at each weight (lm and kd, computed before the update, alike)
    need_models()
    exact = _first_step(tmp_path, "exact", GQA4, 2.0)
    assert exact["loss"] == pytest.approx(0.7 * exact["lm_loss"] + 0.3 * exact["kd_loss"], rel=1e-5)
    student = perturbed_copy(GQA4, tmp_path / "student", seed=1)
    off, one, two = (_first_step(tmp_path, f"w{w}", student, w) for w in (0.0, 1.0, 2.0))
    assert off["loss"] == pytest.approx(0.7 * off["lm_loss"] + 0.3 * off["kd_loss"], rel=1e-5)
    assert (one["lm_loss"], one["kd_loss"]) == pytest.approx((off["lm_loss"], off["kd_loss"]), rel=1e-5)
    matched = one["loss"] - off["loss"]
    assert matched > 0.01
    assert two["loss"] - off["loss"] == pytest.approx(2 * matched, rel=1e-3)


def test_attention_match_needs_a_teacher_and_a_non_negative_weight(tmp_path):
    from uptrain.errors import UsageError
    for extra in ({"distill.attention_match": 1.0, "distill.teacher": "null"},
                  {"distill.attention_match": -1.0, "distill.teacher": str(MHA8)}):
        with pytest.raises(UsageError, match="attention_match"):
            load_config(DEMO, tiny_overrides(tmp_path / "r", steps=1, **extra))
