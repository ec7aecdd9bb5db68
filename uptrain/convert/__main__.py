"""`python -m uptrain.convert CKPT --kv-heads N --out DIR`: MHA (or GQA) -> GQA with fewer K/V heads.

The command-line face of uptrain.convert.pipeline: parse, print the plan, write (or not).

Importing torch and transformers takes seconds, as long as copying gigabytes. So for a local
safetensors checkpoint pooled the paper's way (the common case), the tensors that pass through
unchanged are listed from the headers and their copy starts at once, while a worker thread
imports, plans (the plan is printed when ready) and builds the pooled tensors. Everything the
copy needs is standard library; the plan must then confirm every tensor copied, or the copy is
discarded and the plan written as usual.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import sys
import threading
import traceback
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import Any

from uptrain.cli import ArgParser, positive_int, prog_name
from uptrain.convert.registry.choices import GROUPINGS, METHODS, REFINE_INPUTS
from uptrain.convert.io.passthrough import Phases, StoredRange, copy_beside, kept_by_pooling
from uptrain.convert.io.output_dir import atomic_output_dir, check_output_path
from uptrain.convert.io.shards import ShardWriter
from uptrain.data.source import TEXT_UNITS, DataSource  # standard library only, like the imports above
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.units import DTYPE_NAMES, parse_size


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
                   help="text (.txt cut by --calib-text-unit, .jsonl/.json/.parquet 'text'; read as the trainer "
                        "and eval read it) whose attention-input statistics weight --method fit / --grouping "
                        "similar; runs the model one layer at a time")
    p.add_argument("--calib-text-unit", choices=list(TEXT_UNITS), default=DataSource.text_unit,
                   help="what one document of a .txt --calib file is: a paragraph (documents separated by a "
                        "blank line; default, as the trainer's data.*.text_unit), a line or the whole file")
    p.add_argument("--calib-tokens", type=int, default=32768, help="tokens of --calib to run (default 32768)")
    p.add_argument("--refine", action="store_true",
                   help="after the closed-form start (fit, or mean where fit refuses the family), tune each layer's "
                        "attention weights with Adam so its output matches the original layer's on --calib text")
    p.add_argument("--refine-steps", type=int, default=1200,
                   help="most Adam steps per layer (default 1200; a held-out slice of --calib stops earlier)")
    p.add_argument("--refine-lr", type=float, default=1e-2,
                   help="Adam learning rate relative to each weight's RMS (default 1e-2)")
    p.add_argument("--refine-inputs", choices=REFINE_INPUTS, default="original",
                   help="each layer learns on the original model's activations (default; measured as good, "
                        "results/refine.md) or on the converted model's own (one more activation copy)")
    p.add_argument("--device", default="cpu", help="torch device of the calibration pass (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of --method random")
    p.add_argument("--revision", help="Hub branch, tag or commit")
    p.add_argument("--dtype", choices=sorted(DTYPE_NAMES), help="output dtype (default: keep the source's)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing (a Hub id: reads only config and safetensors headers)")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="torch CPU threads for building and calibration (default: the cores the load average "
                        "leaves free, at least 1; OMP_NUM_THREADS is honoured)")
    p.add_argument("--verbose", action="store_true", help="print the time of each phase (also in the record)")
    return p


def _copy_while_planning(args: argparse.Namespace) -> list[StoredRange] | None:
    """The tensors to copy while planning, when the headers alone can tell (see the module doc)."""
    folder = Path(args.checkpoint).expanduser()
    if (args.dry_run or args.method == "fit" or args.grouping != "contiguous" or args.dtype or args.calib
            or not folder.is_dir() or not (folder / "config.json").is_file()):
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return kept_by_pooling(folder.resolve(), config) if isinstance(config, dict) else None


def _prepare_args(args: argparse.Namespace, calibration: Any = None) -> dict[str, Any]:
    from uptrain.units import DTYPES

    refine = None
    if args.refine:
        from uptrain.convert.layers.refine_layer import RefineSettings

        refine = RefineSettings(args.refine_steps, args.refine_lr, args.refine_inputs,
                                log=lambda line: print(line, flush=True))
    return dict(checkpoint=args.checkpoint, kv_heads=args.kv_heads, method=args.method, seed=args.seed,
                revision=args.revision, dtype=DTYPES.get(args.dtype), grouping=args.grouping,
                calibration=calibration, headers_only=args.dry_run, refine=refine)


def _convert_while_planning(args: argparse.Namespace, kept: list[StoredRange], max_shard: int,
                            phases: Phases) -> Any:
    """Copy `kept` into the output while a worker imports torch and transformers, plans, prints
    the plan and builds the rest; returns the plan."""
    check_output_path(args.out, Path(args.checkpoint).expanduser(), args.force)
    with atomic_output_dir(args.out) as tmp:
        writer = ShardWriter(tmp, kept, max_shard, stem="kept")

        def job(cancel: threading.Event) -> Any:
            with phases("import"):
                from uptrain.convert import pipeline
                from uptrain.convert.plan import format_plan
                from uptrain.threads import announce_threads, start_threads
            start_threads(args.threads)

            def show(plan: Any) -> None:
                print(format_plan(plan), flush=True)
                announce_threads(stdout=True)  # beside the plan

            return pipeline.plan_and_build(tmp, kept, max_shard, phases, cancel, show, **_prepare_args(args))

        planned = copy_beside(kept, writer, phases, job)
        from uptrain.convert import pipeline

        if planned.built is None:  # the plan keeps fewer tensors than the headers suggested
            writer.discard()
            pipeline.finish_folder(tmp, planned, pipeline.write_tensors(tmp, planned, max_shard, phases), phases)
        else:
            pipeline.finish_folder(tmp, planned, [writer, planned.built], phases, copied_while_planning=True)
    return planned.plan


def report_internal_errors(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Turn an unexpected exception (a bug of ours, not bad input) into one stderr line and exit 1.

    The output folder is already as it was (`atomic_output_dir` removed the temporary one). The
    traceback is printed only with --verbose or UPTRAIN_DEBUG=1: a user first needs to know that
    the fault is ours and that the output is untouched. Bad input (UsageError) passes through to
    `exit_on_usage_error` (exit 2).
    """

    @wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        try:
            return main(argv)
        except UsageError:
            raise
        except KeyboardInterrupt:
            print("uptrain.convert: interrupted; the output folder is as it was", file=sys.stderr)
            return 130
        except Exception as err:  # noqa: BLE001 - the last stop before a traceback
            if os.environ.get("UPTRAIN_DEBUG") or "--verbose" in (sys.argv[1:] if argv is None else argv):
                traceback.print_exc()
            what = " ".join(str(err).split()) or "(no message)"
            if isinstance(err, OSError):  # the system refused something: not necessarily our bug
                print(f"uptrain.convert: {type(err).__name__}: {what}; the output folder is as it was",
                      file=sys.stderr)
            else:
                print(f"uptrain.convert: internal error: {type(err).__name__}: {what}; the output folder is "
                      f"as it was; please report it (rerun with --verbose or UPTRAIN_DEBUG=1 for the traceback)",
                      file=sys.stderr)
            return 1

    return wrapper


