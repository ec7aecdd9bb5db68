"""Function-aware K/V head merging: least-squares fits with compensation in Q and O (`--method fit`).

Pure tensor math (float64 inside), one group of query heads at a time, in the "MHA view": every
query head has its own key/value head (a GQA source is first expanded by repeating its K/V heads,
which keeps its function). Inputs are augmented matrices [rows, D] whose last column is the bias
when the projection has one; `sigma` is the matching D x D second moment E[x xᵀ] of the attention
input (the identity without calibration).

- V/O: the shared value head spans the top right singular directions of the stacked per-head value
  outputs W_o,j W_v,j (Σ-weighted); each head's o_proj columns are then refitted by least squares.
- K/Q: per 2-D rotary plane, one shared complex key row and one complex scale per query head
  (k_j ≈ s_j k), weighted by how much head j's query uses the plane; conj(s_j) is folded into head
  j's query rows of that plane. A complex scale is a 2x2 rotation-scaling, which commutes with RoPE,
  so every attention score the fit keeps, it keeps at every position.
- Partial rotary heads (`fit_keys_partial`, what the converter calls for every head: with no rows
  outside the planes it is `fit_keys`): the rotary planes as above, the rows RoPE leaves alone by
  one shared block and a linear map per head (`fit_linear_keys`).
- Keys behind a norm (Qwen3, OLMo-2, StableLM/Cohere qk-norm, ...): `normfit.py`.

Mean pooling (with Q and O unchanged) is one point of each fitted family, so on these objectives
the fit is never worse than mean pooling.

Cost at real widths: Σ enters only through a whitening factor L (Σ = L Lᵀ, Cholesky), computed once
per Σ tensor (cached, so once per layer when every group passes the layer's Σ) — an eigendecomposition
of a 4097 x 4097 Σ takes minutes on a small CPU, a Cholesky well under a second. Any L with
L Lᵀ = Σ gives the same fit (the whitened problems differ by an orthogonal map), so this is the
symmetric-root formulation up to float64 round-off. All rotary planes of a group are fitted in one
batched SVD; per head the work is a few [hd, D] x [D, D] products.
"""

from __future__ import annotations

import weakref

import torch

RIDGE = 1e-6  # relative ridge on Σ (times its mean diagonal): keeps Σ^{-1/2} finite, L invertible


