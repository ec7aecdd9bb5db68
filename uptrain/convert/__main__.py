"""`python -m uptrain.convert CKPT --kv-heads N --out DIR`: MHA (or GQA) -> GQA with fewer K/V heads.

The command-line face of uptrain.convert.pipeline: parse, print the plan, write (or not).
"""

from __future__ import annotations

import argparse
import errno
import sys
from pathlib import Path

from uptrain.convert.calibrate import Calibration
from uptrain.convert.heads import METHODS
from uptrain.convert.layerwise import GROUPINGS
from uptrain.convert.pipeline import prepare, write_converted
from uptrain.convert.plan import format_plan, format_timing
from uptrain.convert.shards import check_output_path
from uptrain.cli import ArgParser, prog_name
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.units import DTYPES, parse_size


def build_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog=prog_name("uptrain.convert"), description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="local checkpoint folder or Hugging Face Hub model id")
    p.add_argument("--kv-heads", type=int, required=True, help="K/V heads per layer after conversion")
    p.add_argument("--out", type=Path, help="output folder (required unless --dry-run)")
    p.add_argument("--method", choices=METHODS, default="mean",
                   help="mean: the paper's mean pooling (default); first / random: the paper's ablations; "
                        "fit: least-squares K/V fit with compensation in Q and O")
    p.add_argument("--grouping", choices=GROUPINGS, default="contiguous",
                   help="contiguous: heads j*g..(j+1)*g-1 share K/V head j (default); similar: equal groups "
                        "of the most alike heads (q/o permuted to match)")
    p.add_argument("--calib", type=Path, metavar="FILE",
                   help="text (.txt one document per line, .jsonl 'text') whose attention-input statistics "
                        "weight --method fit / --grouping similar; loads the whole model in memory")
    p.add_argument("--calib-tokens", type=int, default=32768, help="tokens of --calib to run (default 32768)")
    p.add_argument("--device", default="cpu", help="torch device of the calibration pass (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of --method random")
    p.add_argument("--revision", help="Hub branch, tag or commit")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: keep the source's)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing (a Hub id: reads only config and safetensors headers)")
    p.add_argument("--verbose", action="store_true", help="print the time of each phase (also in the record)")
    return p


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.dry_run and args.out is None:
        raise UsageError("--out is required (or pass --dry-run to only print the plan)")
    max_shard = parse_size(args.max_shard_size)
    if args.calib_tokens <= 0:
        raise UsageError(f"--calib-tokens must be positive, got {args.calib_tokens}")
    calibration = Calibration(args.calib, args.calib_tokens, args.device) if args.calib else None
    source, plan, outputs, new_config = prepare(args.checkpoint, args.kv_heads, args.method, args.seed,
                                                args.revision, DTYPES.get(args.dtype), grouping=args.grouping,
                                                calibration=calibration, headers_only=args.dry_run)
    if not args.dry_run:
        check_output_path(args.out, source.path, args.force)  # refuse before the plan is printed
    print(format_plan(plan))
    if args.dry_run:
        print("dry run: nothing written")
        return 0
    try:
        write_converted(source, plan, outputs, new_config, args.out, max_shard)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise UsageError(f"cannot write {args.out}: {err.strerror}; free space and run again "
                             f"(nothing was left behind)") from err
        raise
    if plan.calibration and "seconds" in plan.calibration:
        c = plan.calibration
        print(f"calibration: {c['tokens_used']:,} tokens ({c['documents']} documents) in {c['seconds']} s")
    print(f"wrote {args.out}")
    if args.verbose:
        print(f"time: {format_timing(plan)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
