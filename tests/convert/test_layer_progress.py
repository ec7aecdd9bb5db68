"""A line per layer converted, with the layers done and the time left: `uptrain.convert.progress`,
printed by `python -m uptrain.convert` on the layer-at-a-time path in the demo's format."""

from __future__ import annotations

import re

import pytest

from conftest import EXAMPLE_MHA8, TRAIN_TXT
from uptrain.convert.__main__ import main
from uptrain.convert.progress import layer_progress, progress_line

LINE = re.compile(r"^(?P<what>.*) \[(?P<k>\d+)/(?P<n>\d+) layers, ~\d+ s left\]$")


def test_each_call_is_one_more_layer_and_the_time_left_is_extrapolated():
    lines: list[str] = []
    log = layer_progress(4, lines.append)
    for i in range(4):
        log(f"layer {i}")
    assert [LINE.match(x)["k"] for x in lines] == ["1", "2", "3", "4"]
    assert lines[-1].endswith("[4/4 layers, ~0 s left]")
    assert progress_line("layer 0", 1, 4, 10.0) == "layer 0 [1/4 layers, ~30 s left]"
    assert progress_line("x", 2, 4, 10.0, indent="   ") == "   x [2/4 layers, ~10 s left]"


def test_layers_kept_by_an_interrupted_run_count_as_done_but_not_in_the_rate(monkeypatch):
    """A rerun takes its kept layers in moments: were they in the rate, the time left would be a
    fraction of the truth. The clock starts after the last kept layer; the rate counts made layers."""
    clock = [100.0]
    monkeypatch.setattr("uptrain.convert.progress.time.monotonic", lambda: clock[0])
    lines: list[str] = []
    log = layer_progress(6, lines.append)
    log.begin()
    for i in range(3):
        clock[0] += 0.1
        log.kept(f"layer {i} kept")
    clock[0] += 10.0
    log("layer 3 made")
    assert lines[:3] == ["layer 0 kept [1/6 layers]", "layer 1 kept [2/6 layers]", "layer 2 kept [3/6 layers]"]
    assert lines[3] == "layer 3 made [4/6 layers, ~20 s left]"  # 10 s a made layer, 2 left


@pytest.mark.parametrize(("argv", "what"), [
    (["--method", "fit"], r"layer \d converted \(fit\)"),
    (["--refine", "--refine-steps", "2"], r"refine layer \d: held-out error [\d.]+ -> [\d.]+ \(\d+ steps, [\d.]+ s\); "
                                          r"(within the plan \(.*\)|slower than planned: .*)"),
])
def test_convert_prints_a_line_per_layer_with_the_time_left(argv, what, tmp_path, capsys, one_torch_thread):
    assert main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--calib", str(TRAIN_TXT), "--calib-tokens", "600", *argv,
                 "--out", str(tmp_path / "out")]) == 0
    found = [m for line in capsys.readouterr().out.splitlines() if (m := LINE.match(line))]
    assert [(m["k"], m["n"]) for m in found] == [(str(k), "5") for k in range(1, 6)]
    assert all(re.fullmatch(what, m["what"]) for m in found), [m["what"] for m in found]


def test_a_plain_conversion_prints_no_layer_lines(tmp_path, capsys):
    """Pooling without --calib is tensor by tensor, seconds long: no per-layer lines."""
    assert main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--out", str(tmp_path / "out")]) == 0
    assert "layers, ~" not in capsys.readouterr().out


def _timed_lines(command: list[str], env: dict) -> list[tuple[float, str]]:
    """Each stdout line of `command` with the time it came (seconds from the start)."""
    import os
    import subprocess
    import sys
    import time

    from conftest import REPO

    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "uptrain.convert", *command], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env})
    lines = [(time.monotonic() - began, line.rstrip("\n")) for line in proc.stdout]
    assert proc.wait(timeout=300) == 0
    return lines


