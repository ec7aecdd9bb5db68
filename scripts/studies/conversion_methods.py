"""Measure conversion methods at alpha = 0 (no uptraining) and write results/conversion-methods.md.

    PYTHONPATH=$PWD .venv/bin/python scripts/studies/conversion_methods.py [--only stories|reference]

Part 1, stories260K-mha8 (examples/): kv 2 and 1, scored on examples/data/tinystories-valid-sample.txt
(512-token windows, stride 256, as the README's demo table); fit+calib calibrated on the first 16,384
tokens of examples/data/tinystories-train-sample.txt.
Part 2, results/paper/reference-mha8: kv 4, 2 and 1, mean / fit / fit+calib with contiguous grouping
only (time: the machine is 2 shared CPU cores), scored on the first DOCS documents of the paper
reproduction's held-out split (complete Shakespeare + KJV, last 5% of each, scripts/paper/prepare.py;
each document about 2,000 characters), 256-token windows, stride 192 (as scripts/paper/run.py);
fit+calib calibrated on the first 16,384 tokens of its train split.
Everything is deterministic (no sampling; grouping and fit are deterministic): seed not used.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "paper"))

from uptrain.measure.methods import VARIANTS, compare_methods, markdown  # noqa: E402

SHARED = REPO.parent / "shared" / "data"
DOCS = 12


def stories():
    texts = [t for t in (REPO / "examples/data/tinystories-valid-sample.txt").read_text().splitlines() if t.strip()]
    return compare_methods(str(REPO / "examples/stories260K-mha8"), [2, 1], texts, 512, 256,
                           REPO / "examples/data/tinystories-train-sample.txt", 16384)


def reference(tmp: Path):
    from prepare import split_corpora  # scripts/paper/prepare.py: the paper reproduction's split
    split_corpora(SHARED / "corpora", tmp, val_share=0.05)
    texts = [json.loads(line)["text"] for line in (tmp / "val.jsonl").read_text().splitlines()][:DOCS]
    variants = tuple(v for v in VARIANTS if v[0] != "first")
    return compare_methods(str(REPO / "results/paper/reference-mha8"), [4, 2, 1], texts, 256, 192,
                           tmp / "train.jsonl", 16384, variants=variants, groupings=("contiguous",))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", choices=["stories", "reference"])
    p.add_argument("--report-only", action="store_true", help="rewrite the .md from the JSON files")
    args = p.parse_args()
    if args.report_only:
        return write_report(REPO / "results")
    torch.set_num_threads(2)
    out = REPO / "results"
    parts = {}
    if args.only in (None, "stories"):
        parts["stories"] = stories()
    if args.only in (None, "reference"):
        with tempfile.TemporaryDirectory() as tmp:
            parts["reference"] = reference(Path(tmp))
    for name, (source, rows) in parts.items():
        (out / f"conversion-methods-{name}.json").write_text(json.dumps(
            {"original": source, "rows": [r.__dict__ for r in rows],
             "machine": f"2 CPU cores, shared with other jobs ({platform.machine()})",
             "torch": torch.__version__}, indent=2) + "\n")
        print(f"\n## {name}\n\n{markdown(source, rows)}")
    write_report(out)


TITLES = {
    "stories": ("stories260K-mha8 (examples/; 8 heads, head_dim 8, 5 layers), scored on "
                "examples/data/tinystories-valid-sample.txt (19 stories, 15,507 tokens, 512-token windows, "
                "stride 256); fit+calib: 16,384 tokens of examples/data/tinystories-train-sample.txt"),
    "reference": ("results/paper/reference-mha8 (8 heads, head_dim 32, 4 layers, 4.2M parameters), scored on the "
                  f"first {DOCS} documents of the paper reproduction's held-out split (Shakespeare + KJV, last 5% of each; "
                  f"the first {DOCS} are all from the Shakespeare part, about 2,000 characters each; "
                  "256-token windows, stride 192); fit+calib: 16,384 tokens of its train split; contiguous "
                  "grouping only, no `first` (time)"),
}


def write_report(out: Path) -> None:
    """results/conversion-methods.md from the JSON files of the parts measured so far."""
    from uptrain.measure.methods import Row
    parts = []
    for name, title in TITLES.items():
        f = out / f"conversion-methods-{name}.json"
        if f.is_file():
            data = json.loads(f.read_text())
            parts.append(f"## {title}\n\n{markdown(data['original'], [Row(**r) for r in data['rows']])}\n")
    (out / "conversion-methods.md").write_text(f"""# Conversion methods at alpha = 0 (no uptraining)

Held-out loss (nats/token, `uptrain.measure.eval`) of each conversion, straight after converting.
"gap closed" = (mean - method) / (mean - original), with mean = mean pooling, contiguous grouping
(the GQA paper's conversion). Methods: `mean` / `first` (the paper), `fit` (least-squares fit with
compensation in Q and O, Σ = I), `fit+calib` (Σ from calibration text). Grouping: `contiguous`
(transformers' order) or `similar` (equal groups of alike heads, q/o permuted to match).

Machine: 2 CPU cores, shared with other jobs; torch {torch.__version__}, float32. Deterministic
(no sampling; grouping and fit are deterministic), so no seed. Command (from the repository root):

```bash
PYTHONPATH=$PWD .venv/bin/python scripts/studies/conversion_methods.py              # both parts
PYTHONPATH=$PWD .venv/bin/python scripts/studies/conversion_methods.py --only stories
PYTHONPATH=$PWD .venv/bin/python scripts/studies/conversion_methods.py --only reference
# the same bake-off on any checkpoint:
python -m uptrain.measure.methods examples/stories260K-mha8 --kv-heads 2 1 \\
    --eval-data examples/data/tinystories-valid-sample.txt \\
    --calib examples/data/tinystories-train-sample.txt --calib-tokens 16384
```

""" + "\n".join(parts) + FINDINGS)


FINDINGS = """
## Findings

- `fit` beats `mean` at every K/V head count measured, on both models; calibration helps more
  the fewer K/V heads remain (stories260K MQA: 3.604 -> 3.017).
- Best of each, share of mean pooling's gap to the original closed: stories260K GQA-2 78%
  (fit+calib, similar), MQA 64% (fit+calib); reference-mha8 GQA-4 91%, GQA-2 86%, MQA 83%.
- `similar` grouping helps every method at 2 K/V heads on stories260K (most for `first`); at 1 K/V
  head there is one group, so grouping cannot matter (equal rows are expected, not a bug).
- On stories260K `first` beats `mean` at 2 K/V heads (the paper's T5 ablation ranks mean above
  first) but is worse than `mean` for MQA.
"""


if __name__ == "__main__":
    main()
