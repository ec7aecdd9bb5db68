"""Layer-wise reconstruction (uptrain.convert.math.refine), proven on real transformers models."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoTokenizer

from conftest import EXAMPLE_MHA8, TRAIN_TXT, VALID_TXT, real_config
from tiny import load, random_model, save, scaled_config
from uptrain.convert import convert
from uptrain.convert.layers.calibrate import Calibration, calibration_sequences, read_calibration_texts
from uptrain.convert.math.refine import attention_modules, capture, call_with, refine_attention, refine_model
from uptrain.measure.eval import evaluate, tokenize_texts

FAST = dict(steps=40, eval_every=10, patience=2, batch=4, lr=3e-3)


def _sequences(tokenizer, path, tokens: int, window: int = 256) -> tuple[list[torch.Tensor], list[int]]:
    """What `--calib` runs (`calibrate.calibration_sequences`) as tensors, single tokens left out,
    and the document of each (refine holds out whole documents)."""
    seqs, documents, _, _ = calibration_sequences(read_calibration_texts(path), tokenizer, tokens, window)
    kept = [(torch.tensor(s), d) for s, d in zip(seqs, documents) if len(s) > 1]
    return [s for s, _ in kept], [d for _, d in kept]


def _random_sequences(vocab: int, n: int = 12, length: int = 24, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + 2 * i,), generator=gen) for i in range(n)]


def test_refine_lowers_layer_errors_and_held_out_loss_on_stories260k(tmp_path, one_torch_thread):
    """From the fit + calibration start (2 K/V heads): every layer's held-out attention-output error
    and the model's held-out loss on tinystories-valid go down."""
    convert(str(EXAMPLE_MHA8), tmp_path / "fit", 2, "fit", calibration=Calibration(TRAIN_TXT, 1024))
    original, converted = load(EXAMPLE_MHA8), load(tmp_path / "fit")
    tokenizer = AutoTokenizer.from_pretrained(EXAMPLE_MHA8)
    texts = [t for t in VALID_TXT.read_text().splitlines() if t.strip()][:4]

    def loss(model):
        return evaluate(model, tokenize_texts(tokenizer, texts), 512, 256).loss
    start = loss(converted)
    seqs, documents = _sequences(tokenizer, TRAIN_TXT, 1536)
    results = refine_model(original, converted, seqs, documents=documents, **{**FAST, "steps": 30})
    after = loss(converted)
    print("errors", [(round(r.error_before, 4), round(r.error_after, 4)) for r in results], f"loss {start:.4f} -> {after:.4f}")
    assert len(results) == 5
    for r in results:
        assert r.error_after < 0.9 * r.error_before
        assert r.train_error_after < r.train_error_before
    assert after < start - 0.05


def test_refine_keeps_an_exact_start_exact(tmp_path, one_torch_thread):
    """stories260K-mha8 duplicates each K/V head of the 4-head original, so mean pooling to 4 heads
    is exact: refine finds nothing to improve and leaves every weight as it was."""
    convert(str(EXAMPLE_MHA8), tmp_path / "kv4", 4, "mean")
    original, converted = load(EXAMPLE_MHA8), load(tmp_path / "kv4")
    before = {k: v.clone() for k, v in converted.state_dict().items()}
    tokenizer = AutoTokenizer.from_pretrained(EXAMPLE_MHA8)
    seqs, documents = _sequences(tokenizer, TRAIN_TXT, 1024)
    results = refine_model(original, converted, seqs, documents=documents, **FAST)
    for r in results:
        assert r.error_before < 1e-9 and r.error_after <= r.error_before
    for k, v in converted.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=1e-7)


def test_refine_does_not_wander_from_a_start_that_cannot_improve(one_torch_thread):
    """Noise-level gradients (targets = the student's own outputs) move nothing: the held-out error
    never improves, so the start state is kept, exactly."""
    cfg = AutoConfig.for_model("llama", hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=1, intermediate_size=16, vocab_size=64)
    model = random_model(cfg)
    seqs = _random_sequences(64, n=8)
    rec = capture(model, seqs)[0]
    student = attention_modules(model)[0]
    start = {k: v.clone() for k, v in student.state_dict().items()}
    targets = [y + 1e-6 * torch.randn_like(y) for y in rec.outputs]  # a hair off: error ~1e-10, not 0
    result = refine_attention(student, call_with(rec.kwargs), rec.inputs, targets, **{**FAST, "steps": 30})
    assert result.best_step == 0
    for k, v in student.state_dict().items():
        torch.testing.assert_close(v, start[k], rtol=0, atol=0)


SMALL_HEADS = dict(num_attention_heads=8, num_key_value_heads=8, hidden_size=64)  # real configs, fewer heads
FAMILIES = {
    # key norms after the projection (the fit refuses): Qwen3 per head, OLMo-2 over all heads
    "qwen3": lambda: AutoConfig.for_model("qwen3", hidden_size=64, head_dim=8, num_attention_heads=8,
                                          num_key_value_heads=8, num_hidden_layers=2, intermediate_size=32,
                                          vocab_size=256, max_position_embeddings=256),
    "olmo2": lambda: scaled_config(json.loads(real_config("olmo-2-0425-1b").read_text()), **SMALL_HEADS),
    # partial rotary (0.4 of each head): head_dim 10 -> 4 rotary dims
    "phi": lambda: scaled_config(json.loads(real_config("phi-2").read_text()), head_dim=10,
                                 **{**SMALL_HEADS, "hidden_size": 80}),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_refine_from_mean_where_the_fit_refuses(family, tmp_path, one_torch_thread):
    """Key norms / partial rotary: refine from mean pooling lowers every layer's output error, and the
    refined model saves and loads with plain transformers (no missing or unexpected weights)."""
    cfg = FAMILIES[family]()
    heads = cfg.num_attention_heads
    src = save(random_model(cfg), tmp_path / "src")
    convert(str(src), tmp_path / "mean", heads // 4, "mean")
    original, converted = load(src), load(tmp_path / "mean")
    seqs = _random_sequences(cfg.vocab_size, n=40, length=32)
    results = refine_model(original, converted, seqs, **{**FAST, "steps": 60, "lr": 1e-2})
    print(family, [(round(r.error_before, 4), round(r.error_after, 4)) for r in results])
    for r in results:
        assert r.error_after < 0.9 * r.error_before
    save(converted, tmp_path / "refined")
    reloaded = load(tmp_path / "refined")  # asserts no missing/unexpected/mismatched weights
    assert reloaded.config.num_key_value_heads == heads // 4
    ids = seqs[0].reshape(1, -1)
    torch.testing.assert_close(reloaded(ids).logits, converted(ids).logits, rtol=0, atol=1e-5)


def test_refine_rejects_too_few_sequences():
    cfg = AutoConfig.for_model("llama", hidden_size=32, head_dim=8, num_attention_heads=4, num_key_value_heads=2,
                               num_hidden_layers=1, intermediate_size=16, vocab_size=64)
    model = random_model(cfg)
    rec = capture(model, _random_sequences(64, n=1))[0]
    with pytest.raises(ValueError, match="at least 2"):
        refine_attention(attention_modules(model)[0], call_with(rec.kwargs), rec.inputs, rec.outputs)
