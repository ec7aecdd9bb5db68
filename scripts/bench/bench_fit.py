"""Time the closed-form fit (`--method fit`) on one attention layer with a real model's shapes.

    OMP_NUM_THREADS=2 python scripts/bench/bench_fit.py [--hidden 4096 --heads 32 --kv-heads 8 --head-dim 128]
        [--no-bias] [--tokens 8192] [--old-groups 1] [--old-ref 8dc0f91]

Random bfloat16 weights (std 0.02) for q/k/v(/biases)/o, taken to float64 the way
`layerwise.transform_layer` does, and Σ = E[x̃ x̃ᵀ] of `--tokens` random correlated activations with
uneven scales plus the constant column (what `--calib` gives: [hidden + 1]² with biases, [hidden]²
without). Then transform_layer's group loop — `fit_keys` and `fit_values` per group, every group
given the layer's Σ tensors — with this tree's fit.py, and `--old-groups` groups of the fit.py at
git ref `--old-ref` (the per-plane implementation; 0 skips it; its layer time is extrapolated from
the groups run). Prints wall and CPU time (user + system, all threads: on a shared machine wall
time mostly measures the other tenants), the process's peak RSS over each part (VmHWM, reset
through /proc/self/clear_refs before it) and, where both ran, the largest relative difference of
their outputs on the groups both fitted (after the new fit's sign/phase convention). Random
weights: the numbers are about time and memory, not quality.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import torch

from uptrain.convert.math.fit import fit_keys, fit_values, rotary_planes

REPO = Path(__file__).resolve().parents[2]


def rss_mib(field: str) -> float:
    """VmRSS or VmHWM of this process, MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux)


def old_fit_module(ref: str) -> types.ModuleType:
    """fit.py as it was at git `ref`, loaded as a module."""
    text = subprocess.run(["git", "-C", str(REPO), "show", f"{ref}:uptrain/convert/math/fit.py"],
                          check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("old_fit")
    exec(compile(text, f"{ref}:uptrain/convert/math/fit.py", "exec"), module.__dict__)
    return module


def layer(hidden: int, heads: int, hd: int, bias: bool, tokens: int, gen: torch.Generator):
    """(wq, wk, wv [heads, hd, D], wo [heads, hidden, hd], Σ [D, D]) float64, D = hidden (+ 1)."""
    def proj(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * 0.02).bfloat16().double()
    qkv = []
    for _ in "qkv":
        w = proj(heads * hd, hidden)
        if bias:
            w = torch.cat([w, proj(heads * hd, 1) * 10], 1)
        qkv.append(w.view(heads, hd, -1))
    wo = proj(hidden, heads * hd).view(hidden, heads, hd).permute(1, 0, 2)
    scales = (torch.randn(hidden, generator=gen) * 0.7).exp()
    mix = torch.randn(hidden, hidden, generator=gen) / hidden ** 0.5
    x = (torch.randn(tokens, hidden, generator=gen) @ mix) * scales
    x = torch.cat([x.double(), torch.ones(tokens, 1, dtype=torch.float64)], 1)
    full = x.T @ x / tokens
    sigma = full if bias else full[:hidden, :hidden].clone()
    return (*qkv, wo, sigma)


def run_groups(keys_fn, values_fn, wq, wk, wv, wo, sigma, groups: int, new_kv: int, planes):
    """transform_layer's loop over the first `groups` of `new_kv` groups: (outputs, wall seconds per
    group, CPU seconds per group: this process's user + system time, all threads)."""
    g = len(wq) // new_kv
    out, walls, cpus = [], [], []
    for s in range(groups):
        grp = slice(s * g, (s + 1) * g)
        wall, cpu = time.perf_counter(), time.process_time()
        k1, q1 = keys_fn(wk[grp], wq[grp], sigma, sigma, planes)
        v1, o1 = values_fn(wv[grp], wo[grp], sigma)
        walls.append(time.perf_counter() - wall)
        cpus.append(time.process_time() - cpu)
        out.append((k1, q1, v1, o1))
    return out, walls, cpus


def seconds(values: list[float]) -> str:
    return ", ".join(f"{t:.1f}" for t in values)


def canonical(k1, q1, v1, o1, planes):
    """The per-plane fit's outputs in the batched fit's sign/phase convention (see the tests)."""
    first, second = planes
    key = torch.complex(k1[first], k1[second])
    phase = key.gather(1, key.abs().argmax(1, keepdim=True))
    phase = (phase / phase.abs()).conj()
    key, q = key * phase, torch.complex(q1[:, first], q1[:, second]) * phase
    k1, q1 = k1.clone(), q1.clone()
    k1[first], k1[second], q1[:, first], q1[:, second] = key.real, key.imag, q.real, q.imag
    sign = v1.gather(1, v1.abs().argmax(1, keepdim=True)).sign()
    return k1, q1, v1 * sign, o1 * sign.T


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-bias", action="store_true", help="Llama-like: no q/k/v biases, Σ without the constant")
    ap.add_argument("--tokens", type=int, default=8192, help="activations behind Σ")
    ap.add_argument("--old-groups", type=int, default=1, help="groups to run with the old fit (0: none)")
    ap.add_argument("--old-ref", default="8dc0f91", help="git ref of the old fit.py")
    args = ap.parse_args(argv)
    bias = not args.no_bias
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS')}, load average {os.getloadavg()}", flush=True)
    start = time.perf_counter()
    wq, wk, wv, wo, sigma = layer(args.hidden, args.heads, args.head_dim, bias, args.tokens, gen)
    planes = rotary_planes(args.head_dim, False)
    print(f"inputs: Σ {tuple(sigma.shape)}, wq/wk/wv {tuple(wq.shape)}, wo {tuple(wo.shape)} "
          f"({time.perf_counter() - start:.1f} s), RSS {rss_mib('VmRSS'):.0f} MiB", flush=True)
    reset_peak()
    new, walls, cpus = run_groups(fit_keys, fit_values, wq, wk, wv, wo, sigma, args.kv_heads, args.kv_heads, planes)
    print(f"new fit: layer {sum(walls):.1f} s wall, {sum(cpus):.1f} s CPU (per group, wall: {seconds(walls)}; "
          f"CPU: {seconds(cpus)}; the first includes Σ's Cholesky), peak RSS {rss_mib('VmHWM'):.0f} MiB, "
          f"load average {os.getloadavg()}", flush=True)
    if args.old_groups:
        old = old_fit_module(args.old_ref)
        reset_peak()
        got, walls, cpus = run_groups(old.fit_keys, old.fit_values, wq, wk, wv, wo, sigma, args.old_groups,
                                      args.kv_heads, planes)
        scale = args.kv_heads / len(walls)
        print(f"old fit ({args.old_ref}): per group, wall: {seconds(walls)} s, CPU: {seconds(cpus)} s; layer "
              f"{sum(walls) * scale:.0f} s wall, {sum(cpus) * scale:.0f} s CPU extrapolated ({args.kv_heads} groups), "
              f"peak RSS {rss_mib('VmHWM'):.0f} MiB, load average {os.getloadavg()}", flush=True)
        worst = 0.0
        for a_all, b_all in zip(new, got):
            for name, a, b in zip("kqvo", a_all, canonical(*b_all, planes)):
                rel = ((a - b).abs().max() / b.abs().max()).item()
                worst = max(worst, rel)
                print(f"  {name}: max |new - old| / max |old| = {rel:.1e}")
        print(f"largest relative difference {worst:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
