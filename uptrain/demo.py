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

import json
import sys
from pathlib import Path

import torch

from uptrain.cli import ArgParser, format_table, positive_int, prog_name
from uptrain.convert import convert
from uptrain.convert.choices import GROUPINGS, METHODS
from uptrain.convert.hfconfig import model_shape, source_family
from uptrain.convert.source import read_config, resolve_source
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.data import DataSource, read_documents
from uptrain.measure.eval import evaluate, load_model, tokenize_texts
from uptrain.threads import add_threads_arg, announce_threads, start_threads
from uptrain.units import kv_cache_bytes_per_token

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CONFIG = REPO / "configs" / "demo-cpu.yaml"
VALID = EXAMPLES / "data" / "tinystories-valid-sample.txt"
TRAIN = EXAMPLES / "data" / "tinystories-train-sample.txt"
REFINE_STEPS = 1200  # the converter's --refine-steps default (results/refine-uptrain.md: the demo's goal needs it)
OWN_MODEL_LR = 1e-4  # 1/3 of 3e-4, a common pre-training peak; configs/demo-cpu.yaml's 1e-3 is tuned to stories260K
HELD_OUT_SHARE = 0.1  # of --data's documents, when no --valid


def held_out_loss(model_dir: Path, texts: list[str]) -> tuple[float, float, int]:
    """(loss in nats/token, perplexity, KV-cache bytes per token) of a model folder on `texts`."""
    model, tokenizer = load_model(str(model_dir))
    result = evaluate(model, tokenize_texts(tokenizer, texts), max_length=512, stride=256)
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


def source_model(model: str) -> tuple[Path, int, int]:
    """(folder, query heads, K/V heads) of a model to convert; UsageError if it cannot be converted.

    Checks what the conversion checks first (the folder or Hub id, the registry's model type), so
    that the demo refuses in one line before it reads or trains anything.
    """
    folder = resolve_source(model)
    raw = read_config(folder)
    source_family(raw)  # the registry's one-line refusal of other types
    shape = model_shape(raw)
    if shape.kv_heads == 1:
        raise UsageError(f"{model} already has 1 K/V head (multi-query attention); nothing left to convert")
    return folder, shape.heads, shape.kv_heads


