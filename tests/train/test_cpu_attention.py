"""The training attention by hand (uptrain/train/model/cpu_attention.py) against SDPA: its math at real head
counts, its fallbacks, the real model, and the trainer with `bf16_attention=true`."""

from __future__ import annotations

import json
import random

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, MHA8, need_models, tiny_overrides, train_losses
from uptrain.train import train
from uptrain.train.config import load_config
from uptrain.train.model.cpu_attention import NAME, attention_forward, grouped_causal_attention, use_bf16_attention


def _sdpa(q, k, v, scale):
    group = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # transformers' repeat_kv order
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def _shapes():
    for heads, kv in ((8, 2), (8, 8), (32, 8), (40, 8), (64, 8), (64, 1), (40, 40)):  # real head counts
        yield 2, heads, kv, 37, 8
    for t in (64, 65, 255, 256, 300, 513):  # query chunks: one whole, a partial last, the 128-step chunks
        yield 1, 8, 2, t, 8
    rng = random.Random(0)
    for _ in range(20):
        kv = rng.choice([1, 2, 4, 8])
        yield rng.randint(1, 3), kv * rng.choice([1, 2, 4, 5, 8]), kv, rng.randint(2, 130), rng.choice([8, 16, 64])


@pytest.mark.parametrize("shape", list(_shapes()))
def test_the_grouped_products_compute_causal_attention(shape):
    """In float32 the grouped products are SDPA's causal attention (output and every gradient) at real head counts
    and random shapes; in bfloat16 to bfloat16's precision."""
    b, h, kv, t, d = shape
    g = torch.Generator().manual_seed(sum(shape))
    q, k, v = torch.randn(b, h, t, d, generator=g), torch.randn(b, kv, t, d, generator=g), torch.randn(b, kv, t, d, generator=g)
    weight = torch.randn(b, h, t, d, generator=g)
    results = {}
    for name, fn in (("sdpa", lambda *x: _sdpa(*x, d**-0.5)),
                     ("float32", lambda *x: grouped_causal_attention(*x, d**-0.5, torch.float32)),
                     ("bfloat16", lambda *x: grouped_causal_attention(*x, d**-0.5))):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        out = fn(*leaves)
        (out * weight).sum().backward()
        results[name] = [out.detach(), *(x.grad for x in leaves)]
    for got, want in zip(results["float32"], results["sdpa"]):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for got, want in zip(results["bfloat16"], results["sdpa"]):
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= 0.05 * want.abs().max() + 1e-3  # bfloat16's 8 bits, summed over t


def test_any_other_call_is_sdpa_exactly():
    """A padding mask, one query (decoding), dropout: transformers' SDPA path, bit for bit."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = AutoModelForCausalLM.from_pretrained(MHA8)
    module = model.model.layers[0].self_attn
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 8, 5, 8, generator=g) for _ in range(3))
    mask = torch.ones(2, 1, 5, 5, dtype=torch.bool).tril()
    for args, kwargs in (((q, k, v, mask), {}), ((q[:, :, -1:], k, v, None), {})):
        ours, _ = attention_forward(module, *args, **kwargs)
        theirs, _ = sdpa_attention_forward(module, *args, **kwargs)
        assert torch.equal(ours, theirs)
    torch.manual_seed(0)
    ours, _ = attention_forward(module, q, k, v, None, dropout=0.5)
    torch.manual_seed(0)
    assert torch.equal(ours, sdpa_attention_forward(module, q, k, v, None, dropout=0.5)[0])


def test_the_real_model_with_it_and_its_saved_config(tmp_path):
    """stories260K-mha8 with the attention by hand: its logits those of SDPA to bfloat16's precision, generation
    (one query at a time: SDPA) runs, and the saved model names no uptrain attention."""
    need_models()
    ids = torch.randint(3, 512, (2, 96), generator=torch.Generator().manual_seed(0))
    model = AutoModelForCausalLM.from_pretrained(MHA8)
    with torch.no_grad():
        want = model(input_ids=ids).logits
        use_bf16_attention(model)
        got = model(input_ids=ids).logits
    assert model.config._attn_implementation == NAME
    assert not torch.equal(got, want) and (got - want).abs().max() < 0.1 * want.abs().max()
    assert F.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean") / 96 < 1e-3
    assert model.generate(ids[:1, :8], max_new_tokens=4, do_sample=False).shape == (1, 12)
    model.save_pretrained(tmp_path / "saved")
    assert NAME not in (tmp_path / "saved" / "config.json").read_text()
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "saved").config._attn_implementation != NAME


def test_the_trainer_with_bf16_attention(tmp_path, capsys):
    """`bf16_attention=true`: the same run's losses to bfloat16's precision, both models' attention by hand,
    and a final model that loads as any other."""
    need_models()
    common = {"distill.teacher": MHA8, "distill.alpha_kd": 0.5, "threads": 1}
    train(load_config(DEMO, tiny_overrides(tmp_path / "plain", steps=6, **common)))
    train(load_config(DEMO, tiny_overrides(tmp_path / "bf16", steps=6, **common, bf16_attention="true")))
    plain, bf16 = train_losses(tmp_path / "plain"), train_losses(tmp_path / "bf16")
    assert sorted(plain) == sorted(bf16) == list(range(1, 7))
    assert any(plain[s] != bf16[s] for s in plain)  # it ran: bfloat16 products differ
    for step in plain:
        assert bf16[step] == pytest.approx(plain[step], abs=5e-3), step
    config = json.loads((tmp_path / "bf16" / "model" / "config.json").read_text())
    assert config.get("_attn_implementation") != NAME and NAME not in json.dumps(config)


@pytest.mark.parametrize("flags, multiplies", [
    ("fpu sse2 avx2 avx512f avx512bw avx512_bf16 avx512_vnni", True),  # AMD Zen 4, Intel Cooper Lake
    ("fpu avx512f amx_bf16 amx_tile amx_int8", True),  # Intel Sapphire Rapids
    ("fpu sse2 avx2 avx512f avx512bw avx512_vnni", False),  # AVX-512 without bfloat16 products
    ("fpu sse2 avx2 fma", False),
    ("fpu avx512_bf16x", False),  # a flag is a whole word
])
def test_the_cpu_check_reads_the_bfloat16_flags(flags, multiplies):
    """bf16_attention's automatic choice (the demo's) reads /proc/cpuinfo's flags of every processor listed."""
    from uptrain.train.model.cpu_attention import cpu_multiplies_bf16

    cpuinfo = "".join(f"processor\t: {n}\nmodel name\t: some CPU\nflags\t\t: {flags}\n\n" for n in range(2))
    assert cpu_multiplies_bf16(cpuinfo) is multiplies
    assert cpu_multiplies_bf16("processor\t: 0\nFeatures\t: fp asimd bf16\n") is False  # ARM: unmeasured, off
    assert cpu_multiplies_bf16("") is False
