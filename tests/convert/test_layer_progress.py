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
    (["--refine", "--refine-steps", "2"], r"refine layer \d: held-out error [\d.]+ -> [\d.]+ \(\d+ steps, [\d.]+ s\)"),
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
