"""Time `--refine` against the calibration pass of the same conversion; numbers for results/refine-speed.md.

    # from a checkout of the code to time (its `uptrain/` is imported: a `git worktree` of an older
    # commit times that commit's refinement), the converter's own arguments after `--`:
    cd CHECKOUT && python /path/to/scripts/bench/refine_speed.py --json rows.jsonl --tag new-s2 \
        --eval-data examples/data/tinystories-valid-sample.txt -- \
        examples/stories260K-mha8 --kv-heads 2 --method fit --grouping similar \
        --calib examples/data/tinystories-train-sample.txt --calib-tokens 16384 --refine --out SCRATCH/r2 --force

Runs `python -m uptrain.convert ARGS` in this process with two timers around the code it runs:
every `refine.refine_attention` call (wall and this process's CPU seconds) and the calibration
calls that add to the record's calibration seconds (`Calibration._start` and the method that runs
the next layer). Then, with --eval-data, `python -m uptrain.eval OUT --data FILE` in a child
process, and one JSON line per run: both times, their ratio, steps, per-layer held-out errors,
held-out loss, load average.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _timed(owner, name: str, into: dict) -> None:
    real = getattr(owner, name)

    def wrapped(*args, **kwargs):
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            into["wall"] += time.perf_counter() - wall
            into["cpu"] += time.process_time() - cpu
    setattr(owner, name, wrapped)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tag", default="run")
    p.add_argument("--json", type=Path, help="append the row (one JSON line) to this file")
    p.add_argument("--eval-data", help="score the output with `python -m uptrain.eval OUT --data FILE`")
    p.add_argument("convert", nargs=argparse.REMAINDER, help="-- then the converter's arguments")
    args = p.parse_args()
    argv = args.convert[1:] if args.convert[:1] == ["--"] else args.convert
    sys.path.insert(0, os.getcwd())  # the checkout being timed, not an installed copy
    import torch

    import uptrain
    from uptrain.convert.__main__ import main as convert_main
    from uptrain.convert.layers import calibrate
    from uptrain.convert.math import refine

    refined, calibrated = {"wall": 0.0, "cpu": 0.0}, {"wall": 0.0, "cpu": 0.0}
    _timed(refine, "refine_attention", refined)  # refine_layer calls it through the module
    for name in ("_start", "run_next", "_advance"):  # what adds to the record's calibration seconds
        if hasattr(calibrate.Calibration, name):
            _timed(calibrate.Calibration, name, calibrated)
    if convert_main(argv) != 0:
        return 1
    out = Path(argv[argv.index("--out") + 1])
    record = json.loads((out / "uptrain_conversion.json").read_text())
    layers = record["refinement"]["layers"]
    row = dict(tag=args.tag, code=str(Path(uptrain.__file__).parents[1]), argv=argv,
               refine_wall=round(refined["wall"], 2), refine_cpu=round(refined["cpu"], 2),
               calib_wall=round(calibrated["wall"], 2), calib_cpu=round(calibrated["cpu"], 2),
               ratio_wall=round(refined["wall"] / max(calibrated["wall"], 1e-9), 1),
               ratio_cpu=round(refined["cpu"] / max(calibrated["cpu"], 1e-9), 1),
               steps=[x["steps_run"] for x in layers], errors=[round(x["error_after"], 4) for x in layers],
               load=os.getloadavg()[0], threads=torch.get_num_threads())
    if args.eval_data:
        res = subprocess.run([sys.executable, "-m", "uptrain.eval", str(out), "--data", args.eval_data],
                             capture_output=True, text=True, check=True)
        row["loss"] = float(next(line for line in res.stdout.splitlines() if line.startswith(f"| {out}")).split("|")[2])
    print(json.dumps(row))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
