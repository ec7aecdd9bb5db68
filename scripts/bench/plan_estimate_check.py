"""Does the plan's time bound hold? Real refining conversions, idle and under artificial load.

    python scripts/bench/plan_estimate_check.py --busy 0 2 4 --json SCRATCH/plan-estimate.jsonl

For each number of busy processes (`python -c "while True: pass"`, started by this script and
ended by it, by their ids), after `--settle` seconds for the load average to see them, each model
is converted as the issue's command does it:

    python -m uptrain.convert MODEL --kv-heads 2 --method fit --calib examples/data/tinystories-train-sample.txt \
        --calib-tokens 16384 --refine --out SCRATCH/... --force [--refine-steps N]

and the record (`uptrain_conversion.json`) gives the plan's bound (refinement.probe.bound_s: total,
calibration, refinement, printed in the plan's `calibration + refinement` row) and what the run took:
calibration.seconds + the refined layers' seconds_with_setup. The bound holds where actual / bound
<= 1.5 (issue 43). One row per conversion (markdown on stdout, JSON lines with --json); the load
average is read before and after each conversion.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODELS = [REPO / "examples" / "stories260K-mha8", REPO / "results" / "paper" / "reference-mha8"]
CALIB = REPO / "examples" / "data" / "tinystories-train-sample.txt"


def convert(model: Path, out: Path, tokens: int, steps: int | None) -> tuple[dict, float]:
    """One conversion through the CLI (its own choice of threads); (its record, wall seconds)."""
    cmd = [sys.executable, "-m", "uptrain.convert", str(model), "--kv-heads", "2", "--method", "fit", "--calib",
           str(CALIB), "--calib-tokens", str(tokens), "--refine", "--out", str(out), "--force"]
    cmd += ["--refine-steps", str(steps)] if steps else []
    began = time.monotonic()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    if done.returncode != 0:
        raise SystemExit(f"conversion failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    threads = next((x for x in done.stdout.splitlines() if x.startswith("CPU threads")), "")
    record = json.loads((out / "uptrain_conversion.json").read_text())
    record["threads_line"] = threads
    return record, time.monotonic() - began


def row(model: Path, busy: int, record: dict, wall: float, load: tuple[float, float]) -> dict:
    """What one conversion says: the plan's bound, the seconds it took, their ratio."""
    bound = record["refinement"]["probe"]["bound_s"]
    calibration = record["calibration"]["seconds"]
    refinement = sum(x["seconds_with_setup"] for x in record["refinement"]["layers"])
    actual = calibration + refinement
    return {"model": model.name, "busy": busy, "load_before": load[0], "load_after": load[1],
            "threads": record["threads_line"], "steps": record["refinement"]["steps"],
            "steps_run": sum(x["steps_run"] for x in record["refinement"]["layers"]),
            "bound_s": round(bound["total"], 2), "bound_calibration_s": round(bound["calibration"], 2),
            "bound_refinement_s": round(bound["refinement"], 2), "calibration_s": calibration,
            "refinement_s": round(refinement, 2), "actual_s": round(actual, 2),
            "actual_over_bound": round(actual / bound["total"], 3), "wall_s": round(wall, 1),
            # the bound from the probes' slowest runs instead of their windows' means (the first version)
            "bound_slowest_s": round(bound.get("total_from_slowest", float("nan")), 2),
            "actual_over_slowest": round(actual / bound.get("total_from_slowest", float("nan")), 3)}


def busy_processes(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--busy", type=int, nargs="+", default=[0, 2, 4], help="busy processes per round")
    p.add_argument("--settle", type=float, default=60.0, help="seconds between starting the load and converting")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--steps", type=int, default=None, help="--refine-steps (default: the converter's)")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--json", type=Path, help="append one JSON line per conversion")
    args = p.parse_args()
    models = [m for m in MODELS if (m / "config.json").is_file()]
    print("| model | busy procs | load before / after | threads | steps run | bound s (calib + refine) "
          "| actual s (calib + refine) | actual / bound | bound from the slowest runs s | actual / it |\n"
          "|---|---|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        for busy in args.busy:
            procs = busy_processes(busy)
            try:
                time.sleep(args.settle if busy else 0)
                for _ in range(args.repeat):
                    for model in models:
                        before = os.getloadavg()[0]
                        record, wall = convert(model, Path(scratch) / model.name, args.tokens, args.steps)
                        r = row(model, busy, record, wall, (before, os.getloadavg()[0]))
                        print(f"| {r['model']} | {busy} | {r['load_before']:.1f} / {r['load_after']:.1f} | "
                              f"{r['threads'].split('(')[0].removeprefix('CPU threads: ').strip()} | {r['steps_run']} | "
                              f"{r['bound_s']} ({r['bound_calibration_s']} + {r['bound_refinement_s']}) | "
                              f"{r['actual_s']} ({r['calibration_s']} + {r['refinement_s']}) | "
                              f"{r['actual_over_bound']} | {r['bound_slowest_s']} | {r['actual_over_slowest']} |",
                              flush=True)
                        if args.json:
                            with args.json.open("a") as f:
                                f.write(json.dumps(r) + "\n")
            finally:
                for proc in procs:
                    proc.kill()
                    proc.wait()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
