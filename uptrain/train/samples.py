"""`python -m uptrain.train.samples MODEL --tokens N --out FILE`: the model's own text, for a user without any.

The no-data quality path (docs/own-model.md): sample N tokens of documents from the (MHA) model
into FILE (.jsonl, one {"text": ...} per document), then convert with `--calib FILE` and uptrain on
FILE (`data.train.files`), distilling from the same model. The sampler is the trainer's
(`uptrain.train.model.teacher_samples.teacher_text_file`, the settings of `uptrain.data.TeacherSamples`):
seeded per batch, from the BOS token or from `--prompts` lines, a progress line every ~10 s (tokens
so far, tokens/s, the time left), documents capped at the model's context.

FILE is written whole (a temporary file renamed into place). The batches are kept beside it as
they are made (`.FILE.batches/`, under a key of the model's files, the tokenizer, the settings and
the code): a stop (Ctrl-C, SIGTERM) ends the command at once with one line naming the kept
batches, exit 130 / 143 (`uptrain.stopping.at_once`), and the same command continues from them,
to the file an uninterrupted run writes. Bad input (a missing model folder, --tokens not positive,
an --out that exists without --force or cannot be written, ...) is one line, exit 2, before the
model loads.
"""

from __future__ import annotations

from uptrain.stopping import is_command

PROGRAM = "uptrain.train.samples"
if is_command(__name__, "uptrain-samples"):  # first act: a stop during the imports below ends it in one line too
    from uptrain.stopping import at_once as _at_once

    _at_once.install(PROGRAM, "nothing was written yet")

import argparse
from pathlib import Path

from uptrain.cli import ArgParser, positive_int, prog_name
from uptrain.data import TeacherSamples
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.stopping import at_once
from uptrain.threads import add_threads_arg

DEFAULTS = TeacherSamples()


def _parser() -> ArgParser:
    p = ArgParser(prog=prog_name(PROGRAM), description=__doc__.splitlines()[0])
    p.add_argument("model", help="the model that writes the text (the MHA model you convert): a local folder or a "
                   "Hub id")
    p.add_argument("--tokens", type=positive_int, required=True,
                   help="new tokens to sample in all (at least the uptraining's budget, or it repeats them)")
    p.add_argument("--out", type=Path, required=True,
                   help="the .jsonl file to write (one {\"text\": ...} per document)")
    p.add_argument("--prompts", type=Path, default=None,
                   help="a .txt file, one short prompt per line, each document starting from one (default: the "
                        "BOS token)")
    p.add_argument("--seed", type=int, default=DEFAULTS.seed,
                   help="the sampling seed (each batch seeded by it and its index)")
    p.add_argument("--temperature", type=float, default=DEFAULTS.temperature,
                   help="sampling temperature (1: the model's own distribution; the default 1.2, a little wider, "
                        "trained and calibrated better on the bundled model: results/quality-curve.md)")
    p.add_argument("--top-p", type=float, default=DEFAULTS.top_p,
                   help="nucleus sampling (1: the model's whole distribution, measured best: results/quality-curve.md)")
    p.add_argument("--max-new-tokens", type=positive_int, default=DEFAULTS.max_new_tokens,
                   help="longest document in new tokens (capped at the model's max_position_embeddings)")
    p.add_argument("--batch", type=int, default=DEFAULTS.batch,
                   help="sequences sampled together (0: as many as a 1 GiB KV cache holds, at most 1024)")
    p.add_argument("--device", default="cpu", help="torch device to sample on (cpu, cuda, cuda:1)")
    p.add_argument("--force", action="store_true", help="replace an existing --out")
    add_threads_arg(p, "sampling")
    return p


def batches_folder(out: Path) -> Path:
    """Where the batches of a generation into `out` are kept until `out` is written: `.NAME.batches` beside it."""
    return out.parent / f".{out.name}.batches"


def kept_batches(partial: Path) -> str:
    """What a stop now keeps, for its one line ('' for nothing yet)."""
    chunks = sorted((partial / "chunks").glob("chunk-*.json")) if (partial / "chunks").is_dir() else []
    return (f"{len(chunks)} sample batch{'es' * (len(chunks) != 1)} kept in {partial}; the same command continues "
            "from them") if chunks else ""


def _check_model(name: str) -> Path | None:
    """The local model folder (None: a Hub id, resolved later); UsageError for a folder that is missing or no model."""
    from uptrain.convert.io.early import local_folder

    return local_folder(name, "model")


