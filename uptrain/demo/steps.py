"""The demo's steps, each kept for a rerun of the same demo (`record.py`) and each saying what a stop
keeps: the checks made before any work (`check_first`), the source's samples, the conversion, the
uptraining and the context tail (each trainer run resumed from the stopped run's checkpoint)."""

from __future__ import annotations

from pathlib import Path

import torch

from uptrain.convert import convert
from uptrain.convert.io.hfconfig import model_shape
from uptrain.convert.io.source import read_config
from uptrain.convert.options import DEFAULT_REFINE_STEPS
from uptrain.data import DataSource, read_documents
from uptrain.demo.record import DemoRecord, checkpoints
from uptrain.errors import UsageError
from uptrain.stopping import at_once

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CONFIG = REPO / "configs" / "demo-cpu.yaml"
VALID = EXAMPLES / "data" / "tinystories-valid-sample.txt"
TRAIN = EXAMPLES / "data" / "tinystories-train-sample.txt"
REFINE_STEPS = DEFAULT_REFINE_STEPS  # the converter's --refine-steps default
# --calib-tokens: calibrated and refined on 65,536 tokens, not 16,384, the bundled model's start scores 1.840
# against 1.867 on the shipped stories, 1.854 against 1.890 on its own samples (results/quality-curve.md)
CALIB_TOKENS = 65536
# --context-tail: the tail's peak lr, as a share of the uptraining's (results/quality-curve.md: 0.5M tokens at the
# bundled model's 512-token window after 8M at 128-token blocks, 1.765 -> 1.755 at 0.1, 1.753 at 0.2, 1.751 at
# 0.4, 1.751 at 0.8). The uptraining's cosine then stops there (optim.min_lr_ratio) and the tail goes on from it:
# 1.754 against 1.756 for a cosine to 0.1 and a rise back to 0.4 (7.2M + 0.5M tokens, the same start and samples;
# stopping at 0.3 and a tail from 0.3 tie: 1.7488 at 8M + 1M)
TAIL_LR = 0.4


