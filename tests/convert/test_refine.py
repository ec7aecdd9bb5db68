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
from uptrain.convert.math.output_solve import solve_linear
from uptrain.convert.math.refine import (BATCH, attention_modules, capture, call_with, refine_attention,
                                        refine_model)
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


# ------------------------------------------------------------------ issue 43: the faster refinement

def _rows(n_rows: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Rows [n_rows, n] with a spread of scales (like attention outputs, not like white noise)."""
    return torch.randn(n_rows, n, generator=gen, dtype=torch.float64) * torch.logspace(0, -3, n, dtype=torch.float64)


@pytest.mark.parametrize("heads", [32, 40, 64])
def test_the_output_solve_is_the_least_squares_solution(heads):
    """Property, over random shapes (n = heads x head_dim inputs, small head_dim, a bias column or
    not): ridge 0 gives torch.linalg.lstsq's solution; the default ridge leaves the error at the
    least-squares optimum; a reachable target is solved exactly; where Z spans fewer directions
    than n, the rest keep the current weights."""
    gen = torch.Generator().manual_seed(heads)
    for head_dim, m, bias in [(2, 24, False), (4, 40, True), (3, 17, True)]:
        n = heads * head_dim + bias
        z = _rows(3 * n, n, gen)
        if bias:
            z[:, -1] = 1.0
        y = torch.randn(3 * n, m, generator=gen, dtype=torch.float64)
        current = torch.randn(m, n, generator=gen, dtype=torch.float64)
        gram, cross = z.T @ z, z.T @ y
        best = torch.linalg.lstsq(z, y).solution.T
        torch.testing.assert_close(solve_linear(gram, cross, current, ridge=0.0), best, rtol=1e-7, atol=1e-9)
        optimum = (z @ best.T - y).pow(2).sum()
        got = (z @ solve_linear(gram, cross, current).T - y).pow(2).sum()
        assert optimum <= got <= optimum * (1 + 1e-6), (heads, head_dim, float(got / optimum))
        truth = torch.randn(m, n, generator=gen, dtype=torch.float64)
        exact = solve_linear(z.T @ z, z.T @ (z @ truth.T), current, ridge=0.0)
        torch.testing.assert_close(exact, truth, rtol=1e-7, atol=1e-8)
        few = z[: n // 2]  # half as many rows as unknowns: the null space keeps `current`
        w = solve_linear(few.T @ few, few.T @ y[: n // 2], current)
        null = torch.linalg.svd(few).Vh[n // 2:]  # [n - n//2, n]: directions `few` never spans
        torch.testing.assert_close(w @ null.T, current @ null.T, rtol=1e-6, atol=1e-6)
        assert (few @ w.T - y[: n // 2]).abs().max() < 1e-4  # and the rows are fitted


@pytest.mark.parametrize("heads, bias", [(32, False), (40, True), (64, False)])
def test_solve_output_fits_a_real_attention_modules_output_projection(heads, bias, one_torch_thread):
    """A transformers Llama attention (heads x head_dim 4, 8 K/V heads): `output_projection` finds
    o_proj; targets made by the same attention with another o_proj are reached (to float32
    rounding) by `solve_output`; on random targets the error left is the least-squares optimum of
    o_proj's inputs."""
    from uptrain.convert.math.output_solve import output_projection, solve_output

    cfg = AutoConfig.for_model("llama", hidden_size=2 * heads, head_dim=4, num_attention_heads=heads,
                               num_key_value_heads=8, num_hidden_layers=1, intermediate_size=16, vocab_size=64,
                               attention_bias=bias)
    model = random_model(cfg)
    rec = capture(model, _random_sequences(64, n=6, length=30))[0]
    student = attention_modules(model)[0]
    call = call_with(rec.kwargs)

    def run(i):
        return call(student, rec.inputs[i], i)
    proj = output_projection(student, lambda: run(0))
    assert proj is student.o_proj
    with torch.no_grad():
        for p in proj.parameters():
            p.add_(torch.randn_like(p))
    with torch.no_grad():
        targets = [run(i) for i in range(6)]
        for p in proj.parameters():
            p.copy_(torch.randn_like(p))
    solve_output(proj, run, targets, range(6))
    with torch.no_grad():  # reached (the weights need not be: heads of a group can trade columns)
        for i in range(6):
            torch.testing.assert_close(run(i), targets[i], rtol=1e-4, atol=1e-4 * targets[i].abs().max().item())
    noise = [torch.randn_like(t) for t in targets]
    seen = []
    hook = proj.register_forward_pre_hook(lambda _m, a: seen.append(a[0][0].double()))
    solve_output(proj, run, noise, range(6))
    hook.remove()
    z = torch.cat(seen[:6])
    z = torch.cat([z, torch.ones_like(z[:, :1])], 1) if bias else z
    y = torch.cat(noise).double()
    optimum = (z @ torch.linalg.lstsq(z, y).solution - y).pow(2).sum()
    with torch.no_grad():
        left = sum((run(i).double() - noise[i].double()).pow(2).sum() for i in range(6))
    assert optimum <= left * (1 + 1e-5) and left <= optimum * (1 + 1e-4), (float(left), float(optimum))


def test_no_output_projection_where_the_module_changes_its_output_after_it():
    from uptrain.convert.math.output_solve import output_projection

    class Halved(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.o_proj = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.o_proj(x) / 2

    module = Halved()
    assert output_projection(module, lambda: module(torch.randn(3, 4))) is None
    assert output_projection(module.o_proj, lambda: module.o_proj(torch.randn(3, 4))) is module.o_proj


def test_the_learning_rate_warms_up_then_decays_along_a_cosine():
    from uptrain.convert.math.refine import WARMUP, lr_factor

    steps = 400
    warm = round(WARMUP * steps)
    rates = [lr_factor(s, steps) for s in range(1, steps + 1)]
    assert rates[warm - 1] == 1.0 and rates[0] == pytest.approx(1 / warm)
    assert all(a < b for a, b in zip(rates[:warm], rates[1:warm]))  # warm-up: rising
    assert all(a > b for a, b in zip(rates[warm:], rates[warm + 1:]))  # then falling
    assert 0 < rates[-1] < 1e-3  # the last step still moves, barely
    assert lr_factor(1, 1) == 1.0 and lr_factor(7, 10, "constant") == 1.0


def test_the_cli_defaults_are_the_refinements():
    from uptrain.convert.math import refine
    from uptrain.convert.options import DEFAULT_REFINE_LR, DEFAULT_REFINE_STEPS

    assert (DEFAULT_REFINE_STEPS, DEFAULT_REFINE_LR) == (refine.STEPS, refine.LR)


@pytest.fixture(scope="module")
def small_case(tmp_path_factory):
    """stories260K-mha8 -> 2 K/V heads (fit + calibration), and the original's attention inputs and
    outputs on 8,192 calibration tokens in 256-token windows (47 sequences, 2,048+ held out)."""
    torch.set_num_threads(1)
    folder = tmp_path_factory.mktemp("small_case") / "fit"
    convert(str(EXAMPLE_MHA8), folder, 2, "fit", calibration=Calibration(TRAIN_TXT, 1024))
    tokenizer = AutoTokenizer.from_pretrained(EXAMPLE_MHA8)
    seqs, documents = _sequences(tokenizer, TRAIN_TXT, 8192, window=256)
    return folder, capture(load(EXAMPLE_MHA8), seqs), documents


OLD = dict(schedule="constant", lr=1e-2, batch=4, eval_every=20)  # the optimiser and defaults before issue 43


def _refined(small_case, layer: int, **options):
    folder, recorded, documents = small_case
    rec = recorded[layer]
    return refine_attention(attention_modules(load(folder))[layer], call_with(rec.kwargs), rec.inputs, rec.outputs,
                            documents=documents, min_holdout_tokens=2048, **options)


@pytest.mark.parametrize("layer", [1, 4])
def test_the_new_path_is_no_worse_than_the_old_for_the_same_sequences(small_case, layer, one_torch_thread):
    """Real layers (stories260K, 2 K/V heads): the default refinement (warm-up, cosine, output solve;
    400 steps of 2 sequences) ends at a held-out error no worse than the optimiser before issue 43
    given the same 800 sequences (200 steps of 4), measured 7.4% and 3.7% lower on these two layers."""
    new, old = _refined(small_case, layer), _refined(small_case, layer, steps=200, **OLD)
    print(layer, f"old {old.error_after:.4f} new {new.error_after:.4f}")
    assert new.error_after <= old.error_after
    assert new.steps_run * BATCH <= 200 * 4


def test_the_new_path_is_close_to_the_old_at_its_own_defaults(small_case, one_torch_thread):
    """...and within 8% of the old optimiser at its own 1200-step cap with its held-out stop (measured
    5.1% above on this layer, in a fifth of its sequences: 800 against 4,160); results/refine-speed.md
    has the held-out loss of whole models, within 1%."""
    new, old = _refined(small_case, 1), _refined(small_case, 1, steps=1200, **OLD)
    print(f"old {old.error_after:.4f} ({old.steps_run} steps) new {new.error_after:.4f} ({new.steps_run} steps)")
    assert new.error_after <= 1.08 * old.error_after
    assert new.steps_run * BATCH < old.steps_run * 4 / 2
