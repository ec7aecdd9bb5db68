"""Measure the uptraining peak learning rate of a converted model: short runs, lowest validation loss.

    python scripts/lr_sweep.py CONFIG [key=value ...] [--lrs 1e-5 3e-5 1e-4 3e-4] [--tokens N] [--out DIR]

For a model whose pre-training peak you do not know (the recipe study, results/recipe-study.md,
found 1/3 of it best; a model card or paper often gives it). Each learning rate trains the
config's model for the same short budget (`--tokens`, default a tenth of the config's budget),
with the config's schedule, from the same start and seed, into OUT/lr<LR>; the config must have
validation data (`data.val`, or the held-out `data.val_fraction`). It prints the final validation loss of each
and the best, as the `optim.lr=` to use for the full run; a best at either end of the grid is
flagged, since the true best may lie beyond it. Under `accelerate launch` every run uses the
launch's processes. Relative paths in key=value overrides are relative to the current folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's uptrain

from uptrain.cli import format_table  # noqa: E402
from uptrain.errors import UsageError, exit_on_usage_error  # noqa: E402

DEFAULT_LRS = (1e-5, 3e-5, 1e-4, 3e-4)
# Rates whose final validation loss is within this fraction of the lowest are a tie: a short run's
# loss moves more than that with the data order alone (e.g. 7e-6 nats is no difference at all).
TIE = 0.002


def tied(losses: dict[float, float], best: float, tie: float = TIE) -> list[float]:
    """The rates (smallest first) whose finite loss is within `tie` (a fraction) of `best`'s: more
    than one is a tie that this sweep cannot break."""
    bound = losses[best] * (1 + tie) if losses[best] >= 0 else losses[best] * (1 - tie)
    return sorted(lr for lr, loss in losses.items() if loss == loss and loss <= bound)


def best_lr(losses: dict[float, float]) -> tuple[float, bool]:
    """(the learning rate of the lowest loss, whether it lies at an end of the swept range).

    NaN losses (a diverged run) never win; ties go to the smaller learning rate.
    """
    finite = {lr: loss for lr, loss in losses.items() if loss == loss}
    if not finite:
        raise UsageError("every run of the sweep diverged (NaN loss); sweep smaller learning rates")
    best = min(sorted(finite), key=lambda lr: finite[lr])
    return best, len(losses) > 1 and best in (min(losses), max(losses))


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/lr_sweep.py", description=__doc__.splitlines()[0])
    p.add_argument("config", type=Path, help="the run config of the full uptraining run")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides, as for uptrain.train")
    p.add_argument("--lrs", type=float, nargs="+", default=list(DEFAULT_LRS), help="peak learning rates to try")
    p.add_argument("--tokens", type=int, help="tokens per run (default: a tenth of the config's budget)")
    p.add_argument("--out", type=Path, default=Path("runs/lr-sweep"), help="one run folder per rate in here")
    args = p.parse_args(argv)
    from uptrain.train import train
    from uptrain.train.config import load_config

    if any(lr <= 0 for lr in args.lrs) or len(set(args.lrs)) != len(args.lrs):
        raise UsageError(f"--lrs must be distinct positive numbers, got {args.lrs}")
    full = load_config(args.config, args.overrides)  # checks the config once, before any run
    tokens = args.tokens or max(1, full.budget.total_tokens() // 10)
    losses = {}
    for lr in sorted(args.lrs):
        run_dir = args.out / f"lr{lr:g}"
        print(f"== peak lr {lr:g}, {tokens:,} tokens, into {run_dir}", flush=True)
        config = load_config(args.config, [*args.overrides, f"optim.lr={lr}", f"budget.tokens={tokens}",
                                           "budget.fraction=null", f"run_dir={run_dir}", "overwrite=true",
                                           "resume=null"])
        losses[lr] = train(config)["val_loss"]
    best, at_edge = best_lr(losses)
    print("\n" + format_table(["peak lr", "val loss"], [[f"{lr:g}", f"{loss:.4f}"] for lr, loss in losses.items()]))
    edge = f" (at the end of the range: also try {'smaller' if best == min(losses) else 'larger'} rates)" \
        if at_edge else ""
    close = tied(losses, best)
    if len(close) > 1:
        print(f"\ntie: optim.lr={', '.join(f'{lr:g}' for lr in close)} end within {TIE:.1%} of each other's loss, "
              f"closer than this sweep can tell apart; the smaller, optim.lr={close[0]:g}, is the safer pick "
              f"(sweep longer, --tokens, to separate them){edge if close[0] == best else ''}")
    else:
        print(f"\nbest: optim.lr={best:g}{edge}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
