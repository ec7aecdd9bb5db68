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

Mean pooling (with Q and O unchanged) is one point of each fitted family, so on these objectives
the fit is never worse than mean pooling.
"""

from __future__ import annotations

import torch

RIDGE = 1e-6  # relative ridge on Σ (times its mean diagonal): keeps Σ^{-1/2} finite


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


def sigma_roots(sigma: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(Σ^{1/2}, Σ^{-1/2}) of a symmetric PSD matrix, with a small relative ridge."""
    s = sigma.double()
    s = (s + s.T) / 2
    s = s + torch.eye(len(s), dtype=s.dtype) * RIDGE * s.diagonal().mean().clamp_min(1e-30)
    vals, vecs = torch.linalg.eigh(s)
    vals = vals.clamp_min(vals.max() * 1e-12)
    return (vecs * vals.sqrt()) @ vecs.T, (vecs * vals.rsqrt()) @ vecs.T


def fit_values(wv: torch.Tensor, wo: torch.Tensor, sigma: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One shared value head for a group, and each head's refitted o_proj columns.

    wv: [g, hd, D] value rows per head (augmented); wo: [g, d, hd] o_proj columns per head.
    Returns (wv_new [hd, D], wo_new [g, d, hd]), float64.
    """
    g, hd, _ = wv.shape
    wv, wo, sig = wv.double(), wo.double(), sigma.double()
    root, inv_root = sigma_roots(sig)
    stacked = torch.cat([wo[j] @ wv[j] for j in range(g)])  # [g*d, D]
    _, _, vh = torch.linalg.svd(stacked @ root, full_matrices=False)
    wv_new = vh[:hd] @ inv_root  # [hd, D]; wv_new Σ wv_newᵀ = I
    gram = wv_new @ sig @ wv_new.T
    cross = sig @ wv_new.T  # [D, hd]
    solve = torch.linalg.solve(gram, torch.eye(hd, dtype=gram.dtype))
    wo_new = torch.stack([wo[j] @ wv[j] @ cross @ solve for j in range(g)])
    return wv_new, wo_new


def fit_keys(wk: torch.Tensor, wq: torch.Tensor, sigma_k: torch.Tensor, sigma_q: torch.Tensor,
             planes: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """One shared key head for a group, and each head's query rows with the per-plane scales folded in.

    wk: [g, hd, Dk] key rows per head (augmented), sigma_k its Dk x Dk moment; wq: [g, hd, Dq]
    query rows (augmented with the q bias if any), sigma_q its moment (only used for the weights
    of the fit). Returns (wk_new [hd, Dk], wq_new [g, hd, Dq]), float64.
    """
    first, second = planes
    wk, wq = wk.double(), wq.double()
    root, inv_root = sigma_roots(sigma_k)
    sig_q = sigma_q.double()
    wk_new = torch.zeros(wk.shape[1:], dtype=torch.float64)
    wq_new = wq.clone()
    for i, j in zip(first.tolist(), second.tolist()):
        a = torch.complex(wk[:, i], wk[:, j])  # [g, Dk]: head h's key in this plane, as one complex row
        qr, qi = wq[:, i], wq[:, j]  # [g, Dq]
        use = ((qr @ sig_q) * qr).sum(1) + ((qi @ sig_q) * qi).sum(1)  # E|q_plane|², per head
        use = use.clamp_min(use.max().clamp_min(1e-30) * 1e-9)
        weighted = use.sqrt()[:, None].to(a.dtype) * (a @ root.to(a.dtype))
        u, s, vh = torch.linalg.svd(weighted, full_matrices=False)
        key = s[0] * vh[0] @ inv_root.to(a.dtype)  # [Dk] complex
        scale = u[:, 0] / use.sqrt()  # [g]: k_h ≈ scale_h * key
        wk_new[i], wk_new[j] = key.real, key.imag
        c = scale.conj()  # fold conj(s_h) into the query plane: Re(c q conj(k)) = Re(q conj(s_h k))
        cr, ci = c.real[:, None], c.imag[:, None]
        wq_new[:, i] = cr * qr - ci * qi
        wq_new[:, j] = ci * qr + cr * qi
    return wk_new, wq_new
