"""uptrain.train.model.sampling: the teacher-sample decoder against transformers itself, top-p as a
property over many distributions, seeding, EOS and the progress clock."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.families import GQA_TYPES, MQA_TYPES, tiny_config
from tests.tiny import random_model
from uptrain.train.model.sampling import sample_continuations, sample_next, timed_progress, top_p_candidates

MHA8 = "examples/stories260K-mha8"
PROMPTS = [[1, 40, 50, 70, 9], [1, 33], [1], [1, 7, 8]]  # left-padded to 5: every padding width


def hf_greedy(model, rows, new):
    """transformers' own greedy continuation of each prompt alone (no padding, its dynamic cache)."""
    out = []
    for r in rows:
        ids = torch.tensor([r])
        made = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=new, min_new_tokens=new, pad_token_id=0, eos_token_id=None)
        out.append(made[0, len(r):].tolist())
    return out


def test_greedy_decoding_equals_transformers_on_the_real_model():
    model = AutoModelForCausalLM.from_pretrained(MHA8, dtype=torch.float32).eval()
    ours = sample_continuations(model, PROMPTS, 48, None, 2, 0.0, 1.0, seed=0)
    assert ours == hf_greedy(model, PROMPTS, 48)
    same_length = [[1], [1, 7], [1, 7, 8]][2:] * 2 + [[1, 9, 4]]  # no padding: no mask is built at all
    assert sample_continuations(model, same_length, 48, None, 2, 0.0, 1.0, seed=0) == hf_greedy(model, same_length, 48)
    assert model.config._attn_implementation == "sdpa"  # the model's own attention is put back


@pytest.mark.parametrize("model_type,extra", [*GQA_TYPES.items(), *MQA_TYPES.items()],
                         ids=[*GQA_TYPES, *(f"{t}-mqa" for t in MQA_TYPES)])
def test_greedy_decoding_equals_transformers_in_every_family(model_type, extra):
    # A teacher of any registry family: GQA heads (H a multiple of Hkv), sliding windows, soft-capping,
    # partial rotary, MoE. Random weights, scaled so the logits are far from ties.
    model = random_model(tiny_config(model_type, extra), seed=1)
    try:  # (from_config makes eager attention; a teacher is loaded with SDPA where its class has it)
        model.set_attn_implementation("sdpa")
    except (ValueError, ImportError):
        pass
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(20.0 / head.norm(dim=-1, keepdim=True).mean())
    rows = [[1] + [5 + (7 * k + i) % 100 for i in range(len(r) - 1)] for k, r in enumerate(PROMPTS)]
    assert sample_continuations(model, rows, 12, None, 0, 0.0, 1.0, seed=0) == hf_greedy(model, rows, 12)
    unpadded = [r[:2] for r in rows]  # every prompt 2 tokens: the unmasked path (windowed layers keep their masks)
    assert sample_continuations(model, unpadded, 12, None, 0, 0.0, 1.0, seed=0) == hf_greedy(model, unpadded, 12)


