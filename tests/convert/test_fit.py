"""`--method fit`, `--grouping similar` and `--calib`, proven on real tiny models against transformers."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from conftest import REPO
from tiny import load, logits, random_model, save
from uptrain.convert import RECORD_FILE, convert
from uptrain.convert.layers import layerwise
from uptrain.convert.__main__ import main
from uptrain.convert.layers.calibrate import Calibration
from uptrain.convert.math.fit import fit_keys, fit_values, rotary_planes, sigma_roots

MHA8 = REPO / "examples" / "stories260K-mha8"
VALID = REPO / "examples" / "data" / "tinystories-valid-sample.txt"
TRAIN = REPO / "examples" / "data" / "tinystories-train-sample.txt"
IDS = torch.tensor([[1, 3, 17, 42, 5, 99, 23, 64, 7, 11, 200, 301, 45, 8, 9, 77]])
HEADS, HD = 8, 8
SMALL = dict(hidden_size=HEADS * HD, head_dim=HD, num_attention_heads=HEADS, num_key_value_heads=HEADS,
             num_hidden_layers=2, intermediate_size=32, vocab_size=512, max_position_embeddings=256,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
FAMILIES = {"llama": {}, "qwen2": {}, "phi3": {}, "cohere": {}}  # plain, biases, fused qkv, interleaved RoPE


def tiny_mha(model_type: str, tmp: Path, **extra) -> Path:
    cfg = AutoConfig.for_model(model_type, **{**SMALL, **FAMILIES.get(model_type, {}), **extra})
    return save(random_model(cfg), tmp / model_type)


# ------------------------------------------------------------------ grouping: permuting heads is free


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_permuting_heads_keeps_the_mha_function(model_type, tmp_path, monkeypatch, one_torch_thread):
    """q rows, k/v rows and biases, o_proj columns permuted together: same logits (8 -> 8 heads, groups of 1)."""
    src = tiny_mha(model_type, tmp_path)
    perm = torch.randperm(HEADS, generator=torch.Generator().manual_seed(1)).tolist()
    monkeypatch.setattr(layerwise, "group_permutation", lambda sim, groups: perm)
    convert(str(src), tmp_path / "perm", HEADS, "mean", grouping="similar")
    before, after = load(src), load(tmp_path / "perm")
    torch.testing.assert_close(logits(after, IDS), logits(before, IDS), rtol=0, atol=1e-5)
    name = "qkv_proj" if model_type == "phi3" else "q_proj"
    q0 = before.state_dict()[f"model.layers.0.self_attn.{name}.weight"]
    q1 = after.state_dict()[f"model.layers.0.self_attn.{name}.weight"]
    assert not torch.equal(q0, q1)  # the heads did move
    record = json.loads((tmp_path / "perm" / RECORD_FILE).read_text())
    assert record["grouping"] == "similar" and record["head_order"]["model.layers.0.self_attn."] == perm
    if model_type != "phi3":  # the moved heads are the source heads in the new order
        torch.testing.assert_close(q1.view(HEADS, HD, -1), q0.view(HEADS, HD, -1)[perm], rtol=0, atol=0)


def test_similar_grouping_finds_planted_groups():
    """Heads built as 2 groups of alike heads (shuffled) come back as those groups."""
    from uptrain.convert.math.grouping import equal_groups, head_similarity
    g = torch.Generator().manual_seed(0)
    base_k, base_v = torch.randn(2, HD, 16, generator=g), torch.randn(2, HD, 16, generator=g)
    owner = [0, 1, 1, 0, 1, 0, 0, 1]
    wk = torch.stack([base_k[o] + 0.05 * torch.randn(HD, 16, generator=g) for o in owner])
    wv = torch.stack([base_v[o] + 0.05 * torch.randn(HD, 16, generator=g) for o in owner])
    for aligned in (False, True):
        sim = head_similarity(wk, wv, torch.eye(16), aligned, rotary_planes(HD, False))
        assert equal_groups(sim, 2) == [[0, 3, 5, 6], [1, 2, 4, 7]]


# ------------------------------------------------------------------ the fit's math


def test_value_fit_is_never_worse_than_mean_on_its_objective():
    """The V/O objective of the fit is at most that of mean pooling (O unchanged)."""
    gen = torch.Generator().manual_seed(0)
    g, d = 4, 16
    x = torch.randn(500, d, generator=gen) @ torch.randn(d, d, generator=gen)
    sigma = (x.T @ x / len(x)).double()
    wv, wo = torch.randn(g, HD, d, generator=gen).double(), torch.randn(g, d, HD, generator=gen).double()
    v_new, o_new = fit_values(wv, wo, sigma)

    def vo_err(v, o):
        return sum(torch.trace((wo[j] @ wv[j] - o[j] @ v) @ sigma @ (wo[j] @ wv[j] - o[j] @ v).T) for j in range(g))
    assert vo_err(v_new, o_new) <= vo_err(wv.mean(0), wo) + 1e-9


def _random_spd(d: int, gen: torch.Generator, tokens: int | None = None) -> torch.Tensor:
    """E[x xᵀ] of correlated x with uneven scales (as calibration gives), [d, d] float64."""
    mix = torch.randn(d, d, generator=gen, dtype=torch.float64) * torch.rand(d, generator=gen, dtype=torch.float64).exp()
    x = torch.randn(tokens or 4 * d, d, generator=gen, dtype=torch.float64) @ mix
    return x.T @ x / len(x)


def _plane_score_error(wq, wk, q_new, k_new, sig_q, sig_k, planes) -> torch.Tensor:
    """The key fit's documented objective, measured on its outputs: per query head j, summed over
    rotary planes p, E|q_j,p(x) conj(k_j,p(y)) − q'_j,p(x) conj(k'_p(y))|² for independent x ~ Σ_q,
    y ~ Σ_k (complex plane scores, so every relative position at once) = tr(Σ_q E Σ_k Eᴴ), E the
    difference of the outer products. With q' = conj(s_j) q_j it is E|q_j,p|² · E|k_j,p − s_j k'_p|².
    wq, q_new: [g, hd, Dq]; wk: [g, hd, Dk]; k_new: [hd, Dk]. Returns [g]."""
    first, second = planes
    q, q1 = (torch.complex(w[:, first], w[:, second]) for w in (wq, q_new))  # [g, P, Dq]
    k = torch.complex(wk[:, first], wk[:, second])  # [g, P, Dk]
    k1 = torch.complex(k_new[first], k_new[second]).expand_as(k)
    e = q[..., :, None] * k.conj()[..., None, :] - q1[..., :, None] * k1.conj()[..., None, :]  # [g, P, Dq, Dk]
    sq, sk = sig_q.to(e.dtype), sig_k.to(e.dtype)
    return (sq @ e @ sk @ e.mH).diagonal(dim1=-2, dim2=-1).sum(-1).real.sum(-1)


def _weighted_rank_one_minimum(wq, wk, sig_q, sig_k, planes, weighted: bool = True):
    """Independent of fit.py: the objective's minimum over (k', s_j) per plane (Eckart–Young on the
    rows sqrt(E|q_j,p|²) k_j,p Σ_k^{1/2}), and the unweighted fit's (k', s_j), as (min, k_new, q_new)."""
    first, second = planes
    root = torch.linalg.cholesky(sig_k)
    q = torch.complex(wq[:, first], wq[:, second])  # [g, P, Dq]
    use = torch.einsum("gpa,ab,gpb->pg", q, sig_q.to(q.dtype), q.conj()).real  # [P, g]
    a = torch.complex(wk[:, first] @ root, wk[:, second] @ root).transpose(0, 1)  # [P, g, Dk]
    rows = use.sqrt()[..., None] * a
    sv = torch.linalg.svdvals(rows)
    minimum = (rows.abs().pow(2).sum((1, 2)) - sv[:, 0] ** 2).sum()
    w = use.sqrt() if weighted else torch.ones_like(use)
    u, s, vh = torch.linalg.svd(w[..., None] * a, full_matrices=False)
    key = torch.linalg.solve_triangular(root.to(vh.dtype), s[:, :1] * vh[:, 0], upper=False, left=False)
    scale = u[:, :, 0] / w  # [P, g]
    k_new = torch.zeros(wk.shape[1:], dtype=torch.float64)
    k_new[first], k_new[second] = key.real, key.imag
    q1 = scale.conj().T[..., None] * q
    q_new = wq.clone()
    q_new[:, first], q_new[:, second] = q1.real, q1.imag
    return minimum, k_new, q_new


def test_key_fit_minimises_its_documented_objective():
    """fit_keys' documented objective (the query-weighted key error = the expected squared plane
    score error), computed on its outputs: equal to the closed-form minimum, never above mean
    pooling's or the fit without the query-use weights; and on a planted input (one head uses a
    plane 100x more than the rest, with a different key) dropping the weights costs a lot."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(40):
        g = int(torch.randint(2, 9, (), generator=gen))
        hd = (4, 8)[trial % 2]
        d = int(torch.randint(hd, 40, (), generator=gen))
        planes = rotary_planes(hd, interleaved=trial % 4 >= 2)
        sig_q, sig_k = _random_spd(d, gen), (_random_spd(d, gen) if trial % 3 else torch.eye(d, dtype=torch.float64))
        wk = torch.randn(g, hd, d, generator=gen, dtype=torch.float64)
        wq = torch.randn(g, hd, d, generator=gen, dtype=torch.float64) * torch.rand(g, hd, 1, generator=gen, dtype=torch.float64).mul(3).exp()
        k_fit, q_fit = fit_keys(wk, wq, sig_k, sig_q, planes)
        fit = _plane_score_error(wq, wk, q_fit, k_fit, sig_q, sig_k, planes).sum()
        mean = _plane_score_error(wq, wk, wq, wk.mean(0), sig_q, sig_k, planes).sum()
        minimum, k_unw, q_unw = _weighted_rank_one_minimum(wq, wk, sig_q, sig_k, planes, weighted=False)
        unweighted = _plane_score_error(wq, wk, q_unw, k_unw, sig_q, sig_k, planes).sum()
        case = dict(trial=trial, g=g, hd=hd, d=d, fit=fit.item(), minimum=minimum.item(), unweighted=unweighted.item())
        assert fit <= minimum * (1 + 1e-6) + 1e-12, case  # the ridge on Σ_k moves the optimum by ~1e-6
        assert fit <= mean * (1 + 1e-6), case
        assert fit <= unweighted * (1 + 1e-6), case
    # planted: in every plane head 0's query is 100x louder, its key orthogonal to the others' (alike) keys
    g, hd, d = 8, 8, 16
    planes = rotary_planes(hd, interleaved=False)
    wk = torch.randn(1, hd, d, generator=gen, dtype=torch.float64).repeat(g, 1, 1)
    wk = wk + 0.05 * torch.randn(g, hd, d, generator=gen, dtype=torch.float64)
    wk[0] = torch.randn(hd, d, generator=gen, dtype=torch.float64)
    wq = torch.randn(g, hd, d, generator=gen, dtype=torch.float64)
    wq[0] *= 100
    eye = torch.eye(d, dtype=torch.float64)
    k_fit, q_fit = fit_keys(wk, wq, eye, eye, planes)
    fit = _plane_score_error(wq, wk, q_fit, k_fit, eye, eye, planes).sum()
    minimum, k_unw, q_unw = _weighted_rank_one_minimum(wq, wk, eye, eye, planes, weighted=False)
    unweighted = _plane_score_error(wq, wk, q_unw, k_unw, eye, eye, planes).sum()
    assert fit <= minimum * (1 + 1e-6)
    assert unweighted > 10 * fit, (unweighted.item(), fit.item())


