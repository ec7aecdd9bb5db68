"""`python -m uptrain.demo`: the whole job on the embedded tiny model, end to end on CPU.

Converts the real pretrained stories260K Llama in MHA form (8 K/V heads, `examples/`) to 2 K/V
heads (by default with `--method fit` calibrated on the training sample; `--method mean` is the
paper's pooling), uptrains it on TinyStories text with `configs/demo-cpu.yaml` (by default
distilling from the MHA source), and prints the held-out loss before conversion, after
conversion and after uptraining, with the KV cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from uptrain.cli import ArgParser, format_table, positive_int, prog_name
from uptrain.convert import convert
from uptrain.convert.choices import GROUPINGS, METHODS
from uptrain.convert.hfconfig import model_shape
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.data import DataSource, read_documents
from uptrain.measure.eval import evaluate, load_model, tokenize_texts
from uptrain.units import kv_cache_bytes_per_token

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
CONFIG = REPO / "configs" / "demo-cpu.yaml"
VALID = EXAMPLES / "data" / "tinystories-valid-sample.txt"


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


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    p = ArgParser(prog=prog_name("uptrain.demo"), description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="where the demo writes (replaced)")
    p.add_argument("--kv-heads", type=positive_int, default=2, help="K/V heads after conversion (of 8)")
    p.add_argument("--method", choices=METHODS, default="fit",
                   help="conversion method (fit: least squares with Q/O compensation; mean: the paper's)")
    p.add_argument("--grouping", choices=GROUPINGS, default="similar",
                   help="which query heads share a K/V head (similar: equal groups of the most alike heads)")
    p.add_argument("--calib-tokens", type=int, default=16384,
                   help="--method fit: calibration tokens from the training sample (0: weights only)")
    p.add_argument("--alpha-kd", type=float, default=1.0,
                   help="share of the distillation loss from the MHA source (0: plain LM uptraining)")
    p.add_argument("--skip-uptrain", action="store_true", help="only convert and evaluate")
    p.add_argument("--stories", type=positive_int, default=None, help="score only the first N held-out stories")
    p.add_argument("--valid", type=Path, default=VALID,
                   help="held-out text: stories separated by blank lines (default: the shipped TinyStories sample)")
    p.add_argument("--tasks", default="stories_cloze,stories_ending",
                   help="bundled lm-eval tasks to score every model on (needs uptrain[eval]); none: skip")
    p.add_argument("--task-limit", type=positive_int, default=50, help="items per task")
    p.add_argument("overrides", nargs="*", default=[], help="key=value overrides of configs/demo-cpu.yaml")
    args = p.parse_args(argv)
    source = EXAMPLES / "stories260K-mha8"
    if not source.is_dir():
        raise UsageError(f"{source} is missing; run the demo from a checkout of the repository")
    # Read as the trainer reads text (text_unit paragraph): one story per document, whole.
    valid = read_documents(DataSource(files=[str(args.valid)]), args.stories)
    torch.manual_seed(0)

    train_text = EXAMPLES / "data" / "tinystories-train-sample.txt"
    calibration = None
    if args.method == "fit" and args.calib_tokens > 0:
        from uptrain.convert.calibrate import Calibration

        calibration = Calibration(train_text, args.calib_tokens, "cpu")
    how = args.method + (f", {args.grouping} grouping" if args.grouping != "contiguous" else "") + (f", calibrated on {args.calib_tokens:,} tokens of {train_text.name}" if calibration else "")
    converted = args.out / f"stories260K-gqa{args.kv_heads}"
    print(f"== convert {source.relative_to(REPO)} to {args.kv_heads} K/V heads ({how})")
    convert(str(source), converted, args.kv_heads, args.method, force=True, calibration=calibration,
            grouping=args.grouping)
    rows = [("MHA source (8 K/V heads)", *held_out_loss(source, valid)),
            (f"GQA-{args.kv_heads}, converted ({args.method})", *held_out_loss(converted, valid))]

    if not args.skip_uptrain:
        from uptrain.train import train
        from uptrain.train.config import load_config
        run_dir = args.out / "uptrain"
        print(f"== uptrain with {CONFIG.relative_to(REPO)} into {run_dir}")
        data = EXAMPLES / "data"
        distill = [f"distill.teacher={source}", f"distill.alpha_kd={args.alpha_kd}"] if args.alpha_kd > 0 else []
        config = load_config(CONFIG, [f"model={converted}", f"run_dir={run_dir}", "overwrite=true",
                                      f"data.train.files=[{data / 'tinystories-train-sample.txt'}]",
                                      f"data.val.files=[{args.valid}]", *distill,
                                      *args.overrides])
        train(config)
        kd = f", distilled alpha_kd {args.alpha_kd}" if args.alpha_kd > 0 else ""
        rows.append((f"GQA-{args.kv_heads}, uptrained{kd}", *held_out_loss(run_dir / "model", valid)))

    base_kv = rows[0][3]
    table = [[name, f"{loss:.3f}", f"{ppl:.2f}", f"{kv:,} B", f"{base_kv / kv:.0f}x"] for name, loss, ppl, kv in rows]
    print(f"\nHeld-out loss on {_shown(args.valid)} ({len(valid)} stories, "
          f"512-token windows, stride 256):\n")
    print(format_table(["model", "loss (nats/token)", "perplexity", "KV cache / token", "KV reduction"], table))
    if args.tasks != "none":
        from uptrain.measure.tasks import parse_task_names, print_demo_scores

        paths = [source, converted] + ([] if args.skip_uptrain else [run_dir / "model"])
        print_demo_scores([r[0] for r in rows], [str(x) for x in paths], parse_task_names([args.tasks]), args.task_limit)
    return 0


if __name__ == "__main__":
    sys.exit(main())
