"""Bake-off of conversion methods: held-out loss at alpha = 0 of every method and grouping.

`python -m uptrain.measure.methods CKPT --kv-heads 2 1 --eval-data FILE [--calib FILE]`

Converts CKPT with mean / first / fit (weights only) / fit calibrated on --calib, each with
contiguous and similar grouping, into temporary folders (small models: everything stays on this
machine, nothing is kept), and scores each beside the original with `uptrain.measure.eval`.

Why here and not `python -m uptrain.convert --compare-methods`: the bake-off needs the evaluation
(measure), and convert must not import measure (arrows point down: measure uses convert).
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from uptrain.cli import ArgParser, positive_int, prog_name, write_json
from uptrain.convert import convert
from uptrain.convert.layers.calibrate import Calibration
from uptrain.convert.registry.choices import GROUPINGS, METHODS
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.data import DataSource, read_documents
from uptrain.measure.eval import evaluate, load_model, tokenize_texts
from uptrain.threads import add_threads_arg, announce_threads, start_threads

# (label, method, uses calibration): every method of the converter but random (at alpha = 0 a
# random K/V start is no contender), and fit once more calibrated on --calib text
VARIANTS: tuple[tuple[str, str, bool], ...] = (
    *((m, m, False) for m in METHODS if m != "random"), ("fit+calib", "fit", True))


@dataclass
class Row:
    kv_heads: int
    method: str
    grouping: str
    loss: float
    gap_closed: float | None  # share of mean pooling's (same grouping: contiguous) gap to the original closed
    seconds: float


def _loss(folder: str, texts: Sequence[str], max_length: int, stride: int, device: str) -> float:
    model, tokenizer = load_model(folder, device=device)
    return evaluate(model, tokenize_texts(tokenizer, texts), max_length, stride, name=folder).loss


def compare_methods(checkpoint: str, kv_heads: Sequence[int], texts: Sequence[str], max_length: int,
                    stride: int, calib: Path | None = None, calib_tokens: int = 32768, device: str = "cpu",
                    variants: Sequence[tuple[str, str, bool]] = VARIANTS, groupings: Sequence[str] = GROUPINGS,
                    log=print) -> tuple[float, list[Row]]:
    """(loss of the original, one Row per kv-heads x variant x grouping).

    Each calibrated conversion gets a Calibration of its own: one hands each layer's moments out
    once (then forgets them, to bound memory), so it serves a single conversion.
    """
    calibration = Calibration(calib, calib_tokens, device) if calib else None  # checks the file now
    source = _loss(checkpoint, texts, max_length, stride, device)
    log(f"original: {source:.4f}")
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="uptrain-methods-") as tmp:
        for kv in kv_heads:
            mean_loss = None
            for label, method, calibrated in variants:
                if calibrated and calibration is None:
                    continue
                for grouping in groupings:
                    start = time.perf_counter()
                    out = Path(tmp) / f"kv{kv}-{label}-{grouping}"
                    fresh = Calibration(calib, calib_tokens, device) if calibrated and calib else None
                    convert(checkpoint, out, kv, method, grouping=grouping, calibration=fresh)
                    loss = _loss(str(out), texts, max_length, stride, device)
                    if label == "mean" and grouping == "contiguous":
                        mean_loss = loss
                    gap = None if mean_loss is None or mean_loss == source else (mean_loss - loss) / (mean_loss - source)
                    rows.append(Row(kv, label, grouping, loss, gap, round(time.perf_counter() - start, 1)))
                    log(f"kv {kv} {label:9} {grouping:10} {loss:.4f}")
    return source, rows


def markdown(source: float, rows: Sequence[Row]) -> str:
    """The results table: loss per method and grouping, and the share of mean pooling's gap closed."""
    lines = ["| K/V heads | method | grouping | held-out loss | gap to original closed vs mean (contiguous) |",
             "|---|---|---|---|---|", f"| (original) | — | — | {source:.3f} | — |"]
    for r in rows:
        gap = "—" if r.gap_closed is None else f"{round(100 * r.gap_closed)}%"  # int: no "-0%"
        lines.append(f"| {r.kv_heads} | {r.method} | {r.grouping} | {r.loss:.3f} | {gap} |")
    return "\n".join(lines)


@exit_on_usage_error
def main(argv: Sequence[str] | None = None) -> int:
    p = ArgParser(prog=prog_name("uptrain.measure.methods"), description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="local MHA (or GQA) checkpoint folder")
    p.add_argument("--kv-heads", type=positive_int, nargs="+", required=True, help="K/V head counts to convert to")
    p.add_argument("--eval-data", type=Path, nargs="+", required=True, metavar="FILE",
                   help="held-out text (.txt: documents separated by blank lines; .jsonl, ...), read like `uptrain.eval --data`")
    p.add_argument("--max-documents", type=positive_int, help="score only the first N documents")
    p.add_argument("--calib", type=Path, help="calibration text for the fit+calib rows (omitted without it)")
    p.add_argument("--calib-tokens", type=positive_int, default=32768, help="calibration tokens")
    p.add_argument("--max-length", type=positive_int, default=512, help="evaluation window (tokens)")
    p.add_argument("--stride", type=positive_int, default=256, help="evaluation stride (tokens)")
    p.add_argument("--device", default="cpu", help="torch device for calibration and evaluation")
    add_threads_arg(p, "conversion, calibration and evaluation")
    p.add_argument("--json", metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args(argv)
    start_threads(args.threads)
    for f in args.eval_data:
        if not f.is_file():
            raise UsageError(f"--eval-data file {f} does not exist")
    texts = read_documents(DataSource(files=[str(f) for f in args.eval_data]), args.max_documents, field_option=None)
    announce_threads()
    source, rows = compare_methods(args.checkpoint, args.kv_heads, texts, args.max_length, args.stride,
                                   args.calib, args.calib_tokens, args.device)
    print(markdown(source, rows))
    if args.json:
        write_json({"original": source, "rows": [asdict(r) for r in rows]}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
