"""The refinement's output solve at 7B width: its least-squares moments as `solve_output` makes them
(float64 products) against float32 products per sequence summed in float64 (tried, not adopted), one
run, same inputs and seed.

    python scripts/bench/bench_output_solve.py [--width 4096] [--sequences 16] [--length 2048] [--threads 1]

Writes results/output-solve.json (seconds of each, the solved weights' relative difference, and the
held-out relative error of each solution). Float32 products are faster and as good on full-rank
inputs, but below float32 rounding the solve's ridge (1e-9 of the Gram's scale) no longer decides
the weakly spanned directions: on a rank-deficient case (tests/convert/test_refine.py, 64 heads,
180 tokens) the solved projection misses its targets by 5% where float64 products reach them. The inputs are random with a spectrum falling 1000-fold
(a Gram matrix of condition ~1e6, as attention outputs of trained layers have), the targets a linear
map of them plus 1% noise.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch
from torch import nn

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from uptrain.convert.math.output_solve import solve_output  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--sequences", type=int, default=16)
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=REPO / "results" / "output-solve.json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    n = args.width
    spectrum = torch.logspace(0, -3, n)  # singular values of the inputs' mixing
    mix = torch.linalg.qr(torch.randn(n, n, generator=gen))[0] * spectrum
    truth = torch.randn(n, n, generator=gen) / n ** 0.5

    def sequence() -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.randn(args.length, n, generator=gen) @ mix.T
        y = z @ truth.T
        return z, y + 0.01 * y.std() * torch.randn(y.shape, generator=gen)

    train = [sequence() for _ in range(args.sequences)]
    held = [sequence() for _ in range(2)]
    row = {"width": n, "sequences": args.sequences, "length": args.length, "threads": args.threads,
           "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread(s)", "torch": torch.__version__,
           "seed": 0, "command": " ".join(["python scripts/bench/bench_output_solve.py", *sys.argv[1:]])}
    solved = {}
    for name in ("float64", "float32"):
        torch.manual_seed(0)  # the same start (the ridge pulls towards it) for both
        proj = nn.Linear(n, n, bias=False)
        inputs, targets = [z for z, _ in train], [y for _, y in train]
        began = time.perf_counter()  # each runs the projection on every sequence, as the refinement's solve does
        solve_output(proj, lambda i: proj(inputs[i]), targets, range(len(train)), products=getattr(torch, name))
        row[f"{name}_seconds"] = round(time.perf_counter() - began, 2)
        with torch.no_grad():
            err = sum(float((proj(z) - y).pow(2).sum()) for z, y in held) / sum(float(y.pow(2).sum()) for _, y in held)
        row[f"{name}_held_out_relative_error"] = err
        solved[name] = proj.weight.detach().double()
        print(f"{name}: {row[f'{name}_seconds']} s, held-out relative error {err:.6e}", flush=True)
    row["weights_relative_difference"] = float((solved["float32"] - solved["float64"]).norm() / solved["float64"].norm())
    row["speedup"] = round(row["float64_seconds"] / row["float32_seconds"], 2)
    row["adopted"] = "float64 (solve_output): float32 products miss rank-deficient targets (see the doc)"
    print(json.dumps(row, indent=1))
    args.out.write_text(json.dumps(row, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
