"""What converting a sweep's K/V counts together saves: one conversion per count vs `convert_counts`.

    python scripts/bench/bench_sweep.py MODEL --calib FILE [--calib-tokens 2048] [--counts 8,4,2]
        [--method fit] [--refine-steps 0] [--out runs/bench-sweep] [--json results/....json]

For each count alone (`uptrain.convert.convert`, a fresh calibration each) and then for all counts
together (`uptrain.convert.several.convert_counts`, one calibration), it records the wall time, the
calibration passes and layers run, and the bytes read from the source through the converter's
reads (`SourceCheckpoint.read`, counted around the real read). Both write the same folders
(`tests/convert/test_several.py`). MODEL needs a tokenizer (the calibration tokenizes its text).
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "tools"))  # shown.py

from uptrain.convert import convert  # noqa: E402
from uptrain.convert.io.source import SourceCheckpoint  # noqa: E402
from uptrain.convert.layers.calibrate import Calibration  # noqa: E402
from uptrain.convert.layers.refine_layer import RefineSettings  # noqa: E402
from uptrain.convert.several import convert_counts  # noqa: E402
from shown import shown_command  # noqa: E402  (scripts/tools/shown.py: paths as results/ names them)

READ_BYTES = [0]


def _counting_reads() -> None:
    real = SourceCheckpoint.read

    def read(self, info):
        READ_BYTES[0] += info.nbytes
        return real(self, info)
    SourceCheckpoint.read = read


def _run(label: str, work) -> dict:
    READ_BYTES[0] = 0
    began = time.perf_counter()
    calibrations = work()
    wall = time.perf_counter() - began
    row = {"run": label, "wall_s": round(wall, 2), "read_bytes": READ_BYTES[0],
           "calibration_passes": sum(c.record["passes"] for c in calibrations),
           "layers_run": sum(c.record.get("layers_run", 0) for c in calibrations),
           "calibration_s": round(sum(c.record.get("seconds", 0) for c in calibrations), 2)}
    print(json.dumps(row), flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--calib", required=True)
    p.add_argument("--calib-tokens", type=int, default=2048)
    p.add_argument("--counts", default="8,4,2")
    p.add_argument("--method", default="fit")
    p.add_argument("--refine-steps", type=int, default=0, help="0: no --refine")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    p.add_argument("--out", type=Path, default=Path("runs/bench-sweep"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    counts = [int(c) for c in args.counts.split(",")]
    refine = RefineSettings(steps=args.refine_steps) if args.refine_steps else None
    _counting_reads()
    shutil.rmtree(args.out, ignore_errors=True)

    def alone() -> list[Calibration]:
        made = []
        for n in counts:
            made.append(Calibration(args.calib, args.calib_tokens))
            convert(args.model, args.out / f"alone-kv{n}", n, args.method, calibration=made[-1], refine=refine)
        return made

    def together() -> list[Calibration]:
        calibration = Calibration(args.calib, args.calib_tokens)
        convert_counts(args.model, {n: args.out / f"kv{n}" for n in counts}, args.method, calibration=calibration,
                       refine=refine)
        return [calibration]
    rows = [_run("one conversion per count", alone), _run("all counts together", together)]
    shutil.rmtree(args.out, ignore_errors=True)
    result = {"command": shown_command(["python", "scripts/bench/bench_sweep.py", *(argv or sys.argv[1:])]),
              "machine": f"{platform.machine()}, {torch.get_num_threads()} torch threads, {platform.platform()}",
              "date": time.strftime("%Y-%m-%d"), "counts": counts, "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