def rotary_planes(head_dim: int, interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, second) row indices of each 2-D rotary plane of a head.

    rotate_half (Llama, HF default): plane i pairs dims i and i + head_dim/2.
    interleaved (Cohere, GLM, GPT-J): plane i pairs dims 2i and 2i + 1.
    """
    if head_dim % 2:
        raise ValueError(f"head_dim {head_dim} is odd: no rotary planes")
    half = head_dim // 2
    if interleaved:
        return torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)
    return torch.arange(half), torch.arange(half, head_dim)


def _ridged(sigma: torch.Tensor) -> torch.Tensor:
    """Σ symmetrised, float64, plus RIDGE times its mean diagonal on the diagonal."""
    s = sigma.double()
    s = s + s.T  # in place from here: at 4097 x 4097 every temporary is 134 MB
    s.mul_(0.5)
    s.diagonal().add_(RIDGE * s.diagonal().mean().clamp_min(1e-30))
    return s


def sigma_roots(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ^{1/2}, Σ^{-1/2}) of a symmetric PSD matrix, with a small relative ridge.

    An eigendecomposition: slow at real widths (minutes for 4097 x 4097 on 2 cores). The fit uses
    `sigma_factor` instead; anything invariant to the whitening's orthogonal part can too.
    """
    vals, vecs = torch.linalg.eigh(_ridged(sigma))
    vals = vals.clamp_min(vals.max() * 1e-12)
    return (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T


# One cached factor: (weak reference to the Σ tensor it was computed from, Σ's version counter, L).
# transform_layer passes the same Σ tensor to every group's fit, so the factor is made once per layer;
# the weak reference (checked by identity) and the version counter (bumped by any in-place write to Σ
# or a view of it) make a stale hit impossible, and the entry is dropped when Σ is freed.
_FACTOR: list = []


def sigma_factor(sigma: torch.Tensor) -> torch.Tensor:
    """Lower-triangular L [D, D], float64, with L Lᵀ = Σ + ridge (the ridge of `sigma_roots`).

    Cached per Σ tensor (one entry). With the ridge every eigenvalue is at least RIDGE x mean
    diagonal, far above float64 round-off for D < 10^6, so the Cholesky cannot fail on a PSD Σ
    (and `sigma_roots`' eigenvalue clamp never binds: the two whiten the same matrix).
    """
    if _FACTOR:
        ref, version, factor = _FACTOR[0]
        if ref() is sigma and sigma._version == version:
            return factor
    factor = torch.linalg.cholesky(_ridged(sigma))

    def drop(dead: weakref.ref) -> None:
        if _FACTOR and _FACTOR[0][0] is dead:
            _FACTOR.clear()
    _FACTOR[:] = [(weakref.ref(sigma, drop), sigma._version, factor)]
    return factor


def _unwhiten(z: torch.Tensor, factor: torch.Tensor) -> torch.Tensor:
    """z L^{-1} for rows z [n, D] (real): maps a whitened row back to a weight row."""
    return torch.linalg.solve_triangular(factor, z, upper=False, left=False)


def _top_singular(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Top-k singular triplets (u [..., m, k], s [..., k], vh [..., k, D]) of rows [..., m, D].

    Through a QR of the transpose and the SVD of its small triangle (rows = Rᴴ Qᴴ, Q orthonormal):
    the same triplets, ~10x faster than LAPACK's SVD of the wide [512, 4097] matrices met here.
    """
    q, r = torch.linalg.qr(rows.mH)  # [..., D, min(m, D)], [..., min(m, D), m]
    u, s, vh = torch.linalg.svd(r.mH, full_matrices=False)
    return u[..., :k], s[..., :k], vh[..., :k, :] @ q.mH


def fit_values(wv: torch.Tensor, wo: torch.Tensor, sigma: torch.Tensor, keep_scale: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One shared value head for a group, and each head's refitted o_proj columns.

    wv: [g, hd, D] value rows per head (augmented); wo: [g, d, hd] o_proj columns per head.
    Returns (wv_new [hd, D], wo_new [g, d, hd]), float64. Each row of wv_new is signed so that its
    largest-magnitude entry is positive (a singular vector's sign is otherwise LAPACK's choice).
    keep_scale: wv_new is instead M wv_new (o_proj columns times M⁻¹) with M = `size_map` of the
    least-squares maps B_j (W_v,j ≈ B_j wv_new), so values keep the source heads' size and identical
    heads come back as they are (what a clamp on the outputs, clip_qkv, needs).
    """
    g, hd, dim = wv.shape
    wv, wo, sig = wv.double(), wo.double(), sigma.double()
    factor = sigma_factor(sigma)
    # The stacked value outputs [W_o,1 W_v,1; ...] L ([g*d, D]) are blockdiag(Q_j) [R_j W_v,j L] with
    # W_o,j = Q_j R_j (orthonormal Q_j): same singular values and right singular vectors as the
    # small [g*hd, D] stack, without forming (or decomposing) the [g*d, D] one.
    r = torch.linalg.qr(wo, mode="r").R  # [g, min(d, hd), hd]
    _, _, vh = _top_singular((r @ (wv @ factor)).reshape(-1, dim), hd)
    wv_new = _unwhiten(vh, factor)  # [hd, D]; wv_new Σ wv_newᵀ = I
    pick = wv_new.abs().argmax(1, keepdim=True)
    wv_new = wv_new * wv_new.gather(1, pick).sign()
    cross = sig @ wv_new.T  # [D, hd]
    gram = wv_new @ cross
    solve = torch.linalg.solve(gram, torch.eye(hd, dtype=gram.dtype))
    wo_new = wo @ (wv @ cross @ solve)  # [g, d, hd]: least squares W_o,j W_v,j ≈ W'_o,j W'_v under Σ
    if keep_scale:
        size = size_map(wv @ cross @ solve)  # from the maps W_v,j ≈ B_j wv_new (least squares under Σ)
        if torch.linalg.cond(size) < 1e8:
            wv_new, wo_new = size @ wv_new, wo_new @ torch.linalg.inv(size)
    return wv_new, wo_new


def fit_keys(wk: torch.Tensor, wq: torch.Tensor, sigma_k: torch.Tensor, sigma_q: torch.Tensor,
             planes: tuple[torch.Tensor, torch.Tensor], keep_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One shared key head for a group, and each head's query rows with the per-plane scales folded in.

    wk: [g, hd, Dk] key rows per head (augmented), sigma_k its Dk x Dk moment; wq: [g, hd, Dq]
    query rows (augmented with the q bias if any), sigma_q its moment (only used for the weights
    of the fit). Returns (wk_new [hd, Dk], wq_new [g, hd, Dq]), float64.

    Objective, per plane p (k_j, q_j: head j's key and query in the plane as complex numbers,
    x ~ Σ): min over a shared key k and scales s_j of Σ_j E|q_j|² · E|k_j(x) − s_j k(x)|², which is
    the expected squared error of the plane's complex score q_j(x) conj(k_j(y)) with conj(s_j)
    folded into q_j, for independent x, y (so at every relative position: RoPE multiplies both
    scores by the same phase). Solved exactly by the top singular pair of the weighted, whitened
    rows [sqrt(E|q_j|²) a_j L]_j. Each plane's key is turned so that its largest-magnitude entry
    is real and positive (the pair's phase is otherwise LAPACK's choice; the scales turn with it).
    keep_scale: the key's free complex factor per plane (the scales divided by it) is instead set by
    `_source_size`, so the key keeps the source heads' size, the queries theirs on average, and
    identical heads come back as they are (what a clamp on the outputs, clip_qkv, needs).
    """
    first, second = planes
    wk, wq = wk.double(), wq.double()
    factor = sigma_factor(sigma_k)
    sig_q = sigma_q.double()
    row_use = ((wq @ sig_q) * wq).sum(-1)  # [g, hd]: E q_row², every row at once
    use = (row_use[:, first] + row_use[:, second]).T  # [P, g]: E|q_plane|² per plane and head
    use = use.clamp_min(use.amax(1, keepdim=True).clamp_min(1e-30) * 1e-9)
    white = wk @ factor  # [g, hd, Dk]
    a = torch.complex(white[:, first], white[:, second]).transpose(0, 1)  # [P, g, Dk]: whitened complex key rows
    weight = use.sqrt()
    u, s, vh = _top_singular(weight[..., None].to(a.dtype) * a, 1)  # batched over planes
    z = s * vh[:, 0]  # [P, Dk]: whitened shared key per plane
    n_planes = len(first)
    back = _unwhiten(torch.cat([z.real, z.imag]), factor)
    key = torch.complex(back[:n_planes], back[n_planes:])  # [P, Dk]
    scale = u[:, :, 0] / weight  # [P, g]: k_h ≈ scale_h * key
    phase = key.gather(1, key.abs().argmax(1, keepdim=True))  # [P, 1]
    phase = phase / phase.abs().clamp_min(1e-300)
    key, scale = key * phase.conj(), scale * phase
    if keep_scale:
        key, scale = _source_size(key, scale, use)
    wk_new = torch.zeros(wk.shape[1:], dtype=torch.float64)
    wk_new[first], wk_new[second] = key.real, key.imag
    # fold conj(s_h) into the query plane: Re(c q conj(k)) = Re(q conj(s_h k))
    c = scale.conj().T[:, :, None]  # [g, P, 1]
    cr, ci = c.real, c.imag
    qr, qi = wq[:, first], wq[:, second]  # [g, P, Dq]
    wq_new = wq.clone()
    wq_new[:, first] = cr * qr - ci * qi
    wq_new[:, second] = ci * qr + cr * qi
    return wk_new, wq_new


def _source_size(key: torch.Tensor, scale: torch.Tensor, use: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key c, scale / c) per plane: key [P, Dk], scale [P, g] (k_j ≈ scale_j key), use [P, g].

    c takes the phase of the scales' use-weighted mean and the size of their weighted RMS (a
    plane's `size_map`): the scales keep RMS 1, so queries keep their size on average and the key
    takes the heads' size; identical heads give c = their scale (key and queries as they were).
    """
    weight = use / use.sum(1, keepdim=True)  # [P, g]
    mean = (weight * scale).sum(1)
    rms = (weight * scale.abs().pow(2)).sum(1).sqrt()
    turn = torch.where(mean.abs() > 1e-12 * rms, mean / mean.abs().clamp_min(1e-300), torch.ones_like(mean))
    c = torch.where(rms > 0, turn * rms, torch.ones_like(mean))
    return key * c[:, None], scale / c[:, None]


def size_map(maps: torch.Tensor) -> torch.Tensor:
    """The source-size gauge of maps [g, n, n] (head j ≈ maps_j @ shared rows): M = U S, U the
    rotation of the maps' mean (polar decomposition) and S = (mean_j maps_jᵀ maps_j)^{1/2}. Then
    M⁻ᵀ (mean_j maps_jᵀ maps_j) M⁻¹ = I (the folded maps_j M⁻¹ keep size 1 on average), M is as well
    conditioned as the maps' Gram, and g identical maps give M = that map.
    """
    u, _, vh = torch.linalg.svd(maps.mean(0))
    vals, vecs = torch.linalg.eigh((maps.mT @ maps).mean(0))
    root = (vecs * vals.clamp_min(0).sqrt()) @ vecs.mT
    return u @ vh @ root


def fit_linear_keys(wk: torch.Tensor, wq: torch.Tensor, sigma_k: torch.Tensor, sigma_q: torch.Tensor,
                    keep_scale: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One shared key block for a group's rows that RoPE leaves alone, with a linear map per head.

    wk: [g, n, Dk] the non-rotary key rows per head (augmented), wq: [g, n, Dq] the matching query
    rows. These dims enter the score as a plain dot product q_j(x)·k_j(y) at every position, so any
    linear map can be moved between the two sides: k_j ≈ A_j k' with A_j [n, n], and A_jᵀ folded
    into head j's query rows keeps q'_j(x)·k'(y) = q_j(x)ᵀ A_j k'(y). Objective: Σ_j E(q_j(x)ᵀ (k_j −
    A_j k')(y))² for independent x ~ Σ_q, y ~ Σ_k = Σ_j ‖F_j (K_j − A_j K') L‖² with F_jᵀ F_j = E q_j q_jᵀ:
    for a fixed row space of K' L the best A_j leaves the part of F_j K_j L outside it, so K' spans
    the top n right singular directions of the stacked [F_j K_j L]_j (like `fit_values`) and A_j is
    the Σ-weighted least squares K_j ≈ A_j K'. Mean pooling (A_j = I) is one point of the family.
    Returns (wk_new [n, Dk], wq_new [g, n, Dq]), float64; rows of wk_new signed like `fit_values`.
    keep_scale: K' is instead M K' with M = `size_map` of the maps (A_j M⁻¹ folded), so the key keeps
    the heads' size, queries theirs on average, and identical heads come back as they are.
    """
    g, n, dim = wk.shape
    wk, wq, sig_k, sig_q = wk.double(), wq.double(), sigma_k.double(), sigma_q.double()
    factor = sigma_factor(sigma_k)
    moment = wq @ sig_q @ wq.mT  # [g, n, n]: E q_j q_jᵀ
    vals, vecs = torch.linalg.eigh((moment + moment.mT) / 2)
    weight = vals.clamp_min(0).sqrt()[..., None] * vecs.mT  # F_j [g, n, n], F_jᵀ F_j = E q_j q_jᵀ
    _, _, vh = _top_singular((weight @ (wk @ factor)).reshape(-1, dim), n)
    wk_new = _unwhiten(vh, factor)  # [n, Dk]
    wk_new = wk_new * wk_new.gather(1, wk_new.abs().argmax(1, keepdim=True)).sign()
    cross = sig_k @ wk_new.T  # [Dk, n]
    maps = wk @ cross @ torch.linalg.solve(wk_new @ cross, torch.eye(n, dtype=cross.dtype))  # A_j [g, n, n]
    if keep_scale:
        size = size_map(maps)
        if torch.linalg.cond(size) < 1e8:
            wk_new, maps = size @ wk_new, maps @ torch.linalg.inv(size)
    return wk_new, maps.mT @ wq


def fit_keys_partial(wk: torch.Tensor, wq: torch.Tensor, sigma_k: torch.Tensor, sigma_q: torch.Tensor,
                     planes: tuple[torch.Tensor, torch.Tensor], passthrough: torch.Tensor, keep_scale: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """`fit_keys` for partial rotary heads: the rotary planes as in `fit_keys`, the dims RoPE leaves
    alone (`passthrough`, indices into the head's rows) by `fit_linear_keys`.

    wk: [g, hd, Dk]; wq: [g, hd, Dq]; planes: the (first, second) rows of each rotary plane (e.g.
    `rotary_planes(rotary_dims, interleaved)` when RoPE covers the first rotary_dims rows, as in
    Phi and StableLM); every row is in exactly one plane or in `passthrough`. The two parts of the
    score add up, and each part's objective involves only its own rows, so fitting them apart is
    the joint optimum. Returns (wk_new [hd, Dk], wq_new [g, hd, Dq]), float64. keep_scale: as in
    `fit_keys` and `fit_linear_keys`.
    """
    wk_new, wq_new = fit_keys(wk, wq, sigma_k, sigma_q, planes, keep_scale)
    if len(passthrough):
        wk_new[passthrough], wq_new[:, passthrough] = fit_linear_keys(wk[:, passthrough], wq[:, passthrough],
                                                                      sigma_k, sigma_q, keep_scale)
    return wk_new, wq_new
