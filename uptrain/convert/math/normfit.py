"""The fit's start where keys pass through a norm after the projection (`--method fit` on Qwen3,
Gemma 3, EXAONE 4, Phi qk_layernorm, StableLM qk_layernorm, Cohere use_qk_norm, OLMo-2/3), and
the activity of a q/k/v clamp (`clip_qkv`, OLMo-1).

Pure tensor math (float64), one attention layer in the MHA view (one K/V head per query head),
rows augmented with the bias column like `fit.py`; `sigma` is the attention input's Σ = E[x xᵀ].

Why not `fit.fit_keys`: a key norm divides each token's key by its RMS (LayerNorm: after
centring), so it undoes per-head scales, and the query norm that every such family also has
undoes whatever is folded into the queries. What the norm leaves linear: it divides by a
per-token scalar that stays near its calibrated RMS ρ_j = sqrt(E‖P k_j‖² / hd) (P: LayerNorm's
centring, or the identity; a whole-projection norm has one ρ for all heads), so after the norm
head j's key is close to γ_j ⊙ P W_j x / ρ_j (γ_j: its norm weight). The start merges those
linearised keys, queries unchanged: per key row r the mean of the group's normalised rows
weighted by how much each head's normalised query uses the row (its rotary plane for rotary rows),
which minimises Σ_j Σ_r w_jr E(k̂_jr − k̂'_r)². The merged key is then written in the norm's terms:

- per-head (StableLM, Cohere) and whole-projection (OLMo-2/3) norms: the group's norm weight is
  free, so it carries the merged key's calibrated length (unlike heads average to a shorter key,
  which the norm alone would stretch back to full length: sharper attention than least squares).
- shared norms (Qwen3, Gemma 3, EXAONE 4, Phi): one weight for all heads, kept as it is, so the
  merged key comes out at the norm's length; only its direction is fitted.

The k_proj rows keep the group's mean source RMS, so the norm's eps weighs as in the source.
Heads identical within a group give back their own rows and norm weight (exact).
"""

from __future__ import annotations

import torch

from uptrain.convert.math.fit import sigma_factor

TINY = 1e-30


def centre(w: torch.Tensor, centred: bool) -> torch.Tensor:
    """[..., hd, D] -> [..., hd, D]: LayerNorm's centring over a head's rows (linear in x), or w as is."""
    return w - w.mean(-2, keepdim=True) if centred else w


def row_energy(w: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """[..., rows, D] -> [..., rows]: E (w_r x)² under x ~ Σ, for every row at once (float64).

    Through the cached Cholesky factor L of Σ (`fit.sigma_factor`, the one the value fit uses):
    ‖w_r L‖² = w_r Σ w_rᵀ up to the fit's ridge.
    """
    return (w.double() @ sigma_factor(sigma)).pow(2).sum(-1)


def head_rms(energy: torch.Tensor, whole: bool) -> torch.Tensor:
    """[H, hd] row energies -> [H]: each head's calibrated RMS (whole: one over all heads)."""
    ms = energy.mean(-1)
    if whole:
        ms = ms.mean().expand_as(ms)
    return ms.clamp_min(TINY).sqrt()


def row_use(q_energy: torch.Tensor, q_rms: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor]
            ) -> torch.Tensor:
    """[H, hd] weights: how much each head's normalised query uses each key row.

    q_energy: [H, hd] E q_r² of the (centred) query rows; q_rms: [H] their RMS. A rotary row takes
    its plane's energy (RoPE mixes the two rows of a plane at every position), any other row its
    own. Clamped below at 1e-9 of the largest, so a row no query uses still has a defined mean.
    """
    use = q_energy / q_rms.pow(2)[:, None]
    first, second = planes
    pair = use[:, first] + use[:, second]
    use[:, first], use[:, second] = pair, pair
    return use.clamp_min(use.max().clamp_min(TINY) * 1e-9)


def merge_normalised(wk: torch.Tensor, use: torch.Tensor, rms: torch.Tensor,
                     gamma: torch.Tensor | None) -> torch.Tensor:
    """One group's merged linearised key [hd, D]: Σ_j w_jr γ_jr W_j[r] / ρ_j with w_jr = use_jr / Σ_j use_jr.

    wk: [g, hd, D] (centred for LayerNorm); use: [g, hd] from `row_use`; rms: [g] from `head_rms`;
    gamma: [g, hd] each head's norm weight, None for a shared norm (the same factor on every head).
    """
    u = wk / rms[:, None, None]
    if gamma is not None:
        u = u * gamma[..., None]
    weight = use / use.sum(0, keepdim=True)
    return (weight[..., None] * u).sum(0)


