"""Which query heads share a K/V head (`--grouping similar`): equal-size groups of alike heads.

Pure tensor math on one layer in the MHA view (one key/value head per query head). Permuting
heads consistently (q rows, k/v rows and biases, o_proj input columns) leaves an MHA model's
function unchanged, so any grouping is allowed; equal sizes keep a standard transformers model.

Alike means what the merging method can use: for `fit`, keys alike up to a rotation-scaling per
rotary plane and values spanning the same subspace (what the fit aligns away); for `mean`/`first`,
keys and values alike as they are (mean pooling aligns nothing). Σ weights both (identity without
calibration).
"""

from __future__ import annotations

import itertools

import torch

from uptrain.convert.fit import sigma_roots


def head_similarity(wk: torch.Tensor, wv: torch.Tensor, sigma: torch.Tensor, aligned: bool,
                    planes: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[H, H] similarity of heads (key part + value part, each at most 1).

    wk, wv: [H, hd, D] key and value rows per head (augmented like `sigma`).
    aligned: similarity up to the transforms `fit` allows; else plain cosine.
    """
    root, _ = sigma_roots(sigma)
    k = wk.double() @ root
    v = wv.double() @ root
    if aligned:
        first, second = planes
        a = torch.complex(k[:, first], k[:, second])  # [H, planes, D]
        a = a / a.norm(dim=2, keepdim=True).clamp_min(1e-30)
        weight = torch.complex(k[:, first], k[:, second]).norm(dim=2)  # [H, planes]: plane energy
        inner = torch.einsum("ipd,jpd->ijp", a, a.conj()).abs()  # |cos| per plane, rotation-invariant
        w = (weight[:, None, :] * weight[None, :, :]).sqrt()
        sim_k = (inner * w).sum(2) / w.sum(2).clamp_min(1e-30)
        basis = torch.linalg.qr(v.transpose(1, 2)).Q  # [H, D, hd]: orthonormal basis of each value row space
        sim_v = torch.einsum("idr,jds->ijrs", basis, basis).pow(2).sum((2, 3)) / v.shape[1]
    else:
        kf = k.flatten(1)
        vf = v.flatten(1)
        kf = kf / kf.norm(dim=1, keepdim=True).clamp_min(1e-30)
        vf = vf / vf.norm(dim=1, keepdim=True).clamp_min(1e-30)
        sim_k, sim_v = kf @ kf.T, vf @ vf.T
    return sim_k + sim_v


def equal_groups(similarity: torch.Tensor, groups: int) -> list[list[int]]:
    """Split heads into `groups` equal groups with a large total within-group similarity.

    Greedy (seed each group with the unassigned head most alike to the rest, add the heads most
    alike to the group so far), then swap pairs of heads between groups while that helps. Groups
    come out sorted by their smallest head, heads sorted within a group: deterministic.
    """
    n = similarity.shape[0]
    if n % groups:
        raise ValueError(f"{n} heads do not split into {groups} equal groups")
    size = n // groups
    s = similarity.double().clone()
    s.fill_diagonal_(0)
    free = set(range(n))
    parts: list[list[int]] = []
    for _ in range(groups):
        seed = max(sorted(free), key=lambda h: sum(s[h, o].item() for o in free if o != h))
        part = [seed]
        free.discard(seed)
        while len(part) < size:
            best = max(sorted(free), key=lambda h: sum(s[h, m].item() for m in part))
            part.append(best)
            free.discard(best)
        parts.append(part)

    def gain(a: int, b: int, pa: list[int], pb: list[int]) -> float:  # swap a (in pa) with b (in pb)
        return (sum(s[b, m].item() for m in pa if m != a) + sum(s[a, m].item() for m in pb if m != b)
                - sum(s[a, m].item() for m in pa if m != a) - sum(s[b, m].item() for m in pb if m != b))
    improved = True
    while improved:
        improved = False
        for x, y in itertools.combinations(range(groups), 2):
            for a, b in itertools.product(list(parts[x]), list(parts[y])):
                if gain(a, b, parts[x], parts[y]) > 1e-12:
                    parts[x][parts[x].index(a)], parts[y][parts[y].index(b)] = b, a
                    improved = True
    return sorted(sorted(p) for p in parts)


def group_permutation(similarity: torch.Tensor, groups: int) -> list[int]:
    """The head order that makes the groups of `equal_groups` contiguous: new position -> old head."""
    return [h for part in equal_groups(similarity, groups) for h in part]
