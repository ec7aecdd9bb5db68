"""The trainer's validation against a teacher: KL and top-1 agreement over the validation tokens,
equal to a computation by hand from transformers' logits; exactly 0 / 1 against itself."""

from __future__ import annotations

import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM

from uptrain.train.model.validate import validate_blocks


def _model(seed: int, heads: int, kv: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=97, hidden_size=heads * 4, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=64)
    return LlamaForCausalLM(config).eval()


def _by_hand(model, teacher, blocks: torch.Tensor) -> tuple[float, float, float]:
    """(loss, KL(teacher || model), top-1 agreement) over every block's targets, in float64."""
    with torch.no_grad():
        log_q = torch.log_softmax(model(input_ids=blocks).logits[:, :-1].double(), -1)  # [b, s-1, vocab]
        log_p = torch.log_softmax(teacher(input_ids=blocks).logits[:, :-1].double(), -1)
    targets = blocks[:, 1:]
    loss = -log_q.gather(-1, targets.unsqueeze(-1)).mean().item()
    kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean().item()
    agree = (log_q.argmax(-1) == log_p.argmax(-1)).double().mean().item()
    return loss, kl, agree


@pytest.mark.parametrize("seed, heads, kv", [(0, 32, 8), (1, 40, 40), (2, 64, 1), (3, 8, 2), (4, 4, 4)])
def test_kl_and_agreement_against_the_teacher_equal_a_computation_by_hand(seed, heads, kv):
    model, teacher = _model(seed, heads, kv), _model(seed + 100, heads, heads)
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 97, (7, 16), generator=g)
    data = Dataset.from_dict({"input_ids": blocks.tolist()})
    got = validate_blocks(model, data, Accelerator(cpu=True), batch_size=3, max_batches=None, teacher=teacher)
    loss, kl, agree = _by_hand(model, teacher, blocks)
    assert got["val_loss"] == pytest.approx(loss, abs=1e-5)
    assert got["val_kl_to_teacher"] == pytest.approx(kl, abs=1e-5) and got["val_kl_to_teacher"] > 0
    assert got["val_top1_agreement"] == pytest.approx(agree, abs=1e-12)  # a count: exact
    alone = validate_blocks(model, data, Accelerator(cpu=True), batch_size=3, max_batches=None)
    assert alone == {k: got[k] for k in ("val_loss", "val_ppl", "val_tokens")}  # no teacher: the loss alone
    itself = validate_blocks(model, data, Accelerator(cpu=True), batch_size=3, max_batches=None, teacher=model)
    assert itself["val_kl_to_teacher"] == 0.0 and itself["val_top1_agreement"] == 1.0
