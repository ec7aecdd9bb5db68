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

import torch

from uptrain.convert.math.fit import sigma_factor


def head_similarity(wk: torch.Tensor, wv: torch.Tensor, sigma: torch.Tensor, aligned: bool,
                    planes: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """[H, H] similarity of heads (key part + value part, each at most 1).

    wk, wv: [H, hd, D] key and value rows per head (augmented like `sigma`).
    aligned: similarity up to the transforms `fit` allows; else plain cosine.
    """
    root = sigma_factor(sigma)  # any L with L Lᵀ = Σ gives the same similarities; cached for the fit
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


def _symmetric(similarity: torch.Tensor) -> torch.Tensor:
    """[H, H] float64 (S + Sᵀ)/2 with a zero diagonal: the pair weights the objective sums."""
    s = similarity.double()
    s = (s + s.T) / 2
    return s.fill_diagonal_(0)


def greedy_groups(similarity: torch.Tensor, groups: int) -> list[list[int]]:
    """The search's start: seed each group with the unassigned head most alike to the other
    unassigned heads, then add the head most alike to the group so far (ties: the lowest head).

    similarity: [H, H]; H must be a multiple of `groups`. Returns `groups` lists of H/groups heads
    in the order they were chosen.
    """
    n = similarity.shape[0]
    if n % groups:
        raise ValueError(f"{n} heads do not split into {groups} equal groups")
    size = n // groups
    s = _symmetric(similarity)
    free = torch.ones(n, dtype=torch.bool)
    parts: list[list[int]] = []
    for _ in range(groups):
        # argmax returns the first maximum: ties go to the lowest head, as documented
        seed = int(torch.where(free, s[:, free].sum(1), -torch.inf).argmax())
        part = [seed]
        free[seed] = False
        pull = s[seed].clone()  # [H]: each head's similarity to the group so far
        while len(part) < size:
            best = int(torch.where(free, pull, -torch.inf).argmax())
            part.append(best)
            free[best] = False
            pull += s[best]
        parts.append(part)
    return parts


def equal_groups(similarity: torch.Tensor, groups: int) -> list[list[int]]:
    """Split heads into `groups` equal groups with a large total within-group similarity.

    similarity: [H, H] (made symmetric: (S + Sᵀ)/2). Starts from `greedy_groups`, then exchanges
    two heads of different groups while that raises the objective (the sum of (S[a, b] + S[b, a]) / 2
    over pairs a < b sharing a group), always the exchange that
    raises it most (all H² gains computed at once from the current groups, so each step sees the
    groups as they are now). Ends at a partition no single exchange improves, never below the
    greedy start (or after 100·H exchanges, which random 64-head matrices never come near).
    Groups come out sorted by their smallest head, heads sorted within a group: deterministic.
    """
    return _searched(_symmetric(similarity), groups)


def _searched(s: torch.Tensor, groups: int) -> list[list[int]]:
    """`equal_groups` on the symmetric, zero-diagonal `s` [H, H] float64."""
    group = torch.empty(s.shape[0], dtype=torch.long)  # [H]: the group of each head
    for g, part in enumerate(greedy_groups(s, groups)):
        group[part] = g
    return _parts(_exchanged(s, group, groups), groups)


def _exchanged(s: torch.Tensor, group: torch.Tensor, groups: int) -> torch.Tensor:
    """The exchange search of `equal_groups` from `group` ([H], each head's group; changed in place
    and returned): the best exchange of two heads of different groups while one raises the objective
    of the symmetric, zero-diagonal `s` [H, H] float64."""
    n = s.shape[0]
    # Each exchange raises the objective by more than tol, so the loop ends (finitely many
    # partitions); the cap only bounds the time should rounding ever make it cycle.
    tol = 1e-12 * max(1.0, s.abs().max().item())
    for _ in range(100 * n):
        pull = s @ torch.nn.functional.one_hot(group, groups).double()  # [H, groups]: Σ s(h, m), m in group g
        own = pull.gather(1, group[:, None])[:, 0]  # [H]: similarity of each head to its own group
        cross = pull[:, group]  # [H, H]: [a, b] = similarity of a to b's group
        # a (group A) <-> b (group B): a joins B without b, b joins A without a
        gain = cross + cross.T - own[:, None] - own[None, :] - 2 * s
        gain[group[:, None] == group[None, :]] = -torch.inf  # same group: no exchange
        best = int(gain.argmax())
        a, b = divmod(best, n)
        if gain[a, b] <= tol:
            break
        group[a], group[b] = group[b].clone(), group[a].clone()
    return group


def _parts(group: torch.Tensor, groups: int) -> list[list[int]]:
    """[H] group of each head -> the groups' heads, sorted within and by their smallest head."""
    return sorted(torch.nonzero(group == g)[:, 0].tolist() for g in range(groups))


def _score(s: torch.Tensor, parts: list[list[int]]) -> float:
    """The objective of `parts` on the symmetric, zero-diagonal `s`: within-group pairs summed once."""
    return sum(float(s[p][:, p].sum()) for p in (torch.tensor(q) for q in parts)) / 2


def candidate_groups(similarity: torch.Tensor, groups: int, count: int, tries: int = 16) -> list[list[list[int]]]:
    """Up to `count` distinct equal partitions worth measuring (`--grouping similar` with --calib picks
    among them by the output error on the calibration text: the similarity's best is not always the
    partition that converts best, results/grouping-choice.md).

    similarity: [H, H]. The first is `equal_groups`' partition; the others are where the same
    exchange search ends from `tries` random equal partitions (a fixed seed: deterministic), highest
    objective first (ties: the smaller partition in list order), each a partition no single exchange
    improves. Fewer than `count` where the searches end at fewer distinct partitions (one group: one).
    Each partition in `equal_groups`' form (sorted within, groups by their smallest head).
    """
    if count < 1:
        raise ValueError(f"count must be at least 1, got {count}")
    s = _symmetric(similarity)
    first = _searched(s, groups)
    n = s.shape[0]
    gen = torch.Generator().manual_seed(0)
    found: dict[str, list[list[int]]] = {}
    for _ in range(tries if count > 1 else 0):
        group = torch.randperm(n, generator=gen).argsort() // (n // groups)  # [H]: a random equal partition
        parts = _parts(_exchanged(s, group, groups), groups)
        found.setdefault(repr(parts), parts)
    found.pop(repr(first), None)
    others = sorted(found.values(), key=lambda parts: (-_score(s, parts), parts))
    return [first, *others][:count]


def group_permutation(similarity: torch.Tensor, groups: int) -> list[int]:
    """The head order that makes the groups of `equal_groups` contiguous: new position -> old head."""
    return [h for part in equal_groups(similarity, groups) for h in part]