def _safe(gamma: torch.Tensor) -> torch.Tensor:
    """gamma with entries near 0 moved away from it (keeping their sign): it is divided by."""
    floor = gamma.abs().amax().clamp_min(TINY) * 1e-6
    sign = torch.where(gamma < 0, -1.0, 1.0).to(gamma.dtype)
    return torch.where(gamma.abs() < floor, sign * floor, gamma)


def write_in_norm(merged: torch.Tensor, gamma_mean: torch.Tensor | None, source_rms: torch.Tensor,
                  sigma: torch.Tensor, centred: bool, whole: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The merged keys as k_proj rows and norm weights: (wk [G, hd, D], gamma [G, hd] or None).

    merged: [G, hd, D] from `merge_normalised`; gamma_mean: [G, hd] the mean norm weight of each
    group (None: shared norm, kept); source_rms: [G] the group's mean source RMS (the rows are
    scaled to it). With a norm weight per group, W' = merged / γ̄ and γ' = γ̄ ρ(W'): then
    γ' ⊙ N(W' x) ≈ merged x, the merged key at its least-squares length.
    """
    rows = merged if gamma_mean is None else merged / _safe(gamma_mean)[..., None]
    rms = head_rms(row_energy(centre(rows, centred), sigma), whole)  # [G]
    gamma = None if gamma_mean is None else gamma_mean * rms[:, None]
    return rows * (source_rms / rms)[:, None, None], gamma


def merge_keys_under_norm(wq: torch.Tensor, wk: torch.Tensor, sigma_k: torch.Tensor, sigma_q: torch.Tensor,
                          groups: int, planes: tuple[torch.Tensor, torch.Tensor], centred: bool, whole: bool,
                          gamma: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A layer's keys merged behind its key norm: (wk_new [groups, hd, Dk], gamma_new [groups, hd] or None).

    wq: [H, hd, Dq], wk: [H, hd, Dk] query and key rows per head (MHA view, augmented), in group
    order (groups of H // groups consecutive heads); sigma_q, sigma_k their moments; planes: the
    (first, second) rows of each rotary plane (other rows: no RoPE); centred: LayerNorm (else
    RMSNorm); whole: one norm over the whole projection (OLMo-2/3; also its query norm);
    gamma: [H, hd] each head's key norm weight, None for a shared norm. Queries are left as they
    are (the query norm would undo anything folded into them).
    """
    heads, hd, _ = wk.shape
    g = heads // groups
    wk_c, wq_c = centre(wk.double(), centred), centre(wq.double(), centred)
    q_energy = ((wq_c @ sigma_q.double()) * wq_c).sum(-1)  # [H, hd]
    use = row_use(q_energy, head_rms(q_energy, whole), planes)
    rms = head_rms(row_energy(wk_c, sigma_k), whole)  # [H]
    gam = None if gamma is None else gamma.double()
    merged = torch.stack([merge_normalised(wk_c[s * g:(s + 1) * g], use[s * g:(s + 1) * g], rms[s * g:(s + 1) * g],
                                           None if gam is None else gam[s * g:(s + 1) * g]) for s in range(groups)])
    gamma_mean = None if gam is None else gam.reshape(groups, g, hd).mean(1)
    return write_in_norm(merged, gamma_mean, rms.reshape(groups, g).mean(1), sigma_k, centred, whole)


def output_rms(w: torch.Tensor, sigma: torch.Tensor) -> float:
    """The largest RMS of a projection's outputs, max_r sqrt(E (w_r x)²): w [rows, D] (augmented
    like sigma). Where `clip_qkv` c is several times this, the clamp (|y| <= c) is rarely reached.
    A plain product with Σ, not `row_energy`: q and k/v may have different Σ tensors, and the one
    cached factor is the value fit's."""
    w = w.double()
    return ((w @ sigma.double()) * w).sum(-1).max().clamp_min(0).sqrt().item()
