"""`python -m uptrain.demo`: the whole job on the embedded tiny model, end to end on CPU.

Converts the real pretrained stories260K Llama in MHA form (8 K/V heads, `examples/`) to 2 K/V
heads (by default with `--method fit` calibrated on the training sample, then layer-wise
reconstruction of each attention layer, `--refine`; `--method mean --refine-steps 0` is the
paper's pooling), uptrains it on TinyStories text with `configs/demo-cpu.yaml` (by default
distilling from the MHA source), and prints the held-out loss before conversion, after
conversion and after uptraining, with the KV cache.

Your own model and text, same steps and table:

    python -m uptrain.demo --model DIR_OR_HUB_ID --data FILE [--kv-heads N] [optim.lr=X budget.tokens=N]

FILE is read as the trainer reads it (.txt: a blank line between documents; .jsonl/.json/.parquet:
a `text` field); its last tenth of documents is held out for the table (or `--valid FILE`), the
rest is the training text (also the calibration text of `--method fit`). `--kv-heads` defaults
to a quarter of the model's K/V heads. The peak learning rate defaults to 1e-4, 1/3 of a common
pre-training peak (3e-4); the recipe study found 1/3 of the model's own peak best: pass
`optim.lr=` from its model card, or measure with `scripts/lr_sweep.py`.
"""

from __future__ import annotations

AS_IT_WAS = ("the folder being written was removed; --out keeps the steps finished before (the next demo into "
             "it replaces them, all but a conversion's finished layers)")
from uptrain.stopping import is_command

if is_command(__name__, "uptrain-demo"):  # first act: Ctrl-C / SIGTERM during the imports below end the demo cleanly too
    from uptrain.stopping import at_once

    at_once.install("uptrain.demo", AS_IT_WAS)

import json
from pathlib import Path

import torch

from uptrain.stopping import at_once
from uptrain.cli import ArgParser, format_table, positive_int, prog_name
from uptrain.convert import convert
from uptrain.convert.registry.choices import GROUPINGS, METHODS
from uptrain.convert.io.hfconfig import model_shape, source_family, stored_kv_bytes_per_token
from uptrain.convert.options import DEFAULT_REFINE_STEPS
from uptrain.convert.pipeline import check_kv_heads
from uptrain.convert.io.source import read_config, resolve_source
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.data import DataSource, read_documents
from uptrain.measure.eval import evaluate, load_model, model_windows, tokenize_texts
from uptrain.threads import add_threads_arg, announce_threads, start_threads
from uptrain.measure.kv_cache import FORMATS, KVFormat, check_paths, kv_format
from uptrain.units import kv_cache_bytes_per_token

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CONFIG = REPO / "configs" / "demo-cpu.yaml"
VALID = EXAMPLES / "data" / "tinystories-valid-sample.txt"
TRAIN = EXAMPLES / "data" / "tinystories-train-sample.txt"
REFINE_STEPS = DEFAULT_REFINE_STEPS  # the converter's --refine-steps default
OWN_MODEL_LR = 1e-4  # 1/3 of 3e-4, a common pre-training peak; configs/demo-cpu.yaml's 1e-3 is tuned to stories260K
HELD_OUT_SHARE = 0.1  # of --data's documents, when no --valid
BUNDLED_TASKS = "stories_cloze,stories_ending,stories_name"  # TinyStories tasks (uptrain/measure/task_data/); the last generates


def held_out_loss(model_dir: Path, texts: list[str], max_length: int | None = None,
                  stride: int | None = None) -> tuple[float, float, int]:
    """(loss in nats/token, perplexity, KV-cache bytes per token) of a model folder on `texts`, scored
    as uptrain.eval scores it (`evaluate`; windows: `model_windows`, the model's context by default)."""
    max_length, stride = model_windows([str(model_dir)], max_length, stride)
    model, tokenizer = load_model(str(model_dir))
    result = evaluate(model, tokenize_texts(tokenizer, texts), max_length=max_length, stride=stride)
    shape = model_shape(model.config)  # the registry's K/V head field, as convert and train read it
    kv = kv_cache_bytes_per_token(shape.layers, shape.kv_heads, shape.head_dim, model.dtype.itemsize)
    return result.loss, result.perplexity, kv