def split_text(data: Path, out: Path) -> tuple[Path, Path]:
    """Write --data's documents to OUT/data/{train,valid}.jsonl: the last tenth held out, whole.

    The held-out documents are the end of the file, never trained on.
    """
    texts = read_documents(DataSource(files=[str(data)]))
    if len(texts) < 2:
        raise UsageError(f"--data {data} holds {len(texts)} document; the demo holds out the last tenth for "
                         "scoring: give more documents (a blank line between them in .txt) or --valid FILE")
    held = max(1, round(HELD_OUT_SHARE * len(texts)))
    folder = out / "data"
    folder.mkdir(parents=True, exist_ok=True)
    for split, part in (("train", texts[:-held]), ("valid", texts[-held:])):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part),
                                               encoding="utf-8")
    return folder / "train.jsonl", folder / "valid.jsonl"


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog=prog_name("uptrain.demo"), description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the demo writes (replaced)")
    p.add_argument("--model", help="your own model to convert: a local folder or a Hub id (default: the embedded "
                   "stories260K-mha8)")
    p.add_argument("--data", type=Path, help="your own text (.txt, .jsonl, .json, .parquet): trained on, its last "
                   "tenth of documents held out for the table (default: the shipped TinyStories samples)")
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
    p.add_argument("--tasks", default="stories_cloze,stories_ending",
                   help="bundled lm-eval tasks to score every model on (needs uptrain[eval]); none: skip")
    p.add_argument("--task-limit", type=positive_int, default=50, help="items per task")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides of configs/demo-cpu.yaml")
    args = p.parse_args(argv)
    threads = start_threads(args.threads).threads
    if args.model is None:
        source = EXAMPLES / "stories260K-mha8"
        if not source.is_dir():
            raise UsageError(f"{source} is missing; run the demo from a checkout of the repository")
        name, heads, kv_before = "stories260K", 8, 8
    else:
        source, heads, kv_before = source_model(args.model)
        name = args.model.rstrip("/").split("/")[-1]
    kv_heads = args.kv_heads or default_kv_heads(heads, kv_before)
    # Read as the trainer reads text (text_unit paragraph): one story per document, whole.
    train_text, valid_path = TRAIN, args.valid or VALID
    if args.data is not None:
        train_text, held_out = split_text(args.data, args.out)
        valid_path = args.valid or held_out
    valid = read_documents(DataSource(files=[str(valid_path)]), args.stories)
    announce_threads()
    torch.manual_seed(0)

    calibration, refine = None, None
    refining = args.refine_steps > 0 and args.method != "random"
    if args.calib_tokens > 0 and (args.method == "fit" or refining):
        from uptrain.convert.calibrate import Calibration

        calibration = Calibration(train_text, args.calib_tokens, "cpu")
        if refining:
            from uptrain.convert.refine_layer import RefineSettings

            refine = RefineSettings(steps=args.refine_steps)
    how = args.method + (f", {args.grouping} grouping" if args.grouping != "contiguous" else "")
    how += f", calibrated on {args.calib_tokens:,} tokens of {train_text.name}" if calibration else ""
    how += f", refined (at most {args.refine_steps} steps per layer)" if refine else ""
    converted = args.out / f"{name}-gqa{kv_heads}"
    print(f"== convert {_shown(source)} to {kv_heads} K/V heads ({how})")
    convert(str(source), converted, kv_heads, args.method, force=True, calibration=calibration,
            grouping=args.grouping, refine=refine)
    kind = "MHA" if kv_before == heads else "GQA"
    method = args.method + (" + refine" if refine else "")
    rows = [(f"{kind} source ({kv_before} K/V heads)", *held_out_loss(source, valid)),
            (f"GQA-{kv_heads}, converted ({method})", *held_out_loss(converted, valid))]

    if not args.skip_uptrain:
        from uptrain.train import train
        from uptrain.train.config import load_config
        run_dir = args.out / "uptrain"
        print(f"== uptrain with {CONFIG.relative_to(REPO)} into {run_dir}")
        distill = [f"distill.teacher={source}", f"distill.alpha_kd={args.alpha_kd}"] if args.alpha_kd > 0 else []
        own_lr = []
        if args.model is not None and not any(o.startswith("optim.lr=") for o in args.overrides):
            own_lr = [f"optim.lr={OWN_MODEL_LR}"]
            print(f"   peak lr {OWN_MODEL_LR:g}: 1/3 of 3e-4, a common pre-training peak; better 1/3 of your "
                  "model's own (model card), or measure: scripts/lr_sweep.py; set it with optim.lr=X")
        config = load_config(CONFIG, [f"model={converted}", f"run_dir={run_dir}", "overwrite=true",
                                      f"data.train.files=[{train_text}]", f"data.val.files=[{valid_path}]",
                                      *distill, *own_lr, f"threads={threads}",
                                      *args.overrides])
        train(config)
        kd = f", distilled alpha_kd {args.alpha_kd}" if args.alpha_kd > 0 else ""
        rows.append((f"GQA-{kv_heads}, uptrained{kd}", *held_out_loss(run_dir / "model", valid)))

    base_kv = rows[0][3]
    table = [[label, f"{loss:.3f}", f"{ppl:.2f}", f"{kv:,} B", f"{base_kv / kv:.0f}x"]
             for label, loss, ppl, kv in rows]
    shown = _shown(args.data) + ", its last tenth" if args.data and not args.valid else _shown(valid_path)
    unit = "stories" if args.data is None else "documents"
    print(f"\nHeld-out loss on {shown} ({len(valid)} {unit}, "
          f"512-token windows, stride 256):\n")
    print(format_table(["model", "loss (nats/token)", "perplexity", "KV cache / token", "KV reduction"], table))
    if args.tasks != "none":
        from uptrain.measure.tasks import parse_task_names, print_demo_scores

        paths = [source, converted] + ([] if args.skip_uptrain else [run_dir / "model"])
        print_demo_scores([r[0] for r in rows], [str(x) for x in paths], parse_task_names([args.tasks]), args.task_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
