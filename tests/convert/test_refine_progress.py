"""Progress inside a layer (issue 43: a conversion a user can follow and stop): `refine_attention`'s
progress callback, the CLI's `refine layer k: step ...` and `calibrate layer k: sequence ...` lines,
and a stop signal landing inside a refinement's step loop or a calibration pass."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from torch import nn

from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT
from test_convert_interrupt import CODES, _assert_clean_stop, _snapshot
from uptrain.convert.__main__ import main
from uptrain.convert.math.refine import RefineProgress, refine_attention

LAYER_LINE = re.compile(r"^(?P<what>.*) \[(?P<k>\d+)/(?P<n>\d+) layers, ~\d+ s left\]$")
STEP = re.compile(r"^refine layer (\d): step (\d+)/(\d+), held-out error [\d.]+, ~\d+ s left in this layer$")
SEQUENCE = re.compile(r"^calibrate (layer \d|embedding): sequence (\d+)/(\d+), ~\d+ s left in this layer$")


class Tiny(nn.Module):
    """A stand-in attention: x [T, 8] -> o(tanh(v(x))) [T, 8]."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.v, self.o = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(torch.tanh(self.v(x)))


def _refine(every: float, steps: int = 30, **options) -> tuple[list[RefineProgress], object]:
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(16 + i, 8, generator=gen) for i in range(8)]
    with torch.no_grad():
        teacher = Tiny(1)
        targets = [teacher(x) for x in inputs]
    seen: list[RefineProgress] = []
    result = refine_attention(Tiny(2), lambda m, x, i: m(x), inputs, targets, steps=steps, eval_every=10,
                              patience=100, min_holdout_tokens=1, progress=seen.append, progress_every=every,
                              **options)
    return seen, result


def test_the_progress_callback_reports_each_step_with_a_sane_time_left():
    seen, result = _refine(every=0.0)
    assert [p.step for p in seen] == list(range(1, result.steps_run + 1)) and result.steps_run == 30
    assert all(p.steps == 30 for p in seen)
    assert all(b.seconds >= a.seconds > 0 for a, b in zip(seen, seen[1:]))
    for p in seen:  # the steps left x the mean seconds per step so far
        assert p.seconds_left == pytest.approx((p.steps - p.step) * p.seconds / p.step, rel=1e-9), p
    assert seen[-1].seconds_left == 0
    assert seen[len(seen) // 2].seconds_left < seen[0].seconds_left * 30  # shrinks as steps are done
    measured = [(p.step, p.held_out_error) for p in seen if p.measured]
    assert measured == result.history  # each held-out measurement, with its error
    assert all(p.best_error <= p.held_out_error or not p.measured for p in seen)
    assert seen[0].held_out_error == pytest.approx(result.error_before)  # before the first: the start's


def test_the_progress_callback_is_called_at_most_every_n_seconds_and_at_each_measurement():
    seen, result = _refine(every=1e9)
    assert [p.step for p in seen] == [s for s, _ in result.history] == [10, 20, 30]
    assert all(p.measured for p in seen)
    none, _ = _refine(every=0.0, steps=0)  # no descent, no call
    assert none == []


@pytest.mark.parametrize("every", ["0", None])
def test_the_cli_prints_lines_inside_each_layer(every, tmp_path, capsys, monkeypatch, one_torch_thread):
    """UPTRAIN_PROGRESS_EVERY=0: a line per refine step and per calibration sequence, beside the per-layer
    lines, which stay as they were; by default (10 s) none on a model whose layers take a second."""
    if every is None:
        monkeypatch.delenv("UPTRAIN_PROGRESS_EVERY", raising=False)
    else:
        monkeypatch.setenv("UPTRAIN_PROGRESS_EVERY", every)
    assert main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--calib", str(TRAIN_TXT), "--calib-tokens", "600",
                 "--refine", "--refine-steps", "3", "--out", str(tmp_path / "out")]) == 0
    lines = capsys.readouterr().out.splitlines()
    layers = [m for line in lines if (m := LAYER_LINE.match(line))]
    assert [(m["k"], m["n"]) for m in layers] == [(str(k), "5") for k in range(1, 6)]
    steps = [m.groups() for line in lines if (m := STEP.match(line))]
    sequences = [m.groups() for line in lines if (m := SEQUENCE.match(line))]
    if every is None:
        assert steps == [] and sequences == []
        return
    assert steps == [(str(layer), str(s), "3") for layer in range(5) for s in (1, 2, 3)]
    total = sequences[0][2]
    assert [(w, k) for w, k, n in sequences if n == total and w.startswith("layer")] == \
        [(f"layer {layer}", str(k)) for layer in range(5) for k in range(1, int(total) + 1)]
    assert ("embedding", "1", total) in sequences
    first_step = next(i for i, line in enumerate(lines) if STEP.match(line))
    assert SEQUENCE.match(lines[first_step - 1]), "layer 0 is calibrated before it is refined"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_a_calibration_pass_ends_the_cli_at_once(sig, tmp_path):
    """Real process, real signal, sent as soon as the CLI has printed a line from inside layer 0's
    calibration pass (UPTRAIN_PROGRESS_EVERY=0: one per sequence): exit 130 / 143 within seconds, the
    output folder as it was. (A signal inside a refinement's steps: test_convert_interrupt.py.)"""
    source_before = _snapshot(EXAMPLE_MHA8)
    out = tmp_path / "out"
    out.mkdir()
    (out / "marker").write_text("the previous output\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "UPTRAIN_PROGRESS_EVERY": "0"}
    proc = subprocess.Popen([sys.executable, "-m", "uptrain.convert", str(EXAMPLE_MHA8), "--kv-heads", "2",
                             "--out", str(out), "--force", "--threads", "1", "--calib", str(TRAIN_TXT),
                             "--calib-tokens", "60000", "--refine", "--refine-steps", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    wanted = "calibrate layer 0: sequence 2/"
    for line in proc.stdout:
        if line.startswith(wanted):
            break
    else:
        pytest.fail(f"never printed {wanted!r}: rc {proc.wait()}\n{proc.stderr.read()}")
    signalled = time.monotonic()
    proc.send_signal(sig)
    _assert_clean_stop(proc, out, sig, source_before, signalled, within_s=4)
    assert proc.returncode == CODES[sig]
