"""Where the test suite's CPU goes: a pytest plugin that records each test's CPU seconds, and a summary.

    PYTHONPATH=scripts/bench SUITE_CPU_OUT=runs/suite-cpu.jsonl bash scripts/test.sh -p suite_cpu
    python scripts/bench/suite_cpu.py runs/suite-cpu.jsonl [--top 25]

Each test appends one JSON line: its CPU seconds in the test process (`self`: user + system) and in
the child processes it waited for (`child`: every real process it ran, with theirs), its wall time
and its pytest-xdist worker. The suite runs on 3 workers and 2 cores, so its time is set by the CPU
total, not by the sum of the walls. Processes a test does not wait for (Slurm jobs, which slurmd
runs) are not counted. The summary prints the total and the files with the most CPU.

The same suite's CPU moves with the machine by far more than with a change to it (one session measured
start-ups of 4.4-5 CPU-s, the next 7.2-7.8), so the plugin also times a reference start-up, `START_UP`,
the import every model-loading process the suite starts pays, once before the first test and once after
the last (in the controller, while no test runs: ~12 s more wall). The summary gives the total in
start-ups too, a figure to compare between days.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import time

import pytest

OUT = os.path.abspath(os.environ.get("SUITE_CPU_OUT", "suite-cpu.jsonl"))  # where pytest started, whatever a test's cwd


def _cpu() -> tuple[float, float]:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, children.ru_utime + children.ru_stime


START_UP = "import torch, transformers; from transformers import LlamaForCausalLM"


def reference_start_up() -> float:
    """CPU seconds (user + system) of a fresh Python process running `START_UP`."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", START_UP], check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _record_start_up(when: str) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # the controller (or a run without workers)
        os.makedirs(os.path.dirname(OUT), exist_ok=True)
        with open(OUT, "a") as f:
            f.write(json.dumps({"reference_start_up_cpu_s": reference_start_up(), "when": when}) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session):
    _record_start_up("before the tests")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    _record_start_up("after the tests")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    (own0, children0), start = _cpu(), time.monotonic()
    yield
    own1, children1 = _cpu()
    with open(OUT, "a") as f:
        f.write(json.dumps({"id": item.nodeid, "self": own1 - own0, "child": children1 - children0,
                            "wall": time.monotonic() - start, "worker": os.environ.get("PYTEST_XDIST_WORKER", "")}) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/bench/suite_cpu.py", description=__doc__.splitlines()[0])
    p.add_argument("jsonl", help="the file SUITE_CPU_OUT named")
    p.add_argument("--top", type=int, default=25, help="how many files to list")
    args = p.parse_args(argv)
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0.0, 0])
    start_ups = []
    with open(args.jsonl) as f:
        for line in f:
            row = json.loads(line)
            if "reference_start_up_cpu_s" in row:
                start_ups.append(row["reference_start_up_cpu_s"])
                continue
            total = files[row["id"].split("::")[0]]
            total[0] += row["self"]
            total[1] += row["child"]
            total[2] += row["wall"]
            total[3] += 1
    cpu = sum(t[0] + t[1] for t in files.values())
    print(f"{sum(int(t[3]) for t in files.values())} tests, {cpu:.0f} CPU-s (tests' own + their processes')")
    if start_ups:
        mean = sum(start_ups) / len(start_ups)
        print(f"reference start-up ({START_UP}): {' and '.join(f'{s:.2f}' for s in start_ups)} CPU-s, "
              f"so the suite is {cpu / mean:.0f} start-ups")
    print("| CPU-s | own | processes' | wall s | tests | file |\n|---|---|---|---|---|---|")
    for name, (own, child, wall, n) in sorted(files.items(), key=lambda kv: -(kv[1][0] + kv[1][1]))[:args.top]:
        print(f"| {own + child:.1f} | {own:.1f} | {child:.1f} | {wall:.1f} | {n} | {name} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