# The phases of a layer that have no steps to count, each made to last 3 s by its pause hook (at 7B
# width on a CPU they last minutes: 109-127 s before the first refinement line, 290-320 s after the
# last, silent, before this): a line at least every `UPTRAIN_PROGRESS_EVERY` seconds, naming it.
PHASES = {"start": "layer 1: the closed-form start (fit)", "inputs": "refine layer 1: the student and its inputs",
          "solve": "refine layer 1: the output solve"}


@pytest.mark.parametrize("pause", sorted(PHASES))
def test_no_phase_of_a_layer_is_silent(tmp_path, pause):
    every = 0.25
    argv = [str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT), "--calib-tokens",
            "2048", "--refine", "--refine-steps", "30", "--threads", "1", "--out", str(tmp_path / "out")]
    # pause once, at the phase's first moment in layer 0 (the hook pauses at its first occurrence),
    # and wait until layer 1 to look: "layer 1" is named below because the pause is skipped there
    lines = _timed_lines(argv, {"UPTRAIN_PROGRESS_EVERY": str(every), "UPTRAIN_TEST_PAUSE_AT": f"{pause}:3"})
    said = [t for t, line in lines if line.strip().startswith(PHASES[pause].replace("layer 1", "layer 0"))
            and "still working" in line]
    assert len(said) >= 3, [line for _, line in lines]  # 3 s of pause: a line every ~0.25 s
    layers = [t for t, line in lines if LINE.match(line.strip())]
    gaps = [b - a for (a, _), (b, _) in zip(lines, lines[1:]) if layers[0] - 5 <= a <= layers[-1]]
    assert max(gaps) < every + 1.0, max(gaps)  # (slack for a loaded machine; without the heartbeat: 3 s)


def test_a_layer_that_stops_early_says_so_at_once(tmp_path):
    """Before: the last line read "step 200/400 ... ~361 s left in this layer" while the layer had
    stopped early and gone on to its output solve. An lr far too high makes every layer stop early."""
    argv = [str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT), "--calib-tokens",
            "2048", "--refine", "--refine-steps", "400", "--refine-lr", "3", "--threads", "1", "--out", str(tmp_path / "o")]
    lines = [line for _, line in _timed_lines(argv, {"UPTRAIN_PROGRESS_EVERY": "100"})]
    done = [re.search(r"refine layer (\d+): held-out error \S+ -> \S+ \((\d+) steps", line) for line in lines]
    early = {m[1] for m in done if m and int(m[2]) < 400}
    assert early, lines
    for layer in early:
        at = next(i for i, m in enumerate(done) if m and m[1] == layer)
        assert re.match(rf"refine layer {layer}: stopped early at step \d+/400 .*the output solve", lines[at - 1]), lines


AGAINST = re.compile(r"refine layer (\d): .*; slower than planned: at this pace up to ([\d.]+) s, ([\d.]+)x the "
                     r"plan's ([\d.]+) s; load [\d.]+ when planned, [\d.]+ now \[")


def test_a_run_slower_than_its_plan_says_so_on_the_layer_line(tmp_path):
    """The plan's bound assumes the machine stays as it was while planning. Here layer 0 is held 6 s
    after planning (the hook at its inputs: as if the load rose mid-run), far over the bound of a
    30-step refinement: its line must say the run is slower than planned, by how much, with the
    loads. Red with `_against_plan` returning ''."""
    argv = [str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT), "--calib-tokens",
            "2048", "--refine", "--refine-steps", "30", "--threads", "1", "--out", str(tmp_path / "out")]
    lines = [line for _, line in _timed_lines(argv, {"UPTRAIN_PROGRESS_EVERY": "100", "UPTRAIN_TEST_PAUSE_AT": "inputs:6"})]
    bound = next(line for line in lines if line.startswith("calibration + refinement"))
    assert re.search(r"load [\d.]+ on \d+ CPUs\), assuming it stays so", bound), bound
    first = next(m for line in lines if (m := AGAINST.search(line)))
    assert first[1] == "0", lines
    projected, ratio, planned = float(first[2]), float(first[3]), float(first[4])
    assert projected > planned and ratio > 1.0 and projected >= 6.0, first[0]  # the 6 s are in it