def calib_tokens(asked: int | None, teacher_samples: int | None) -> int:
    """The demo's calibration tokens: `asked` (--calib-tokens) where given, else CALIB_TOKENS, with
    --teacher-samples N at most N/2 (so the samples' training part holds them)."""
    if asked is not None:
        return asked
    return min(CALIB_TOKENS, max(teacher_samples // 2, 1)) if teacher_samples else CALIB_TOKENS


def _shown(path: Path) -> str:
    """`path` relative to the repository when inside it (as the README shows it), else as given."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def convert_step(args, source: Path, name: str, kv_heads: int, train_text: Path, record: DemoRecord
                 ) -> tuple[Path, str]:
    """Convert `source` into OUT/NAME-gqaK as the arguments say, with uptrain.convert's own rule for
    which conversions read the calibration text (`ConversionOptions`: also --grouping similar); (folder,
    method shown in the table). A line per refined layer, with the time left (convert's progress line).
    Kept from a stopped run of the same demo (`record`) when that run finished it."""
    from uptrain.convert.options import ConversionOptions
    from uptrain.convert.progress import layer_progress, print_line

    calib = train_text if args.calib_tokens > 0 else None  # --calib-tokens 0: weights only
    options = ConversionOptions(method=args.method, grouping=args.grouping, calib=calib,
                                calib_tokens=max(args.calib_tokens, 1),
                                refine=calib is not None and args.refine_steps > 0 and args.method != "random",
                                refine_steps=max(args.refine_steps, 1))
    layers = model_shape(read_config(source)).layers
    calibration, refine = options.calibration(), options.refine_settings(log=layer_progress(layers, print_line, "   "))
    how = args.method + (f", {args.grouping} grouping" if args.grouping != "contiguous" else "")
    how += f", calibrated on up to {args.calib_tokens:,} tokens of {train_text.name}" if calibration else ""
    how += f", refined (at most {args.refine_steps} steps per layer)" if refine else ""
    converted = args.out / f"{name}-gqa{kv_heads}"
    method = args.method + (" + refine" if refine else "")
    if record.done("convert") and (converted / "config.json").is_file():
        print(f"== convert {_shown(source)} to {kv_heads} K/V heads: kept from the earlier run ({converted})",
              flush=True)
        return converted, method
    _keeps(args, "the conversion's finished layers, if any (below); the same command continues from them",
           record)
    print(f"== convert {_shown(source)} to {kv_heads} K/V heads ({how})", flush=True)
    if calibration is not None and calibration.record.get("warning"):
        print(f"   warning: {calibration.record['warning']}", flush=True)
    plan = convert(str(source), converted, kv_heads, args.method, force=True, calibration=calibration,
                   grouping=args.grouping, refine=refine)
    if calibration is not None and calibration.record.get("near_chance"):
        print(f"   warning: {calibration.record['near_chance']}", flush=True)
    if calibration is not None:
        from uptrain.convert.layers.calibrate import shortfall_warning

        short = shortfall_warning(calibration.record)
        print(f"   {short or 'calibrated on ' + format(calibration.record['tokens_used'], ',') + ' tokens'}", flush=True)
    for note in plan.notes:
        if note.startswith("continues an interrupted conversion"):
            print(f"   {note}", flush=True)
    at_once.written(None)  # the demo goes on: a later stop is not "after the folder was put in place"
    record.finish("convert")
    return converted, method


def _keeps(args, now: str, record: DemoRecord) -> None:
    """The stop line from here on: what --out keeps (the finished steps and `now`) and what a rerun does."""
    finished = ", ".join(record.steps) or "no finished step yet"
    at_once.install("uptrain.demo", f"--out {args.out} keeps: {finished}; {now}")


def samples_step(args, source: Path, record: DemoRecord) -> list[str]:
    """The source's own text (--teacher-samples N): N tokens sampled into OUT/data/samples.jsonl, with a
    progress line every ~10 s; a stopped run's batches are kept beside --out (`.OUT.teacher-samples`)
    and the same command continues from them. Returns the documents."""
    from uptrain.convert.progress import print_line
    from uptrain.data import TeacherSamples
    from uptrain.train.model.teacher_samples import teacher_text_file

    out_file = args.out / "data" / "samples.jsonl"
    partial = args.out.parent / f".{args.out.name}.teacher-samples"
    if record.done("samples") and out_file.is_file():
        print(f"== the source's samples: kept from the earlier run ({out_file})", flush=True)
    else:
        _keeps(args, f"the sample batches made so far, in {partial}; the same command continues from them", record)
        at_once.leaving(lambda: _batches(partial))
        print(f"== the source writes {args.teacher_samples:,} tokens of training text into {out_file}", flush=True)
        made = teacher_text_file(source, TeacherSamples(tokens=args.teacher_samples), out_file, partial,
                                 torch.device("cpu"), print_line)
        at_once.leaving(None)
        print(f"   {made['documents']:,} documents, {made['tokens']:,} tokens in {made['seconds']:.0f} s "
              f"({made['tokens_per_s']:,.0f} tokens/s)", flush=True)
        record.finish("samples")
    texts = read_documents(DataSource(files=[str(out_file)]))
    if len(texts) < 2 and not args.valid and args.model is not None:
        raise UsageError(f"--teacher-samples {args.teacher_samples:,} made {len(texts)} document; the demo holds out "
                         "the last tenth for scoring: ask for more tokens or give --valid FILE")
    return texts


def uptrain_overrides(args, source: Path, converted: Path, train_text: Path, valid_path: Path, threads: int,
                      run_dir: Path, frame: list[str] = ()) -> list[str]:
    """The key=value overrides of configs/demo-cpu.yaml for this demo (`frame`: `frame.block_frame`'s; the
    user's last)."""
    from uptrain.train.recipe import recipe_overrides

    return [f"model={converted}", f"run_dir={run_dir}", "overwrite=true", f"data.train.files=[{train_text}]",
            f"data.val.files=[{valid_path}]", *recipe_overrides(str(source), args.alpha_kd), f"threads={threads}",
            *one_micro_batch(args), *frame, *_handoff(args, frame), *cpu_attention(args), *args.overrides]


def cpu_attention(args) -> list[str]:
    """`bf16_attention=true` where it suits this machine (a CPU run on a CPU that multiplies bfloat16:
    `cpu_attention.suits_this_machine`; 1.2-2x the tokens/s of float32 SDPA there, results/quality-curve.md, round
    two, eighth part), unless the user set bf16_attention."""
    from uptrain.train.model.cpu_attention import suits_this_machine

    if any(o.partition("=")[0] == "bf16_attention" for o in args.overrides):
        return []
    return ["bf16_attention=true"] if suits_this_machine() else []


def one_micro_batch(args) -> list[str]:
    """A CPU run's step in one micro batch: `batch.micro_batch=M x A batch.grad_accum=1` for the config's M x A
    (the same blocks a step and the same summed gradient: gradient accumulation only saves memory, and each
    micro batch costs a fixed ~8 ms of operator dispatch on stories260K, 7% of a CPU step: results/quality-curve.md,
    round two, ninth part). None with CUDA (where the activations' memory is what accumulation saves) or where
    the user set batch.micro_batch or batch.grad_accum."""
    from uptrain.train.config import load_config
    from uptrain.train.model.cpu_attention import cpu_run

    if not cpu_run() or any(o.partition("=")[0] in ("batch.micro_batch", "batch.grad_accum")
                                        for o in args.overrides):
        return []
    batch = load_config(CONFIG, []).batch
    return [f"batch.micro_batch={batch.micro_batch * batch.grad_accum}", "batch.grad_accum=1"]


def _handoff(args, frame: list[str] = ()) -> list[str]:
    """With --context-tail the uptraining's cosine stops at TAIL_LR of its peak, where the tail starts. Not
    where the user set optim.min_lr_ratio (theirs holds for both runs), nor where `frame` trains at the
    window already (no tail follows: `context_step`)."""
    own = any(o.startswith("optim.min_lr_ratio=") for o in args.overrides)
    return [f"optim.min_lr_ratio={TAIL_LR:g}"] if args.context_tail and not own and not frame else []


def training_blocks(args, source: Path, train_text: Path) -> list[str]:
    """The uptraining's block overrides (`frame.block_frame`: the source's window where it copies across
    it), with its line; none where the user set data.seq_len or batch.micro_batch."""
    from uptrain.demo.frame import block_frame
    from uptrain.measure.eval import model_windows
    from uptrain.train.config import load_config

    if any(o.split("=", 1)[0] in ("data.seq_len", "batch.micro_batch") for o in args.overrides):
        return []
    config = load_config(CONFIG, one_micro_batch(args))
    frame, line = block_frame(source, train_text, model_windows([str(source)])[0], config.data.seq_len,
                              config.batch.micro_batch)
    print(f"   {line}", flush=True)
    return frame


def context_overrides(args, main: list[str], window: int) -> list[str]:
    """--context-tail N's overrides: the uptraining's (`main`, the user's included) and after them the tail's
    own: blocks of the model's whole scoring `window`, as many tokens a micro step (at least one block), N
    tokens, from TAIL_LR of the uptraining's peak lr (where its cosine stopped, `_handoff`) down to the
    config's min_lr_ratio of that. UsageError where the window is no longer than the blocks."""
    from uptrain.train.config import load_config

    handoff = _handoff(args)
    config = load_config(CONFIG, [o for o in main if o not in handoff])  # floor: before the hand-off
    if window <= config.data.seq_len:
        raise UsageError(f"--context-tail: the model's window ({window} tokens) is no longer than the uptraining's "
                         f"blocks ({config.data.seq_len}): every position is trained already; drop --context-tail")
    micro = max(1, config.batch.micro_batch * config.data.seq_len // window)
    return [*main, f"data.seq_len={window}", f"batch.micro_batch={micro}", f"budget.tokens={args.context_tail}",
            f"optim.lr={config.optim.lr * TAIL_LR:.6g}", f"optim.min_lr_ratio={config.optim.min_lr_ratio:g}"]


def check_first(args, source: Path, threads: int, window: int = 0) -> int:
    """Every refusal that waits for no sample and no conversion, before the first sample is drawn (on a
    7B model sampling and converting take hours): `--valid` (missing, empty, not text) and the
    uptraining's config with the user's overrides (a mistyped key, a bad value), loaded with the shipped
    texts and the source standing in for what the demo writes later. Returns the budget in tokens."""
    from uptrain.train.config import load_config

    if args.valid is not None:
        read_documents(DataSource(files=[str(args.valid)]), None, field_option=None)
    stand_in = uptrain_overrides(args, source, source, TRAIN, args.valid or VALID, threads, args.out / "uptrain")
    budget = load_config(CONFIG, stand_in).budget.total_tokens()
    if args.context_tail:  # the tail's config too (its blocks, batch, lr), before any sample is drawn
        if args.skip_uptrain:
            raise UsageError("--context-tail continues the uptraining, which --skip-uptrain skips: drop one of them")
        load_config(CONFIG, context_overrides(args, stand_in, window))
    return budget


def say_repeats(samples: int, budget: int) -> None:
    """A line when the uptraining's budget trains on the samples more than once (nothing says so later)."""
    if samples < budget:
        print(f"note: the uptraining's budget is {budget:,} tokens: the {samples:,} sample tokens are trained on "
              f"about {budget / samples:.1f} times (measured on the bundled model: twice ties fresh text for 12% "
              f"less CPU, four times costs 0.002 nats); --teacher-samples {budget} gives each step fresh text",
              flush=True)


def _batches(partial: Path) -> str:
    """What a stop during sampling keeps, for its one line: the batches in `partial`."""
    chunks = sorted((partial / "chunks").glob("*")) if (partial / "chunks").is_dir() else []
    return f"{len(chunks)} sample batches kept in {partial}" if chunks else ""


def uptrain_step(args, source: Path, converted: Path, train_text: Path, valid_path: Path, threads: int,
                 record: DemoRecord) -> Path:
    """Uptrain `converted` with configs/demo-cpu.yaml (distilling from `source`); the model folder. Kept
    from a stopped run of the same demo when it finished; resumed from its last checkpoint when it stopped."""
    run_dir = args.out / "uptrain"
    if record.done("uptrain") and (run_dir / "model" / "config.json").is_file():
        print(f"== uptrain: kept from the earlier run ({run_dir / 'model'})", flush=True)
        return run_dir / "model"
    resume = checkpoints(run_dir)
    _keeps(args, f"the uptraining's last checkpoint in {run_dir / 'checkpoints'} (a stop writes one after its "
           "step); the same command continues from it", record)
    print(f"== uptrain with {CONFIG.relative_to(REPO)} into {run_dir}"
          + (f": continues from {resume[-1].name} of the stopped run" if resume else ""), flush=True)
    from uptrain.train.recipe import describe

    own_lr = args.model is not None and not any(o.startswith("optim.lr=") for o in args.overrides)
    better = ("; better: 1/3 of your model's own pre-training peak (model card), set with optim.lr=X, or measure: "
              "scripts/lr_sweep.py") if own_lr else ""
    print(f"   {describe(args.alpha_kd)}{better}", flush=True)
    frame = training_blocks(args, source, train_text)
    if _handoff(args, frame):
        print(f"   with --context-tail: the cosine stops at {TAIL_LR:g} x the peak lr, where the tail goes on",
              flush=True)
    if cpu_attention(args):
        print("   bf16_attention=true: this CPU multiplies bfloat16, so the training attention runs by hand in "
              "bfloat16 (bf16_attention=false: SDPA in float32)", flush=True)
    merged = one_micro_batch(args)
    if merged:
        print(f"   {' '.join(merged)}: on the CPU a step's blocks go in one micro batch "
              "(the same step; accumulation only saves memory)", flush=True)
    overrides = uptrain_overrides(args, source, converted, train_text, valid_path, threads, run_dir, frame)
    return _train("uptrain", overrides, bool(resume), record, run_dir)


def context_step(args, source: Path, uptrained: Path, train_text: Path, valid_path: Path, threads: int,
                 record: DemoRecord, window: int) -> Path | None:
    """--context-tail N: N tokens more from the uptrained model, in blocks of the model's whole scoring
    `window` (`context_overrides`); the model folder. The positions past the uptraining's blocks are never
    trained there, and a long run in short blocks erodes them (results/quality-curve.md). Kept or resumed
    as the uptraining is. None, with a line, where the uptraining's own blocks were the window already
    (`training_blocks` chose them for a source that copies across it: decided after the checks)."""
    import yaml

    trained = yaml.safe_load((args.out / "uptrain" / "run.yaml").read_text())["data"]["seq_len"]  # as it ran
    if trained >= window:
        print(f"== context tail: none; the uptraining's blocks were the model's whole window already ({trained} "
              "tokens)", flush=True)
        return None
    run_dir = args.out / "context"
    if record.done("context") and (run_dir / "model" / "config.json").is_file():
        print(f"== context tail: kept from the earlier run ({run_dir / 'model'})", flush=True)
        return run_dir / "model"
    resume = checkpoints(run_dir)
    at_once.written(None)  # the demo goes on: a stop in the tail is not "after the uptrained model was put in place"
    _keeps(args, f"the context tail's last checkpoint in {run_dir / 'checkpoints'}; the same command continues "
           "from it", record)
    main = uptrain_overrides(args, source, uptrained, train_text, valid_path, threads, run_dir)
    overrides = context_overrides(args, main, window)
    print(f"== context tail: {args.context_tail:,} tokens more in {window}-token blocks (the model's window), peak "
          f"lr {TAIL_LR:g} x the uptraining's, into {run_dir}"
          + (f": continues from {resume[-1].name} of the stopped run" if resume else ""), flush=True)
    return _train("context", overrides, bool(resume), record, run_dir)


def _train(step: str, overrides: list[str], resume: bool, record: DemoRecord, run_dir: Path) -> Path:
    """One trainer run of configs/demo-cpu.yaml with `overrides` (`resume`: from the stopped run's last
    checkpoint, its own state, not replaced); `step` finished in the record; the model folder."""
    from uptrain.train import train
    from uptrain.train.config import load_config

    if resume:
        overrides = [o for o in overrides if o != "overwrite=true"] + ["resume=latest"]
    try:
        train(load_config(CONFIG, overrides))
    except BaseException as err:  # train() handles stop signals itself while it runs: its stop ends the demo
        at_once.end_after_training_stop(err)
        raise
    record.finish(step)
    return run_dir / "model"