def _shown(path: Path) -> str:
    """`path` relative to the repository when inside it (as the README shows it), else as given."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def default_kv_heads(heads: int, kv: int) -> int:
    """A quarter of `kv` K/V heads (8 -> 2), rounded down to a count that divides both head counts."""
    target = max(1, kv // 4)
    while kv % target or heads % target:
        target -= 1
    return target


def source_model(model: str, kv_heads: int | None) -> tuple[Path, int, int, int]:
    """(folder, query heads, K/V heads, K/V heads after conversion) of a model to convert; UsageError
    if it cannot be converted to `kv_heads` (None: `default_kv_heads`).

    Checks what the conversion checks first (the folder or Hub id, the registry's model type, the
    K/V head count), so that the demo refuses in one line before it prints, reads or trains anything.
    """
    folder = resolve_source(model)
    raw = read_config(folder)
    family = source_family(raw)  # the registry's one-line refusal of other types
    shape = model_shape(raw)
    if shape.kv_heads == 1:
        raise UsageError(f"{model} already has 1 K/V head (multi-query attention); nothing left to convert")
    target = kv_heads or default_kv_heads(shape.heads, shape.kv_heads)
    check_kv_heads(target, shape.heads, shape.kv_heads, family.mqa_only, raw.get("model_type", "?"))
    return folder, shape.heads, shape.kv_heads, target


def split_documents_of(data: Path) -> list[str]:
    """--data's documents, read as the trainer reads them; UsageError when there are too few to hold
    out any (checked before the demo writes anything)."""
    texts = read_documents(DataSource(files=[str(data)]), field_option=None)
    if len(texts) < 2:
        raise UsageError(f"--data {data} holds {len(texts)} document; the demo holds out the last tenth for "
                         "scoring: give more documents (a blank line between them in .txt) or --valid FILE")
    return texts


def write_split(texts: list[str], out: Path) -> tuple[Path, Path]:
    """Write the documents to OUT/data/{train,valid}.jsonl: the last tenth held out, whole.

    The held-out documents are the end of the file, never trained on.
    """
    held = max(1, round(HELD_OUT_SHARE * len(texts)))
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", texts[:-held]), ("valid", texts[-held:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part),
                                               encoding="utf-8")
    return folder / "train.jsonl", folder / "valid.jsonl"


def _parser() -> ArgParser:
    p = ArgParser(prog=prog_name("uptrain.demo"), description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the demo writes (an earlier demo's "
                   "folder there is replaced whole; any other folder is refused)")
    p.add_argument("--model", help="your own model to convert: a local folder or a Hub id (default: the embedded "
                   "stories260K-mha8)")
    p.add_argument("--data", type=Path, help="your own text (.txt, .jsonl, .json, .parquet): trained on, its last "
                   "tenth of documents held out for the table (default: the shipped TinyStories samples)")
    p.add_argument("--teacher-samples", type=positive_int, default=None, metavar="N",
                   help="no training text of yours: the source model writes N tokens of training text (also the "
                        "calibration text), sampled at temperature 1 from its whole distribution; without --valid its last tenth of "
                        "documents is held out for the table (the bundled model: the shipped held-out stories)")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="K/V heads after conversion (default: a quarter of the model's: 2 of the embedded 8)")
    p.add_argument("--method", choices=METHODS, default="fit",
                   help="conversion method (fit: least squares with Q/O compensation; mean: the paper's)")
    p.add_argument("--grouping", choices=GROUPINGS, default="similar",
                   help="which query heads share a K/V head (similar: equal groups of the most alike heads)")
    p.add_argument("--calib-tokens", type=int, default=16384,
                   help="--method fit: calibration tokens from the training sample (0: weights only)")
    p.add_argument("--refine-steps", type=int, default=REFINE_STEPS,
                   help="layer-wise reconstruction after the closed-form start (convert --refine): at most N "
                        f"Adam steps per layer on the calibration tokens (default {REFINE_STEPS}; 0: none)")
    p.add_argument("--alpha-kd", type=float, default=1.0,
                   help="share of the distillation loss from the MHA source (0: plain LM uptraining)")
    p.add_argument("--skip-uptrain", action="store_true", help="only convert and evaluate")
    p.add_argument("--stories", type=positive_int, default=None, help="score only the first N held-out stories")
    p.add_argument("--valid", type=Path, default=None,
                   help="held-out text: stories separated by blank lines (default: the shipped TinyStories sample, "
                        "or the end of --data)")
    add_threads_arg(p, "conversion, calibration, training and evaluation")
    p.add_argument("--tasks", default=None,
                   help="lm-eval tasks to score every model on (needs uptrain[eval]); default: the bundled "
                        f"TinyStories tasks ({BUNDLED_TASKS}) for the bundled model, none for yours (they would "
                        "score a model trained on other text near zero); none: skip")
    p.add_argument("--task-limit", type=positive_int, default=50, help="items per task")
    p.add_argument("--kv-cache", default=None, metavar="NAME",
                   help="also score every model with its K/V cache stored in this format, as a runtime stores it: "
                        f"{', '.join(n for n in FORMATS if n != 'model')} (uptrain.measure.kv_cache; docs/measure.md)")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides of configs/demo-cpu.yaml")
    return p


def main(argv: list[str] | None = None) -> int:
    """The demo (`argv` None: this process's arguments, with the stop handling of `uptrain.stopping.at_once`:
    a stop at any point ends it with one line and exit 130 / 143, and its exit; a list: as a function,
    for tests)."""
    if argv is not None:
        return _demo(argv)
    at_once.install("uptrain.demo", AS_IT_WAS)  # (installed at the import already: -m or the console script)
    at_once.finish(_demo(None))
    return 0  # not reached


@exit_on_usage_error
def _demo(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    threads = start_threads(args.threads).threads
    bundled = EXAMPLES / "stories260K-mha8"
    if args.model is None and not bundled.is_dir():
        raise UsageError(f"{bundled} is missing; run the demo from a checkout of the repository")
    name = "stories260K" if args.model is None else args.model.rstrip("/").split("/")[-1]
    # Everything that can be refused is checked before anything is printed or written.
    source, heads, kv_before, kv_heads = source_model(args.model or str(bundled), args.kv_heads)
    cache = kv_format(args.kv_cache) if args.kv_cache else None
    if cache is not None:
        check_paths(cache, [source])  # a block the head_dim cannot take: refused, as llama.cpp refuses it
    tasks = args.tasks or (BUNDLED_TASKS if args.model is None else "none")
    max_length, stride = model_windows([str(source)])  # uptrain.eval's rule: within the model's context
    # Read as the trainer reads text (text_unit paragraph): one story per document, whole.
    train_text, valid_path = TRAIN, args.valid or VALID
    if args.data is not None and args.teacher_samples:
        raise UsageError("give --data (your text) or --teacher-samples N (the source writes the text), not both")
    own_texts = split_documents_of(args.data) if args.data is not None else None
    prepare_out(args.out)
    announce_threads()
    if args.teacher_samples:
        own_texts = samples_step(args, source)
    if args.teacher_samples and (args.valid or args.model is None):  # held-out text from elsewhere: train on all
        train_text = args.out / "data" / "samples.jsonl"
    elif own_texts is not None:
        train_text, held_out = write_split(own_texts, args.out)
        valid_path = args.valid or held_out
    valid = read_documents(DataSource(files=[str(valid_path)]), args.stories, field_option=None)
    if args.model is None and not args.skip_uptrain and not args.overrides:
        print("expected: about 1-2 minutes after set-up on an idle 2-core machine (README), 2-4x that on a busy one",
              flush=True)
    torch.manual_seed(0)

    converted, method = convert_step(args, source, name, kv_heads, train_text)
    kind = "MHA" if kv_before == heads else "GQA"
    models = [(f"{kind} source ({kv_before} K/V heads)", source), (f"GQA-{kv_heads}, converted ({method})", converted)]
    if not args.skip_uptrain:
        uptrained = uptrain_step(args, source, converted, train_text, valid_path, threads)
        kd = f", distilled alpha_kd {args.alpha_kd}" if args.alpha_kd > 0 else ""
        models.append((f"GQA-{kv_heads}, uptrained{kd}", uptrained))
    shown = _shown(args.data) + ", its last tenth" if args.data and not args.valid else _shown(valid_path)
    report(models, valid, f"{shown} ({len(valid)} {'stories' if args.data is None else 'documents'}",
           max_length, stride, cache)
    if tasks != "none":
        from uptrain.measure.tasks import parse_task_names, print_demo_scores

        print_demo_scores([label for label, _ in models], [str(path) for _, path in models], parse_task_names([tasks]),
                          args.task_limit, max_length)
    elif args.model is not None and args.tasks is None:
        print("\n(lm-eval tasks: none by default for your model: the bundled ones are TinyStories tasks; "
              "name tasks that fit it with --tasks, e.g. --tasks hellaswag,arc_easy with their data in the "
              "datasets cache: docs/measure.md)")
    return 0


def convert_step(args, source: Path, name: str, kv_heads: int, train_text: Path) -> tuple[Path, str]:
    """Convert `source` into OUT/NAME-gqaK as the arguments say, with uptrain.convert's own rule for
    which conversions read the calibration text (`ConversionOptions`: also --grouping similar); (folder,
    method shown in the table). A line per refined layer, with the time left (convert's progress line)."""
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
    how += f", calibrated on {args.calib_tokens:,} tokens of {train_text.name}" if calibration else ""
    how += f", refined (at most {args.refine_steps} steps per layer)" if refine else ""
    converted = args.out / f"{name}-gqa{kv_heads}"
    print(f"== convert {_shown(source)} to {kv_heads} K/V heads ({how})", flush=True)
    if calibration is not None and calibration.record.get("warning"):
        print(f"   warning: {calibration.record['warning']}", flush=True)
    plan = convert(str(source), converted, kv_heads, args.method, force=True, calibration=calibration,
                   grouping=args.grouping, refine=refine)
    if calibration is not None and calibration.record.get("near_chance"):
        print(f"   warning: {calibration.record['near_chance']}", flush=True)
    for note in plan.notes:
        if note.startswith("continues an interrupted conversion"):
            print(f"   {note}", flush=True)
    at_once.written(None)  # the demo goes on: a later stop is not "after the folder was put in place"
    return converted, args.method + (" + refine" if refine else "")


def samples_step(args, source: Path) -> list[str]:
    """The source's own text (--teacher-samples N): N tokens sampled into OUT/data/samples.jsonl, with a
    progress line every ~10 s; a stopped run's batches are kept beside --out (`.OUT.teacher-samples`)
    and the same command continues from them. Returns the documents."""
    from uptrain.convert.progress import print_line
    from uptrain.data import TeacherSamples
    from uptrain.train.model.teacher_samples import teacher_text_file

    out_file = args.out / "data" / "samples.jsonl"
    partial = args.out.parent / f".{args.out.name}.teacher-samples"
    print(f"== the source writes {args.teacher_samples:,} tokens of training text into {out_file}", flush=True)
    made = teacher_text_file(source, TeacherSamples(tokens=args.teacher_samples), out_file, partial,
                             torch.device("cpu"), print_line)
    print(f"   {made['documents']:,} documents, {made['tokens']:,} tokens in {made['seconds']:.0f} s "
          f"({made['tokens_per_s']:,.0f} tokens/s)", flush=True)
    texts = read_documents(DataSource(files=[str(out_file)]))
    if len(texts) < 2 and not args.valid and args.model is not None:
        raise UsageError(f"--teacher-samples {args.teacher_samples:,} made {len(texts)} document; the demo holds out "
                         "the last tenth for scoring: ask for more tokens or give --valid FILE")
    return texts


def uptrain_step(args, source: Path, converted: Path, train_text: Path, valid_path: Path, threads: int) -> Path:
    """Uptrain `converted` with configs/demo-cpu.yaml (distilling from `source`); the model folder."""
    from uptrain.train import train
    from uptrain.train.config import load_config

    run_dir = args.out / "uptrain"
    print(f"== uptrain with {CONFIG.relative_to(REPO)} into {run_dir}", flush=True)
    distill = [f"distill.teacher={source}", f"distill.alpha_kd={args.alpha_kd}"] if args.alpha_kd > 0 else []
    own_lr = []
    if args.model is not None and not any(o.startswith("optim.lr=") for o in args.overrides):
        own_lr = [f"optim.lr={OWN_MODEL_LR}"]
        print(f"   peak lr {OWN_MODEL_LR:g}: 1/3 of 3e-4, a common pre-training peak; better 1/3 of your "
              "model's own (model card), or measure: scripts/lr_sweep.py; set it with optim.lr=X")
    config = load_config(CONFIG, [f"model={converted}", f"run_dir={run_dir}", "overwrite=true",
                                  f"data.train.files=[{train_text}]", f"data.val.files=[{valid_path}]",
                                  *distill, *own_lr, f"threads={threads}", *args.overrides])
    try:
        train(config)
    except BaseException as err:  # train() handles stop signals itself while it runs: its stop ends the demo
        at_once.end_after_training_stop(err)
        raise
    return run_dir / "model"


def report(models: list[tuple[str, Path]], valid: list[str], what: str, max_length: int, stride: int,
           cache: KVFormat | None = None) -> None:
    """The held-out table of `models` (label, folder), the source first, scored as uptrain.eval scores,
    each against the source (`uptrain.eval --reference`): loss, KL to the source, top-1 and greedy
    agreement, and the KV cache; the warnings when the loss cannot be read at face value. `cache`: each
    model also scored with its K/V cache stored in that format (a row each, its bytes the format's)."""
    from uptrain.measure.eval import evaluate_paths
    from uptrain.measure.fidelity import GreedySettings, fidelity_note, fidelity_warnings, greedy_cell

    print(f"== score {len(models)} models on {len(valid)} held-out documents ({max_length}-token windows), each "
          "against the source", flush=True)
    greedy = GreedySettings().within(max_length, explicit=False)
    results = evaluate_paths([str(path) for _, path in models], valid, max_length, stride, reference=str(models[0][1]),
                             greedy=greedy)
    if cache is not None and cache.round_trip is not None:
        results += evaluate_paths([str(path) for _, path in models], valid, max_length, stride,
                                  reference=str(models[0][1]), greedy=greedy, kv_cache=cache.name)
        models = models + [(f"{label}, {cache.name} cache", path) for label, path in models]
    kv = [r.kv_bytes_per_token for r in results]
    table = [[label, f"{r.loss:.3f}", f"{r.perplexity:.2f}", f"{r.kl_to_source:.4f}", f"{r.top1_agreement:.1%}",
              greedy_cell(r.greedy_agreement, r.greedy_agreement_se), f"{b:,.4g} B", f"{kv[0] / b:.3g}x"]
             for (label, _), r, b in zip(models, results, kv)]
    print(f"\nHeld-out loss on {what}, {max_length}-token windows, stride {stride}: the model's context, as "
          "uptrain.eval scores):\n")
    print(format_table(["model", "loss (nats/token)", "perplexity", "KL to source", "top-1 agr.", "greedy agr.",
                        "KV cache / token", "KV reduction"], table))
    print(f"\n({fidelity_note(results)}: how closely each model behaves like the source, which the loss alone "
          "does not say)")
    rows = [(label, r.loss, r.loss_vs_source, r.loss_vs_source_se) for (label, _), r in zip(models[1:], results[1:])]
    for line in fidelity_warnings(results[0].loss, results[0].vocab_size, rows):
        print(line)
    if len(models) > 2:
        print("\n(The trainer's val loss above is over packed blocks of the training format, each document's "
              "context cut at block edges; this table scores each document whole: the two differ, this one "
              "is the number to compare models with. docs/layout.md, 'Two validation numbers'.)")


DEMO_MARK = ".uptrain-demo"  # in a folder the demo made: only such a folder is replaced by --out


def prepare_out(out: Path) -> None:
    """Make `out` an empty folder for this demo: an earlier demo's folder is emptied (its old files
    would mix with the new ones), except the finished layers a stopped conversion kept there
    (`.NAME.layers-KEY`: the same command continues from them, as its stop line says; other
    arguments give another KEY); any other non-empty folder is refused in one line."""
    import shutil

    from uptrain.convert.io.output_dir import check_writable

    check_writable(out, "--out")
    if out.exists() and any(out.iterdir()):
        if not (out / DEMO_MARK).is_file():
            raise UsageError(f"--out {out} is a non-empty folder the demo did not make; give another --out "
                             "(the demo replaces only its own folders)")
        for entry in out.iterdir():
            if not (entry.is_dir() and entry.name.startswith(".") and ".layers-" in entry.name):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
    out.mkdir(parents=True, exist_ok=True)
    (out / DEMO_MARK).write_text("made by python -m uptrain.demo; replaced whole by the next demo into it\n")


if __name__ == "__main__":
    main()
