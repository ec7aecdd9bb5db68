"""`python -m uptrain.convert CKPT --kv-heads N --out DIR`: MHA (or GQA) -> GQA with fewer K/V heads.

The command-line face of uptrain.convert.pipeline: parse, print the plan, write (or not).

Importing torch and transformers takes seconds, as long as copying gigabytes. So for a local
safetensors checkpoint pooled the paper's way (the common case), the tensors that pass through
unchanged are listed from the headers and their copy starts at once, while a worker thread
imports, plans (the plan is printed when ready) and builds the pooled tensors. Everything the
copy needs is standard library; the plan must then confirm every tensor copied, or the copy is
discarded and the plan written as usual. For the same reason what needs no model is refused
before those imports (`early`).

Ctrl-C and SIGTERM (`at_once`), first or second, at any point, end the run at once with one
line, exit 130 (SIGINT) or 143 (SIGTERM, 128 + 15 as a shell reports it), the output folder as
it was and no temporary folder beside it (only while the finished folder is put in place is the
signal reported after it, the new folder complete). Converting to
the checkpoint's own K/V head count is refused (exit 2): nothing would change, --dtype included
(this tool changes K/V heads; the checkpoint can be loaded in any dtype as it is).
"""

from __future__ import annotations

from uptrain.stopping import is_command

if is_command(__name__, "uptrain-convert"):  # first act: a signal during the imports below ends the run cleanly too
    from uptrain.stopping import at_once

    at_once.install()

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
from uptrain.stopping import at_once
from uptrain.convert.io.early import check_before_imports
from uptrain.convert.options import add_conversion_args, conversion_options
from uptrain.convert.io.passthrough import Phases, StoredRange, copy_beside, kept_by_pooling
from uptrain.convert.io.output_dir import atomic_output_dir, check_output_path
from uptrain.convert.progress import print_line
from uptrain.convert.io.shards import ShardWriter
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.units import DTYPE_NAMES, parse_size


def build_parser() -> argparse.ArgumentParser:
    p = ArgParser(prog=prog_name("uptrain.convert"), description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="local checkpoint folder or Hugging Face Hub model id")
    p.add_argument("--kv-heads", type=int, required=True, help="K/V heads per layer after conversion")
    p.add_argument("--out", type=Path, help="output folder (required unless --dry-run)")
    add_conversion_args(p)  # the same options as the sweep's, one rule for what they mean (convert/options.py)
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

    # refine's per-layer line is printed by `progress`, with the layers done and the time left
    refine = conversion_options(args).refine_settings()
    return dict(checkpoint=args.checkpoint, kv_heads=args.kv_heads, method=args.method, seed=args.seed,
                revision=args.revision, dtype=DTYPES.get(args.dtype), grouping=args.grouping,
                calibration=calibration, headers_only=args.dry_run, refine=refine, allow_same=False,
                progress=None if args.dry_run else print_line, out=args.out,
                group_candidates=conversion_options(args).candidates)


def _convert_while_planning(args: argparse.Namespace, kept: list[StoredRange], max_shard: int,
                            phases: Phases) -> Any:
    """Copy `kept` into the output while a worker imports torch and transformers, plans, prints
    the plan and builds the rest; returns the plan."""
    check_output_path(args.out, Path(args.checkpoint).expanduser(), args.force)
    with atomic_output_dir(args.out, replace=args.force) as tmp:
        writer = ShardWriter(tmp, kept, max_shard, stem="kept")

        def job(cancel: threading.Event) -> Any:
            at_once.pause("import")
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
        except KeyboardInterrupt:  # as a function (the CLI's own signals end it in `at_once`)
            print(at_once.message(), file=sys.stderr, flush=True)
            return at_once.exit_code()
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


