"""`--grouping similar --calib`: the head grouping measured among candidates against the similarity's best alone.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD .venv/bin/python scripts/studies/grouping_choice.py --json results/grouping-choice.json

Each conversion is `uptrain.convert SOURCE --kv-heads K --method fit --grouping similar --calib TEXT
--calib-tokens 16384 [--refine]` as the converter makes it, once with up to 3 candidate groupings
per layer measured on the calibration text (the default) and once with the similarity's best alone
(`--group-candidates 1`: the converter before the choice). Models, calibration
and held-out scoring as results/refine.md (`refine_study.setup`, `refine_study.loss`); CPU-s is the
conversion's process time (calibration, starts, the choice, refinement, writing).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "studies"))
from refine_study import loss, setup  # noqa: E402  (also puts scripts/paper and the repo on the path)

from uptrain.convert import convert  # noqa: E402
from uptrain.convert.layers.calibrate import Calibration  # noqa: E402
from uptrain.convert.layers.refine_layer import RefineSettings  # noqa: E402
from uptrain.measure.eval import load_model  # noqa: E402

COUNTS = {"stories": [2], "reference": [4, 2]}  # one K/V head is one group: nothing to choose


def one(s: dict, kv: int, refine: bool, candidates: int, out: Path) -> dict:
    """Convert with `candidates` groupings measured per layer; the held-out loss and what was chosen."""
    began = time.process_time()
    plan = convert(str(s["checkpoint"]), out, kv, "fit", grouping="similar", force=True,
                   calibration=Calibration(s["calib"], 16384), refine=RefineSettings() if refine else None,
                   group_candidates=candidates)
    cpu = time.process_time() - began
    model, tokenizer = load_model(str(out))
    choice = plan.grouping_choice or {}
    return {"kv_heads": kv, "refine": refine, "candidates": candidates, "loss": round(loss(model, tokenizer, s), 4),
            "cpu_s": round(cpu, 1), "moved_layers": sorted(i for i, c in choice.items() if c["chosen"]),
            "errors": {i: [round(e, 4) for e in c["errors"]] for i, c in choice.items()}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write the rows here")
    args = p.parse_args()
    torch.manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, counts in COUNTS.items():
            s = setup(name, Path(tmp))
            for kv in counts:
                for refine in (False, True):
                    for candidates in (1, 3):
                        row = {"model": name, **one(s, kv, refine, candidates, Path(tmp) / "out")}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    if args.json:
        args.json.write_text(json.dumps({"machine": f"{platform.machine()}, torch {torch.__version__}, "
                                                    f"{torch.get_num_threads()} thread(s)", "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