def _expand_with_rotations(gqa: Path, out: Path, seed: int = 0) -> Path:
    """The MHA model with the GQA model's function whose heads differ by RoPE-safe transforms.

    Each K/V head j of the GQA model becomes g heads: keys rotated-and-scaled per rotary plane by a
    random complex number s (queries divided by conj(s): same scores at every position), values mixed
    by a random orthogonal matrix Q (o_proj columns multiplied by Qᵀ: same output).
    """
    model = load(gqa)
    cfg = model.config
    heads, kv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    # Llama's rotate_half planes (i, i + hd/2), built in the helper independently of fit.py
    state = _rope_safe_variants(model.state_dict(), cfg.num_hidden_layers, heads, kv, hd, interleaved=False, seed=seed)
    raw = json.loads((gqa / "config.json").read_text())
    mha_cfg = AutoConfig.for_model(raw.pop("model_type"), **{**raw, "num_key_value_heads": heads})
    mha = random_model(mha_cfg)
    mha.load_state_dict(state)
    save(mha, out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(gqa / f, out / f)
    return out


def test_fit_recovers_heads_that_differ_by_rope_safe_transforms(tmp_path, one_torch_thread):
    """The RoPE handling, proven: groups identical up to per-plane rotation-scalings of K (and
    orthogonal mixes of V) are merged exactly by `fit`; mean pooling cannot."""
    convert(str(MHA8), tmp_path / "gqa4", 4)  # the original stories260K-gqa4 function
    reference = logits(load(tmp_path / "gqa4"), IDS)
    mha = _expand_with_rotations(tmp_path / "gqa4", tmp_path / "mha")
    torch.testing.assert_close(logits(load(mha), IDS), reference, rtol=0, atol=1e-4)  # the construction is right
    convert(str(mha), tmp_path / "fit", 4, "fit")
    fit_diff = (logits(load(tmp_path / "fit"), IDS) - reference).abs().max().item()
    convert(str(mha), tmp_path / "mean", 4, "mean")
    mean_diff = (logits(load(tmp_path / "mean"), IDS) - reference).abs().max().item()
    print(f"max |logit diff|: fit {fit_diff:.2e}, mean {mean_diff:.2e}")
    assert fit_diff < 1e-4
    assert mean_diff > 0.1


def _rope_safe_variants(state: dict, layers: int, heads: int, kv: int, hd: int, interleaved: bool, seed: int = 0) -> dict:
    """The same construction on any separate-q/k/v state dict, biases included (k bias scaled like
    the key rows, q bias divided like the query rows, v bias mixed like the value rows)."""
    g = heads // kv
    gen = torch.Generator().manual_seed(seed)
    first, second = ((torch.arange(0, hd, 2), torch.arange(1, hd, 2)) if interleaved
                     else (torch.arange(hd // 2), torch.arange(hd // 2, hd)))
    state = dict(state)
    for layer in range(layers):
        p = f"model.layers.{layer}.self_attn."
        def aug(x):  # [rows, d (+1 bias column)]
            w, b = state[p + f"{x}_proj.weight"].double(), state.get(p + f"{x}_proj.bias")
            return w if b is None else torch.cat([w, b.double()[:, None]], dim=1)
        aug = {x: aug(x) for x in "qkv"}
        q, k, v = aug["q"].view(heads, hd, -1).clone(), aug["k"].view(kv, hd, -1), aug["v"].view(kv, hd, -1)
        o = state[p + "o_proj.weight"].double().view(-1, heads, hd).clone()
        new_k, new_v = torch.empty(heads, hd, k.shape[2], dtype=torch.float64), torch.empty(heads, hd, v.shape[2], dtype=torch.float64)
        for h in range(heads):
            j = h // g
            s = torch.complex(torch.randn(len(first), generator=gen).double(), torch.randn(len(first), generator=gen).double())
            kc = torch.complex(k[j][first], k[j][second]) * s[:, None]
            new_k[h][first], new_k[h][second] = kc.real, kc.imag
            qc = torch.complex(q[h][first], q[h][second]) / s.conj()[:, None]
            q[h][first], q[h][second] = qc.real, qc.imag
            rot = torch.linalg.qr(torch.randn(hd, hd, generator=gen).double()).Q
            new_v[h] = rot @ v[j]
            o[:, h] = o[:, h] @ rot.T
        for x, t in (("q", q), ("k", new_k), ("v", new_v)):
            t = t.reshape(heads * hd, -1)
            d = state[p + f"{x}_proj.weight"].shape[1]
            state[p + f"{x}_proj.weight"] = t[:, :d].float().contiguous()
            if p + f"{x}_proj.bias" in state:
                state[p + f"{x}_proj.bias"] = t[:, d].float().contiguous()
        state[p + "o_proj.weight"] = o.reshape(-1, heads * hd).float()
    return state


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "cohere"])
def test_fit_exact_on_tiny_families(model_type, tmp_path, one_torch_thread):
    """Rotate-half, biases (qwen2) and interleaved RoPE (cohere): GQA-2 -> MHA with RoPE-safe
    variants -> fit back to 2 K/V heads recovers the GQA logits; mean does not."""
    kv = 2
    gqa = random_model(AutoConfig.for_model(model_type, **{**SMALL, "num_key_value_heads": kv}))
    reference = logits(gqa, IDS)
    mha = random_model(AutoConfig.for_model(model_type, **SMALL))
    mha.load_state_dict(_rope_safe_variants(gqa.state_dict(), 2, HEADS, kv, HD, model_type == "cohere"))
    torch.testing.assert_close(logits(mha, IDS), reference, rtol=0, atol=1e-4)
    save(mha, tmp_path / "mha")
    convert(str(tmp_path / "mha"), tmp_path / "fit", kv, "fit")
    convert(str(tmp_path / "mha"), tmp_path / "mean", kv, "mean")
    assert (logits(load(tmp_path / "fit"), IDS) - reference).abs().max().item() < 1e-4
    assert (logits(load(tmp_path / "mean"), IDS) - reference).abs().max().item() > 1e-2


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_fit_with_groups_of_one_is_the_identity(model_type, tmp_path, one_torch_thread):
    """8 -> 8 heads: each group is one head, so the fit must keep the model (fused phi3 included)."""
    src = tiny_mha(model_type, tmp_path)
    convert(str(src), tmp_path / "fit", HEADS, "fit")
    torch.testing.assert_close(logits(load(tmp_path / "fit"), IDS), logits(load(src), IDS), rtol=0, atol=1e-4)


def test_wrong_rotary_pairing_breaks_the_exact_fit(tmp_path, one_torch_thread, monkeypatch):
    """The same model with planes paired the interleaved way (wrong for Llama): no longer exact."""
    convert(str(MHA8), tmp_path / "gqa4", 4)
    reference = logits(load(tmp_path / "gqa4"), IDS)
    mha = _expand_with_rotations(tmp_path / "gqa4", tmp_path / "mha")
    from uptrain.convert.layers import fit_start
    monkeypatch.setattr(fit_start, "rotary_planes", lambda hd, interleaved: rotary_planes(hd, not interleaved))
    convert(str(mha), tmp_path / "fit", 4, "fit")
    assert (logits(load(tmp_path / "fit"), IDS) - reference).abs().max().item() > 0.1


# ------------------------------------------------------------------ real model, real text


def _valid_loss(folder: Path, documents: int = 6) -> float:
    from uptrain.measure.eval import evaluate, load_model, tokenize_texts
    model, tokenizer = load_model(str(folder))
    texts = [t for t in VALID.read_text().splitlines() if t.strip()][:documents]
    return evaluate(model, tokenize_texts(tokenizer, texts), 512, 256).loss


def test_fit_beats_mean_on_stories260k(tmp_path, one_torch_thread):
    """stories260K-mha8 -> 2 K/V heads, alpha 0, first 6 stories of the valid sample (512/256 windows).

    Measured by this test: source 1.616, mean 4.988, fit 2.741, fit calibrated on 3,000 tokens of the
    train sample 2.425. (Whole valid sample: see results/conversion-methods.md.)
    """
    calib = Calibration(TRAIN, 3000)
    for name, method, cal in (("mean", "mean", None), ("fit", "fit", None), ("fitc", "fit", calib)):
        convert(str(MHA8), tmp_path / name, 2, method, calibration=cal)
    losses = {name: _valid_loss(tmp_path / name) for name in ("mean", "fit", "fitc")}
    print(losses)
    assert losses["fit"] < losses["mean"] - 1.0
    assert losses["fitc"] < losses["mean"] - 1.0
    record = json.loads((tmp_path / "fitc" / RECORD_FILE).read_text())
    assert record["method"] == "fit" and record["grouping"] == "contiguous"
    assert record["calibration"]["tokens_used"] == 3000 and record["calibration"]["file"] == str(TRAIN)
    card = (tmp_path / "fitc" / "README.md").read_text()
    assert "least-squares fit" in card and "calibration" in card
    load(tmp_path / "fitc")  # no weight report


# ------------------------------------------------------------------ refusals: one line, exit 2


def fails(argv: list, capsys, *needles: str) -> None:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


def test_fit_refuses_falcon_and_no_longer_the_families_it_now_starts(tmp_path, capsys):
    """Falcon's fused grouped layout is still refused in one line. Key norms (StableLM and Cohere
    qk-norm, Qwen3) and partial rotary (Phi) were refused here before issue 43; they now convert
    with their own start (tests/convert/test_fit_families.py proves it)."""
    from families import GQA_TYPES, tiny_config

    falcon = save(random_model(tiny_config("falcon", {**GQA_TYPES["falcon"], "num_kv_heads": 8})), tmp_path / "falcon")
    fails([falcon, "--kv-heads", 2, "--method", "fit", "--out", tmp_path / "out"], capsys,
          "--method fit cannot convert 'falcon' exactly", "interleaves K/V heads", "use --method mean")
    assert not (tmp_path / "out").exists()
    for model_type, extra in (("stablelm", dict(qk_layernorm=True)), ("cohere", dict(use_qk_norm=True)),
                              ("qwen3", {}), ("phi", dict(partial_rotary_factor=0.5))):
        src = tiny_mha(model_type, tmp_path, **extra)
        assert main([str(src), "--kv-heads", "2", "--method", "fit", "--out", str(tmp_path / f"{model_type}-out")]) == 0
        assert "fit start: " in capsys.readouterr().out


def test_calibration_refusals(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    base = [MHA8, "--kv-heads", 2, "--method", "fit", "--out", tmp_path / "out"]
    fails(base + ["--calib", tmp_path / "missing.txt"], capsys, "does not exist")
    fails(base + ["--calib", empty], capsys, "is empty")
    fails(base + ["--calib", VALID, "--calib-tokens", 0], capsys, "--calib-tokens must be positive")
    fails([MHA8, "--kv-heads", 2, "--calib", VALID, "--out", tmp_path / "out"], capsys, "--calib has no effect")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------ the batched fit == the reference fit
# The per-plane fit as it was before batching (commit 8dc0f91, verbatim but for names): eigh roots of Σ
# per call, one complex [g, D] x [D, D] product and one SVD per rotary plane, the [g*d, D] value stack.


def _ref_sigma_roots(sigma):
    s = sigma.double()
    s = (s + s.T) / 2
    s = s + torch.eye(len(s), dtype=s.dtype) * 1e-6 * s.diagonal().mean().clamp_min(1e-30)
    vals, vecs = torch.linalg.eigh(s)
    vals = vals.clamp_min(vals.max() * 1e-12)
    return (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T


def _ref_fit_values(wv, wo, sigma):
    g, hd, _ = wv.shape
    wv, wo, sig = wv.double(), wo.double(), sigma.double()
    root, inv_root = _ref_sigma_roots(sig)
    stacked = torch.cat([wo[j] @ wv[j] for j in range(g)])
    _, _, vh = torch.linalg.svd(stacked @ root, full_matrices=False)
    wv_new = vh[:hd] @ inv_root
    gram = wv_new @ sig @ wv_new.T
    cross = sig @ wv_new.T
    solve = torch.linalg.solve(gram, torch.eye(hd, dtype=gram.dtype))
    wo_new = torch.stack([wo[j] @ wv[j] @ cross @ solve for j in range(g)])
    return wv_new, wo_new


def _ref_fit_keys(wk, wq, sigma_k, sigma_q, planes):
    first, second = planes
    wk, wq = wk.double(), wq.double()
    root, inv_root = _ref_sigma_roots(sigma_k)
    sig_q = sigma_q.double()
    wk_new = torch.zeros(wk.shape[1:], dtype=torch.float64)
    wq_new = wq.clone()
    for i, j in zip(first.tolist(), second.tolist()):
        a = torch.complex(wk[:, i], wk[:, j])
        qr, qi = wq[:, i], wq[:, j]
        use = ((qr @ sig_q) * qr).sum(1) + ((qi @ sig_q) * qi).sum(1)
        use = use.clamp_min(use.max().clamp_min(1e-30) * 1e-9)
        weighted = use.sqrt()[:, None].to(a.dtype) * (a @ root.to(a.dtype))
        u, s, vh = torch.linalg.svd(weighted, full_matrices=False)
        key = s[0] * vh[0] @ inv_root.to(a.dtype)
        scale = u[:, 0] / use.sqrt()
        wk_new[i], wk_new[j] = key.real, key.imag
        c = scale.conj()
        cr, ci = c.real[:, None], c.imag[:, None]
        wq_new[:, i] = cr * qr - ci * qi
        wq_new[:, j] = ci * qr + cr * qi
    return wk_new, wq_new


def _canonical_values(wv_new, wo_new):
    """The reference's outputs with fit_values' sign convention (largest entry of each row positive):
    a singular vector's sign is free; flipping row r of W_v' and column r of W_o' keeps the function."""
    sign = wv_new.gather(1, wv_new.abs().argmax(1, keepdim=True)).sign()  # [hd, 1]
    return wv_new * sign, wo_new * sign.T


def _canonical_keys(wk_new, wq_new, planes):
    """The reference's outputs with fit_keys' phase convention (largest entry of each plane's key real
    positive): turning a plane's key by e^{-iφ} turns the folded query plane by e^{-iφ} too."""
    first, second = planes
    key = torch.complex(wk_new[first], wk_new[second])
    phase = key.gather(1, key.abs().argmax(1, keepdim=True))
    phase = (phase / phase.abs()).conj()  # [P, 1]
    key = key * phase
    q = torch.complex(wq_new[:, first], wq_new[:, second]) * phase
    wk_new, wq_new = wk_new.clone(), wq_new.clone()
    wk_new[first], wk_new[second] = key.real, key.imag
    wq_new[:, first], wq_new[:, second] = q.real, q.imag
    return wk_new, wq_new


def _fit_layer(fit_k, fit_v, wq, wk, wv, wo, sig_kv, sig_q, new_kv, planes):
    """transform_layer's group loop: every group gets the layer's Σ tensors (the same objects)."""
    g = len(wq) // new_kv
    ks, vs, qs, os_ = [], [], [], []
    for s in range(new_kv):
        grp = slice(s * g, (s + 1) * g)
        k1, q1 = fit_k(wk[grp], wq[grp], sig_kv, sig_q, planes)
        v1, o1 = fit_v(wv[grp], wo[grp], sig_kv)
        ks.append(k1), qs.append(q1), vs.append(v1), os_.append(o1)
    return torch.stack(ks), torch.cat(qs), torch.stack(vs), torch.cat(os_)


def _reference_layer(*args, planes):
    ks, qs, vs, os_ = _fit_layer(_ref_fit_keys, _ref_fit_values, *args, planes)
    new_kv, g = len(ks), len(qs) // len(ks)
    for s in range(new_kv):
        grp = slice(s * g, (s + 1) * g)
        ks[s], qs[grp] = _canonical_keys(ks[s], qs[grp], planes)
        vs[s], os_[grp] = _canonical_values(vs[s], os_[grp])
    return ks, qs, vs, os_


@pytest.mark.parametrize("heads", [32, 40, 64])
def test_batched_fit_equals_the_reference_fit(heads, one_torch_thread):
    """Whole layers (real head counts, small head_dim and width), every divisor group count in 2..16
    and groups of one; with and without the bias column, both rotary pairings; Σ identity, random SPD
    (calibration-like) and rank-deficient (fewer tokens than width); random and planted heads (a
    group's heads rotation-scaled copies: a top singular value far above the rest). The batched fit
    equals the per-plane reference (up to its sign/phase convention) to float64 round-off."""
    gen = torch.Generator().manual_seed(heads)
    worst = 0.0
    for new_kv in [n for n in range(2, 17) if heads % n == 0] + [heads]:
        for case in range(6):
            bias, interleaved, kind = case % 2 == 1, case % 4 >= 2, ("eye", "spd", "low")[case % 3]
            hd = (4, 8)[(case + new_kv) % 2]
            d = int(torch.randint(2 * hd, 48, (), generator=gen))
            dim = d + bias
            full = {"eye": torch.eye(d + 1, dtype=torch.float64),
                    "spd": None, "low": None}[kind]
            if full is None:
                x = torch.randn(3 * d if kind == "spd" else d // 2, d, generator=gen, dtype=torch.float64)
                x = torch.cat([x @ torch.randn(d, d, generator=gen, dtype=torch.float64), torch.ones(len(x), 1, dtype=torch.float64)], 1)
                full = x.T @ x / len(x)
            sig = full if bias else full[:d, :d]
            wq, wk, wv = (torch.randn(heads, hd, dim, generator=gen, dtype=torch.float64) for _ in range(3))
            wo = torch.randn(heads, d, hd, generator=gen, dtype=torch.float64)
            if case == 5:  # planted: in each group, heads are copies of the first up to per-plane complex scales
                g = heads // new_kv
                first, second = rotary_planes(hd, interleaved)
                for h in range(heads):
                    base = wk[h - h % g]
                    s = torch.complex(*torch.randn(2, hd // 2, 1, generator=gen, dtype=torch.float64))
                    kc = torch.complex(base[first], base[second]) * s
                    wk[h, first], wk[h, second] = kc.real, kc.imag
            planes = rotary_planes(hd, interleaved)
            args = (wq, wk, wv, wo, sig, sig, new_kv)
            got = _fit_layer(fit_keys, fit_values, *args, planes)
            want = _reference_layer(*args, planes=planes)
            for name, a, b in zip("kqvo", got, want):
                rel = ((a - b).abs().max() / b.abs().max()).item()
                worst = max(worst, rel)
                assert rel < 1e-10, (name, rel, dict(heads=heads, new_kv=new_kv, case=case, hd=hd, d=d))
    print(f"heads {heads}: worst relative difference {worst:.1e}")


def test_sigma_factor_is_made_once_per_sigma_and_never_stale(monkeypatch):
    """A layer's groups share one Cholesky of Σ; a different Σ, or Σ written in place, gets its own."""
    from uptrain.convert.math import fit
    calls = []
    real = torch.linalg.cholesky
    monkeypatch.setattr(torch.linalg, "cholesky", lambda a: calls.append(1) or real(a))
    gen = torch.Generator().manual_seed(0)
    sig = _random_spd(12, gen)
    wq, wk, wv = (torch.randn(8, 4, 12, generator=gen, dtype=torch.float64) for _ in range(3))
    wo = torch.randn(8, 12, 4, generator=gen, dtype=torch.float64)
    _fit_layer(fit_keys, fit_values, wq, wk, wv, wo, sig, sig, 4, rotary_planes(4, False))
    assert len(calls) == 1
    other = sig.clone()
    torch.testing.assert_close(fit.sigma_factor(other), fit.sigma_factor(sig), rtol=0, atol=0)
    assert len(calls) == 3  # an equal but distinct tensor is not trusted to be Σ
    sig.diagonal().add_(1.0)  # in place, through a view
    factor = fit.sigma_factor(sig)
    assert len(calls) == 4
    torch.testing.assert_close(factor @ factor.T, sig, rtol=1e-5, atol=0)
    del sig, other, factor
    assert not fit._FACTOR  # freed with Σ


# ------------------------------------------------------------------ partial rotary heads (the math; the converter: test_fit_families.py)


def _rope(v: torch.Tensor, pos: int, rotary_dims: int) -> torch.Tensor:
    """Llama/Phi RoPE (rotate_half) on the first rotary_dims rows of v [..., hd], written out here."""
    half = rotary_dims // 2
    angle = pos * 10000.0 ** (-2 * torch.arange(half, dtype=torch.float64) / rotary_dims)
    a, b = v[..., :half], v[..., half:rotary_dims]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos(), v[..., rotary_dims:]], -1)


def _linear_score_error(wq, wk, q_new, k_new, sig_q, sig_k) -> torch.Tensor:
    """Σ_j E(q_j(x)·k_j(y) − q'_j(x)·k'(y))² = Σ_j tr(Σ_q E_j Σ_k E_jᵀ), E_j = Q_jᵀ K_j − Q'_jᵀ K'."""
    e = wq.mT @ wk - q_new.mT @ k_new
    return (sig_q @ e @ sig_k @ e.mT).diagonal(dim1=-2, dim2=-1).sum()


@pytest.mark.parametrize("heads", [32, 40, 64])
def test_partial_rotary_fit_is_exact_on_planted_heads_at_every_position(heads):
    """Groups whose keys differ per head by complex scales on the rotary planes and by any invertible
    map on the other rows (queries compensated): the partial-rotary fit keeps every head's score at
    every pair of positions under real partial RoPE; mean pooling does not."""
    from uptrain.convert.math.fit import fit_keys_partial
    gen = torch.Generator().manual_seed(heads)
    for new_kv, hd, rotary_dims in ((4, 8, 4), (8, 8, 2), (2, 8, 6)):
        d = 20
        planes, passthrough = rotary_planes(rotary_dims, False), torch.arange(rotary_dims, hd)
        g = heads // new_kv
        sig = _random_spd(d, gen)
        wq = torch.randn(heads, hd, d, generator=gen, dtype=torch.float64)
        wk = torch.randn(new_kv, hd, d, generator=gen, dtype=torch.float64).repeat_interleave(g, 0)
        for h in range(heads):  # a RoPE-safe variant of the group's key, built independently of fit.py
            first, second = planes
            s = torch.complex(*torch.randn(2, len(first), 1, generator=gen, dtype=torch.float64))
            kc = torch.complex(wk[h, first], wk[h, second]) * s
            wk[h, first], wk[h, second] = kc.real, kc.imag
            mix = torch.randn(len(passthrough), len(passthrough), generator=gen, dtype=torch.float64) + 2 * torch.eye(len(passthrough))
            wk[h, passthrough] = mix @ wk[h, passthrough]
        x, y = torch.randn(d, 5, generator=gen, dtype=torch.float64), torch.randn(d, 5, generator=gen, dtype=torch.float64)
        worst_fit = worst_mean = 0.0
        for grp in (slice(s * g, (s + 1) * g) for s in range(new_kv)):
            k1, q1 = fit_keys_partial(wk[grp], wq[grp], sig, sig, planes, passthrough)
            for m, n in ((0, 0), (7, 3), (3, 7), (100, 1)):
                want = _rope((wq[grp] @ x).mT, m, rotary_dims) @ _rope((wk[grp] @ y).mT, n, rotary_dims).mT
                got = _rope((q1 @ x).mT, m, rotary_dims) @ _rope((k1 @ y).mT, n, rotary_dims).mT
                mean = _rope((wq[grp] @ x).mT, m, rotary_dims) @ _rope((wk[grp].mean(0) @ y).mT, n, rotary_dims).mT
                worst_fit = max(worst_fit, ((got - want).abs().max() / want.abs().max()).item())
                worst_mean = max(worst_mean, ((mean - want).abs().max() / want.abs().max()).item())
        print(f"{heads} heads, {new_kv} groups, rotary dims {rotary_dims}: fit {worst_fit:.1e}, mean {worst_mean:.1e}")
        assert worst_fit < 1e-9, (new_kv, rotary_dims, worst_fit)
        assert worst_mean > 0.1, (new_kv, rotary_dims, worst_mean)


def test_linear_key_fit_minimises_its_documented_objective():
    """fit_linear_keys on random inputs: its documented objective, measured on its outputs, equals
    the closed-form minimum (Eckart–Young on the stacked query-weighted whitened keys, computed here
    with other factorisations) and is never above mean pooling's."""
    from uptrain.convert.math.fit import fit_linear_keys
    gen = torch.Generator().manual_seed(0)
    for trial in range(30):
        g, n = int(torch.randint(2, 9, (), generator=gen)), int(torch.randint(1, 6, (), generator=gen))
        d = int(torch.randint(n + 1, 30, (), generator=gen))
        sig_q, sig_k = _random_spd(d, gen), (_random_spd(d, gen) if trial % 3 else torch.eye(d, dtype=torch.float64))
        wk = torch.randn(g, n, d, generator=gen, dtype=torch.float64)
        wq = torch.randn(g, n, d, generator=gen, dtype=torch.float64) * torch.rand(g, n, 1, generator=gen, dtype=torch.float64).mul(3).exp()
        k1, q1 = fit_linear_keys(wk, wq, sig_k, sig_q)
        fit = _linear_score_error(wq, wk, q1, k1, sig_q, sig_k)
        mean = _linear_score_error(wq, wk, wq, wk.mean(0), sig_q, sig_k)
        weight = torch.linalg.cholesky(wq @ sig_q @ wq.mT).mT  # Fᵀ F = E q qᵀ
        rows = (weight @ wk @ torch.linalg.cholesky(sig_k)).reshape(-1, d)
        sv = torch.linalg.svdvals(rows)
        minimum = rows.pow(2).sum() - sv[:n].pow(2).sum()
        case = dict(trial=trial, g=g, n=n, d=d, fit=fit.item(), minimum=minimum.item(), mean=mean.item())
        assert abs(fit - minimum) <= 1e-6 * mean, case
        assert fit <= mean * (1 + 1e-9), case