def reference_top_p(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' TopPLogitsWarper applied to log-probabilities: the kept probabilities (others 0)."""
    from transformers.generation.logits_process import TopPLogitsWarper

    kept = TopPLogitsWarper(top_p)(None, probs.log())
    return torch.where(torch.isinf(kept), torch.zeros_like(probs), probs)


@pytest.mark.parametrize("vocab", [512, 32000])
def test_top_p_candidates_keep_exactly_the_nucleus(vocab):
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(60):
        scale = [0.3, 1.0, 3.0, 8.0][trial % 4]  # flat (needs the full sort) to peaked (a few tokens)
        logits = torch.randn(16, vocab, generator=gen, dtype=torch.float64) * scale
        if trial % 5 == 0:
            logits[:, :3] += 20  # three tokens hold nearly all of the mass
        probs = logits.softmax(-1)
        top_p = [0.5, 0.9, 0.95, 0.99, 1.0 - 1e-9][trial % 5]
        weights, ids = top_p_candidates(probs, top_p)
        ours = torch.zeros_like(probs).scatter_add(-1, ids, weights)
        torch.testing.assert_close(ours, reference_top_p(probs, top_p), rtol=0, atol=0)


def test_sample_next_draws_from_the_renormalised_nucleus():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(20000, 4)
    gen = torch.Generator().manual_seed(0)
    counts = torch.bincount(sample_next(logits, 1.0, 0.9, gen), minlength=4).double() / 20000
    torch.testing.assert_close(counts, torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95,
                               atol=0.015, rtol=0)  # 0.05 is outside the 0.9 nucleus: never drawn
    hot = torch.bincount(sample_next(logits, 2.0, 1.0, gen), minlength=4).double() / 20000
    want = (probs.log() / 2).softmax(-1).double()
    torch.testing.assert_close(hot, want, atol=0.015, rtol=0)


def test_seeded_and_stopped_at_eos():
    model = AutoModelForCausalLM.from_pretrained(MHA8, dtype=torch.float32).eval()
    a = sample_continuations(model, [[1]] * 8, 64, None, 2, 1.0, 0.95, seed=3)
    assert a == sample_continuations(model, [[1]] * 8, 64, None, 2, 1.0, 0.95, seed=3)
    assert a != sample_continuations(model, [[1]] * 8, 64, None, 2, 1.0, 0.95, seed=4)
    eos = a[0][10]  # a token the first row makes: it ends there, EOS included
    b = sample_continuations(model, [[1]] * 8, 64, eos, 2, 1.0, 0.95, seed=3)
    for full, cut in zip(a, b):
        want = full[:full.index(eos) + 1] if eos in full else full
        assert cut == want


def test_progress_lines_come_every_interval_with_tokens_rate_and_time_left():
    now = [0.0]
    lines = []
    report = timed_progress(lines.append, total=1000, every_s=30, done_before=100, clock=lambda: now[0])
    for made in range(0, 900, 10):
        now[0] += 1.0  # one step a second
        report(made)
    assert len(lines) == 3  # at 30, 60 and 90 s, never between
    assert lines[0].startswith("teacher samples: 390 of 1,000 tokens (39%), 10 tokens/s, ~63 s left"), lines[0]


@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (32, 32), (32, 8), (40, 8), (64, 8), (64, 1), (40, 40)])
def test_decode_attention_equals_sdpa_over_the_filled_cache(heads, kv_heads):
    # One new query against a static cache of `total` positions of which `n` are filled (the rest zeros, as
    # StaticCache leaves them): equal to SDPA over the filled positions alone, with and without left padding.
    from types import SimpleNamespace

    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from uptrain.train.model import sampling

    gen = torch.Generator().manual_seed(heads * 100 + kv_heads)
    module = SimpleNamespace(num_key_value_groups=heads // kv_heads, is_causal=True, training=False)
    for trial in range(6):
        batch, dim, total = 3, [8, 64, 128][trial % 3], 40
        n = [1, 7, 40, 23, 2, 39][trial]
        q = torch.randn(batch, heads, 1, dim, generator=gen)
        k, v = (torch.zeros(batch, kv_heads, total, dim) for _ in range(2))
        k[:, :, :n] = torch.randn(batch, kv_heads, n, dim, generator=gen) * 3
        v[:, :, :n] = torch.randn(batch, kv_heads, n, dim, generator=gen)
        keep = torch.ones(batch, 1, 1, total, dtype=torch.bool)
        keep[1, ..., : n // 2] = False  # row 1 left-padded
        keep[..., n:] = False
        want, _ = sdpa_attention_forward(module, q, k[:, :, :n], v[:, :, :n], keep[..., :n], scaling=dim ** -0.5)
        try:
            sampling._FILLED.length, sampling._FILLED.padded = n, True
            got, _ = sampling.decode_attention(module, q, k, v, keep, scaling=dim ** -0.5)
            sampling._FILLED.padded = False  # no padding: the mask is not read (row 1 unpadded now)
            free, _ = sampling.decode_attention(module, q, k, v, None, scaling=dim ** -0.5)
        finally:
            sampling._FILLED.length, sampling._FILLED.padded = None, True
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        plain, _ = sdpa_attention_forward(module, q, k[:, :, :n], v[:, :, :n], None, scaling=dim ** -0.5)
        torch.testing.assert_close(free, plain, rtol=1e-5, atol=1e-5)


def test_no_eos_and_no_pad_sample_every_row_to_max_new_tokens():
    # A tokenizer with a BOS and no EOS (llama2.c's) has no EOS to stop at nor to pad with: every row runs
    # to max_new_tokens, the padding (masked out) is id 0, and the tokens are those of an explicit pad.
    model = AutoModelForCausalLM.from_pretrained(MHA8, dtype=torch.float32).eval()
    made = sample_continuations(model, PROMPTS, 20, None, None, 1.0, 0.95, seed=3)
    assert [len(row) for row in made] == [20] * len(PROMPTS)
    assert made == sample_continuations(model, PROMPTS, 20, None, 0, 1.0, 0.95, seed=3)