def main(argv: list[str] | None = None) -> int:
    """The command (`argv` None: this process's arguments, with the signal handling of `at_once`
    and its exit; a list: as a function, for tests, the process's handlers left alone)."""
    if argv is not None:
        return _main(argv)
    at_once.install()
    at_once.finish(_main(None))
    return 0  # not reached


@exit_on_usage_error
@report_internal_errors
def _main(argv: list[str] | None = None) -> int:
    phases = Phases()
    args = build_parser().parse_args(argv)
    if not args.dry_run and args.out is None:
        raise UsageError("--out is required (or pass --dry-run to only print the plan)")
    max_shard = parse_size(args.max_shard_size)
    conversion_options(args).check()  # what no conversion can run, as the sweep refuses it
    check_before_imports(args)
    try:
        kept = _copy_while_planning(args)
        if kept is not None:
            plan = _convert_while_planning(args, kept, max_shard, phases)
        else:
            plan = _plan_then_convert(args, max_shard, phases)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            left = at_once.left_behind()  # finished layers kept for a rerun: they take space too
            raise UsageError(f"cannot write {args.out}: {err.strerror}; free space and run again "
                             + (f"({left}; delete that folder to free its space)" if left
                                else "(nothing was left behind)")) from err
        raise
    except UsageError as err:  # refused after layers were kept (the --out that appeared meanwhile): name them
        left = at_once.left_behind()
        if left:
            raise UsageError(f"{err}. Kept: {left} once what is refused is mended (delete that folder to free its "
                             "space)") from err
        raise
    if plan is None:
        print("dry run: nothing written")
        return 0
    if plan.calibration and "seconds" in plan.calibration:
        c = plan.calibration
        print(f"calibration: {c['tokens_used']:,} tokens ({c['documents']} documents) in {c['seconds']} s"
              + (f"; the source's loss on it {c['source_loss']:.3f} nats/token" if "source_loss" in c else ""))
        if c.get("near_chance"):
            print(f"warning: {c['near_chance']}", file=sys.stderr)
        from uptrain.convert.layers.calibrate import shortfall_warning

        if shortfall_warning(c):
            print(shortfall_warning(c), file=sys.stderr)
    if plan.refinement and plan.refinement.get("layers"):
        done = plan.refinement["layers"]
        print("refined: " + ", ".join(f"{x['error_before']:.3f}->{x['error_after']:.3f}" for x in done)
              + f" held-out error per layer ({sum(x['steps_run'] for x in done)} steps, "
                f"{sum(x['seconds'] for x in done):.1f} s)")
    print(f"wrote {args.out}")
    note = conversion_options(args).start_note()
    if note:
        print(f"note: {args.out} is a {note}")
    if at_once.pending():  # it came while the folder was put in place: the point of no return
        print(at_once.message(), file=sys.stderr, flush=True)
        return at_once.exit_code()
    if args.verbose:
        from uptrain.convert.plan import format_timing

        print(f"time: {format_timing(plan)}")
    return 0


def _plan_then_convert(args: argparse.Namespace, max_shard: int, phases: Phases) -> Any:
    """Plan (imports first), print the plan, then write both streams; None for a dry run."""
    at_once.pause("import")
    with phases("import"):
        from uptrain.convert.pipeline import prepare, write_converted
        from uptrain.convert.plan import format_plan
        from uptrain.threads import announce_threads, start_threads
    start_threads(args.threads)  # torch is imported now; calibration and building run with these
    calibration = conversion_options(args).calibration()  # None where the conversion reads no text
    source, plan, outputs, new_config = prepare(**_prepare_args(args, calibration))
    if not args.dry_run:
        check_output_path(args.out, source.path, args.force)  # refuse before the plan is printed
    print(format_plan(plan), flush=True)
    if args.dry_run:
        return None
    announce_threads(stdout=True)  # beside the plan (a dry run builds nothing: no line)
    write_converted(source, plan, outputs, new_config, args.out, max_shard, phases, replace=args.force)
    return plan


if __name__ == "__main__":
    main()
