"""The demo's command: its arguments, its steps (samples, conversion, uptraining), each kept for a
rerun (`record.py`), and its table. What it does: the package's doc (`uptrain/demo/__init__.py`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from uptrain.stopping import at_once
from uptrain.train.recipe import RECIPE
from uptrain.cli import ArgParser, format_table, positive_int, prog_name
from uptrain.convert.registry.choices import GROUPINGS, METHODS
from uptrain.convert.io.hfconfig import model_shape, source_family
from uptrain.convert.pipeline import check_kv_heads
from uptrain.convert.io.source import read_config, resolve_source
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.data import DataSource, read_documents
from uptrain.demo import AS_IT_WAS, __doc__ as DEMO_DOC
from uptrain.demo.record import DemoRecord, demo_key, earlier_digests
from uptrain.demo.steps import (  # noqa: F401 (the demo's paths and defaults: public here too)
    CALIB_TOKENS, CONFIG, EXAMPLES, REFINE_STEPS, REPO, TRAIN, VALID, _shown, calib_tokens,
    check_first, context_step, convert_step, cpu_attention, one_micro_batch, samples_step, say_repeats, uptrain_step)
from uptrain.measure.eval import evaluate, load_model, model_windows, tokenize_texts
from uptrain.threads import add_threads_arg, announce_threads, start_threads
from uptrain.measure.kv_cache import FORMATS, KVFormat, check_paths, kv_format
from uptrain.units import kv_cache_bytes_per_token

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
    p = ArgParser(prog=prog_name("uptrain.demo"), description=DEMO_DOC.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the demo writes (an earlier demo's "
                   "folder there is replaced whole; any other folder is refused)")
    p.add_argument("--model", help="your own model to convert: a local folder or a Hub id (default: the embedded "
                   "stories260K-mha8)")
    p.add_argument("--data", type=Path, help="your own text (.txt, .jsonl, .json, .parquet): trained on, its last "
                   "tenth of documents held out for the table (default: the shipped TinyStories samples)")
    p.add_argument("--teacher-samples", type=positive_int, default=None, metavar="N",
                   help="no training text of yours: the source model writes N tokens of training text (also the "
                        "calibration text), sampled from its whole distribution at temperature 1.2 (measured better than 1); without --valid its last tenth of "
                        "documents is held out for the table (the bundled model: the shipped held-out stories)")
    p.add_argument("--kv-heads", type=positive_int, default=None,
                   help="K/V heads after conversion (default: a quarter of the model's: 2 of the embedded 8)")
    p.add_argument("--method", choices=METHODS, default="fit",
                   help="conversion method (fit: least squares with Q/O compensation; mean: the paper's)")
    p.add_argument("--grouping", choices=GROUPINGS, default="similar",
                   help="which query heads share a K/V head (similar: equal groups of the most alike heads)")
    p.add_argument("--calib-tokens", type=int, default=None,
                   help=f"--method fit: calibration tokens from the training text (0: weights only; default "
                        f"{CALIB_TOKENS:,}, with --teacher-samples N at most N/2)")
    p.add_argument("--refine-steps", type=int, default=REFINE_STEPS,
                   help="layer-wise reconstruction after the closed-form start (convert --refine): at most N "
                        f"Adam steps per layer on the calibration tokens (default {REFINE_STEPS}; 0: none)")
    p.add_argument("--alpha-kd", type=float, default=RECIPE["distill.alpha_kd"],
                   help="share of the distillation loss from the MHA source (0: plain LM uptraining; default: "
                        "the recipe's, uptrain/train/recipe.py)")
    p.add_argument("--context-tail", type=positive_int, default=None, metavar="N",
                   help="after the uptraining, N tokens more in blocks of the model's whole scoring window (512 for "
                        "the bundled model; the uptraining's are 128), from 0.4 x its peak lr, where the uptraining's "
                        "cosine then stops (unless optim.min_lr_ratio is given): the positions past "
                        "its blocks, which a long run in short blocks erodes (results/quality-curve.md); its model "
                        "is the table's last row")
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
    args.calib_tokens = calib_tokens(args.calib_tokens, args.teacher_samples)  # (the demo's record key holds it)
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
    # --valid, the uptraining's overrides (and the context tail's): before any sample is drawn
    budget = check_first(args, source, threads, max_length)
    args.bf16_attention = bool(cpu_attention(args))  # keyed with the options: the machine's choice made the steps
    args.one_micro_batch = bool(one_micro_batch(args))  # (so too this one)
    digests = earlier_digests(args.out)  # a 7B model's files hashed again only where they changed
    record = DemoRecord(args.out, demo_key(args, source, [p for p in (args.data, args.valid, TRAIN, VALID) if p],
                                           CONFIG, digests), digests)
    kept = record.prepare()
    announce_threads()
    if kept:
        print(f"== {args.out} holds this same demo's finished steps ({', '.join(kept)}: the same code, model, texts and "
              "options): kept; the rest follows", flush=True)
    if args.teacher_samples:
        say_repeats(args.teacher_samples, budget)
        own_texts = samples_step(args, source, record)
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

    converted, method = convert_step(args, source, name, kv_heads, train_text, record)
    kind = "MHA" if kv_before == heads else "GQA"
    models = [(f"{kind} source ({kv_before} K/V heads)", source), (f"GQA-{kv_heads}, converted ({method})", converted)]
    if not args.skip_uptrain:
        uptrained = uptrain_step(args, source, converted, train_text, valid_path, threads, record)
        kd = f", distilled alpha_kd {args.alpha_kd}" if args.alpha_kd > 0 else ""
        models.append((f"GQA-{kv_heads}, uptrained{kd}", uptrained))
        if args.context_tail:
            tail = context_step(args, source, uptrained, train_text, valid_path, threads, record, max_length)
            if tail is not None:
                models.append((f"GQA-{kv_heads}, + {args.context_tail:,} tokens at {max_length}", tail))
    shown = _shown(args.data) + ", its last tenth" if args.data and not args.valid else _shown(valid_path)
    stories = args.data is None and not (args.teacher_samples and valid_path != VALID)  # the shipped stories
    report(models, valid, f"{shown} ({len(valid)} {'stories' if stories else 'documents'}", max_length, stride, cache)
    if tasks != "none":
        from uptrain.measure.tasks import parse_task_names, print_demo_scores

        print_demo_scores([label for label, _ in models], [str(path) for _, path in models], parse_task_names([tasks]),
                          args.task_limit, max_length)
    elif args.model is not None and args.tasks is None:
        print("\n(lm-eval tasks: none by default for your model: the bundled ones are TinyStories tasks; "
              "name tasks that fit it with --tasks, e.g. --tasks hellaswag,arc_easy with their data in the "
              "datasets cache: docs/measure.md)")
    return 0


def report(models: list[tuple[str, Path]], valid: list[str], what: str, max_length: int, stride: int,
           cache: KVFormat | None = None) -> None:
    """The held-out table of `models` (label, folder), the source first, scored as uptrain.eval scores,
    each against the source (`uptrain.eval --reference`): loss, KL to the source, top-1 and greedy
    agreement, and the KV cache; the warnings when the loss cannot be read at face value. `cache`: each
    model also scored with its K/V cache stored in that format (a row each, its bytes the format's)."""
    from uptrain.measure.eval import evaluate_paths
    from dataclasses import asdict

    from uptrain.measure.copy_probe import COPY_COLUMNS, copy_cells, copy_warning
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
              greedy_cell(r.greedy_agreement, r.greedy_agreement_se), *copy_cells(r), f"{b:,.4g} B",
              f"{kv[0] / b:.3g}x"]
             for (label, _), r, b in zip(models, results, kv)]
    print(f"\nHeld-out loss on {what}, {max_length}-token windows, stride {stride}: the model's context, as "
          "uptrain.eval scores):\n")
    print(format_table(["model", "loss (nats/token)", "perplexity", "KL to source", "top-1 agr.", "greedy agr.",
                        *COPY_COLUMNS, "KV cache / token", "KV reduction"], table))
    copied = results[0]
    if copied.copy_gain is not None:
        distances = "/".join(map(str, copied.copy_distances))
        print(f"\n(copy: a passage of {copied.copy_passage} tokens read again after {distances} tokens of other text: "
              "the loss of the second reading, its top-1, and the share of the source's gain from the first reading "
              "to the second that the model keeps; uptrain.measure.copy_probe)")
    print(f"\n({fidelity_note(results)}: how closely each model behaves like the source, which the loss alone "
          "does not say)")
    rows = [(label, r.loss, r.loss_vs_source, r.loss_vs_source_se) for (label, _), r in zip(models[1:], results[1:])]
    for line in fidelity_warnings(results[0].loss, results[0].vocab_size, rows):
        print(line)
    for (label, _), r in zip(models[1:], results[1:]):
        if (line := copy_warning(label, asdict(r))):
            print(line)
    if len(models) > 2:
        print("\n(The trainer's val loss above is over packed blocks of the training format, each document's "
              "context cut at block edges; this table scores each document whole: the two differ, this one "
              "is the number to compare models with. docs/layout.md, 'Two validation numbers'.)")

