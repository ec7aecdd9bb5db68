"""The refinement's closed-form step: an attention module's output projection fitted by least squares.

Once everything before it is fixed (the softmax weights and the values), an attention module's
output is o_proj(z) = z Wᵀ + b, linear in (W, b): the best W for given targets is a least-squares
problem in the second moments of z. `refine.refine_attention` solves it for the state its Adam
descent kept (results/refine-speed.md: it lowered every measured layer's held-out error a little;
solving during the descent, where Adam's moments no longer match the solved weights, did worse).

`solve_linear` is the tensor math (Gram matrices in, weights out); `output_projection` finds the
projection whose output is the module's output (and says None where the module changes its output
after it); `solve_output` sums the moments over sequences and writes the solution.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

RIDGE = 1e-9  # relative to the mean diagonal of the Gram matrix: for rank deficiency, not a prior


def solve_linear(gram: Tensor, cross: Tensor, current: Tensor, ridge: float = RIDGE) -> Tensor:
    """argmin_W ||Z Wᵀ - Y||² + λ ||W - current||², λ = ridge x mean(diag(gram)).

    gram = ZᵀZ [n, n] and cross = ZᵀY [n, m] (Z [N, n] inputs, Y [N, m] targets, N rows summed),
    current [m, n] -> W [m, n], in gram's dtype. The ridge pulls towards `current`, not towards 0,
    so directions Z never spans keep their value; ridge 0 is the plain least-squares solution where
    the Gram matrix is invertible. Cholesky; lstsq where the matrix is not positive definite.
    """
    n = gram.shape[0]
    lam = ridge * gram.diagonal().mean().clamp_min(torch.finfo(gram.dtype).tiny)
    a = gram + lam * torch.eye(n, dtype=gram.dtype, device=gram.device)
    b = cross + lam * current.T.to(gram.dtype)
    chol, info = torch.linalg.cholesky_ex(a)
    if int(info) == 0:
        return torch.cholesky_solve(b, chol).T
    return torch.linalg.lstsq(a, b).solution.T


def output_projection(module: nn.Module, run: Callable[[], Tensor]) -> nn.Linear | None:
    """The nn.Linear inside `module` whose output IS the module's output: the last one called while
    `run()` runs the module once (returning its output), with equal values. None where the module
    changes its output after its last projection (or has none): then no projection's weights make
    the output linear, and `solve_output` does not apply."""
    seen: list[tuple[nn.Module, Tensor]] = []
    hooks = [m.register_forward_hook(lambda mod, _args, out: seen.append((mod, out)))
             for m in module.modules() if isinstance(m, nn.Linear)]
    try:
        with torch.no_grad():
            y = run()
    finally:
        for h in hooks:
            h.remove()
    if not seen or seen[-1][1].numel() != y.numel():
        return None
    return seen[-1][0] if torch.equal(seen[-1][1].reshape(y.shape), y) else None


@torch.no_grad()
def solve_output(proj: nn.Linear, run: Callable[[int], Tensor], targets: Sequence[Tensor], indices: Sequence[int],
                 ridge: float = RIDGE, products: torch.dtype = torch.float64) -> None:
    """Set `proj` to the least-squares fit of targets[i] [T_i, m] from its own inputs z [T_i, n] (and a 1
    for the bias, where it has one) on the sequences `indices`; run(i) runs the module that holds
    `proj` on sequence i (its output unused: `proj`'s inputs are what it gives). ZᵀZ and ZᵀY are summed
    over the sequences in float64, then `solve_linear` (ridge towards the current weights). products:
    the dtype of each sequence's products (float32 was tried and not adopted: results/output-solve.json)."""
    seen: list[Tensor] = []
    handle = proj.register_forward_pre_hook(lambda _mod, args: seen.append(args[0]))
    gram = cross = None
    try:
        for i in indices:
            run(i)
            z = seen.pop().reshape(-1, proj.in_features).to(products)
            if proj.bias is not None:
                z = torch.cat([z, torch.ones_like(z[:, :1])], 1)
            t = targets[i].reshape(-1, proj.out_features).to(z)
            zz, zt = (z.T @ z).double(), (z.T @ t).double()
            gram = zz if gram is None else gram + zz
            cross = zt if cross is None else cross + zt
    finally:
        handle.remove()
    if gram is None:
        return
    current = proj.weight if proj.bias is None else torch.cat([proj.weight, proj.bias[:, None]], 1)
    w = solve_linear(gram, cross, current.double(), ridge).to(proj.weight.dtype)
    proj.weight.copy_(w[:, : proj.in_features])
    if proj.bias is not None:
        proj.bias.copy_(w[:, -1])