@exit_on_usage_error
@report_internal_errors
def main(argv: list[str] | None = None) -> int:
    phases = Phases()
    args = build_parser().parse_args(argv)
    if not args.dry_run and args.out is None:
        raise UsageError("--out is required (or pass --dry-run to only print the plan)")
    max_shard = parse_size(args.max_shard_size)
    if args.calib_tokens <= 0:
        raise UsageError(f"--calib-tokens must be positive, got {args.calib_tokens}")
    if args.refine and not args.calib:
        raise UsageError("--refine needs --calib FILE (the text whose attention outputs the converted layers "
                         "are tuned to match)")
    try:
        kept = _copy_while_planning(args)
        if kept is not None:
            plan = _convert_while_planning(args, kept, max_shard, phases)
        else:
            plan = _plan_then_convert(args, max_shard, phases)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise UsageError(f"cannot write {args.out}: {err.strerror}; free space and run again "
                             f"(nothing was left behind)") from err
        raise
    if plan is None:
        print("dry run: nothing written")
        return 0
    if plan.calibration and "seconds" in plan.calibration:
        c = plan.calibration
        print(f"calibration: {c['tokens_used']:,} tokens ({c['documents']} documents) in {c['seconds']} s")
    if plan.refinement and plan.refinement.get("layers"):
        done = plan.refinement["layers"]
        print("refined: " + ", ".join(f"{x['error_before']:.3f}->{x['error_after']:.3f}" for x in done)
              + f" held-out error per layer ({sum(x['steps_run'] for x in done)} steps, "
                f"{sum(x['seconds'] for x in done):.1f} s)")
    print(f"wrote {args.out}")
    if args.verbose:
        from uptrain.convert.plan import format_timing

        print(f"time: {format_timing(plan)}")
    return 0


def _plan_then_convert(args: argparse.Namespace, max_shard: int, phases: Phases) -> Any:
    """Plan (imports first), print the plan, then write both streams; None for a dry run."""
    with phases("import"):
        from uptrain.convert.layers.calibrate import Calibration
        from uptrain.convert.pipeline import prepare, write_converted
        from uptrain.convert.plan import format_plan
        from uptrain.threads import announce_threads, start_threads
    start_threads(args.threads)  # torch is imported now; calibration and building run with these
    calibration = (Calibration(args.calib, args.calib_tokens, args.device, args.calib_text_unit)
                   if args.calib else None)
    source, plan, outputs, new_config = prepare(**_prepare_args(args, calibration))
    if not args.dry_run:
        check_output_path(args.out, source.path, args.force)  # refuse before the plan is printed
    print(format_plan(plan), flush=True)
    if args.dry_run:
        return None
    announce_threads(stdout=True)  # beside the plan (a dry run builds nothing: no line)
    write_converted(source, plan, outputs, new_config, args.out, max_shard, phases)
    return plan


if __name__ == "__main__":
    sys.exit(main())