def check_args(args: argparse.Namespace) -> tuple[Path | None, TeacherSamples]:
    """Every refusal that needs no model, in one line each (nothing written): (local model folder or None
    for a Hub id, the sampling settings)."""
    from uptrain.convert.io.output_dir import check_apart, check_writable

    model = _check_model(args.model)
    out: Path = args.out
    if out.suffix != ".jsonl":
        raise UsageError(f"--out {out}: the samples are written as JSON lines ({{\"text\": ...}} per document); "
                         f"name the file .jsonl, e.g. {out.with_suffix('.jsonl')}")
    if out.is_dir():
        raise UsageError(f"--out {out} is a folder; pass the .jsonl file to write")
    if out.exists() and not args.force:
        raise UsageError(f"--out {out} exists; choose another file, or pass --force to replace it")
    if model is not None:  # written inside the model folder, the samples would change the model they are keyed by
        check_apart(out, model, "--out")
    check_writable(out, "--out")
    if args.temperature <= 0:
        raise UsageError(f"--temperature must be above 0, got {args.temperature}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.batch < 0:
        raise UsageError(f"--batch must be at least 0 (0: auto), got {args.batch}")
    if args.prompts is not None:
        if not args.prompts.is_file():
            raise UsageError(f"--prompts file {args.prompts} does not exist; pass a .txt file, one prompt per line")
        try:
            if not args.prompts.read_text(encoding="utf-8").strip():
                raise UsageError(f"--prompts file {args.prompts} has no prompt (no non-empty line)")
        except UnicodeDecodeError:
            raise UsageError(f"--prompts file {args.prompts} is not UTF-8 text") from None
    ts = TeacherSamples(tokens=args.tokens, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                        top_p=args.top_p, batch=args.batch, seed=args.seed,
                        prompts=None if args.prompts is None else str(args.prompts.resolve()))
    ts.validate()
    return model, ts


def _device(name: str):
    """The torch device `name`, refused in one line where it cannot run (before the model loads)."""
    import torch

    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UsageError(f"--device {name!r} is not a torch device; e.g. cpu, cuda, cuda:1") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: no CUDA GPU is available here; use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(f"--device {name}: only {torch.cuda.device_count()} CUDA GPU(s) here")
    return device


@exit_on_usage_error
def _run(argv: list[str] | None, command: bool) -> int:
    """The command's work; `command`: this process is the command (its stop handling is ours to set)."""
    args = _parser().parse_args(argv)
    model, ts = check_args(args)
    out = args.out.resolve()
    partial = batches_folder(out)
    from uptrain.threads import announce_threads, start_threads

    start_threads(args.threads)
    device = _device(args.device)
    if model is None:  # a Hub id: downloaded (or found in the cache) now
        from uptrain.convert.io.source import resolve_source

        model = resolve_source(args.model)
    announce_threads(stdout=True)
    if command:  # the one stop line says what is left: --out as it was, the batches kept
        at_once.install(PROGRAM, f"{out} {'is as it was' if out.exists() else 'was not written'}")
        at_once.leaving(lambda: kept_batches(partial))
    from uptrain.convert.progress import print_line
    from uptrain.train.model import teacher_samples

    made = teacher_samples.teacher_text_file(model, ts, out, partial, device, print_line)
    if command:  # a stop from here on: the file is complete
        at_once.leaving(None)
        at_once.install(PROGRAM, f"{out} is written and complete")
    kept = f"; {made['batches_reused']} batches kept from a stopped run" if made["batches_reused"] else ""
    print(f"{made['documents']:,} documents, {made['tokens']:,} tokens written to {out} in {made['seconds']:.0f} s "
          f"({made['tokens_per_s']:,.0f} tokens/s{kept})", flush=True)
    print(f"next: --calib {args.out} for uptrain.convert, data.train.files=[{args.out}] for uptrain.train "
          "(docs/own-model.md)", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command (`argv` None: this process's arguments, with `uptrain.stopping.at_once`'s stop handling
    and its exit, also for the console script `uptrain-samples`; a list: as a function, for tests, the
    process's handlers left alone)."""
    if argv is not None:
        return _run(argv, False)
    at_once.install(PROGRAM, "nothing was written yet")
    at_once.finish(_run(None, True))
    return 0  # not reached


if __name__ == "__main__":
    main()
