"""scripts/bench/refine_layer_time.py (results/refine-layer-time.md) on a tiny shape: it runs, and its record
has positive seconds per step and per layer for both the defaults before issue 43 and today's."""

from __future__ import annotations

import json
import sys

import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "bench"))
import refine_layer_time  # noqa: E402
from uptrain.convert.math import refine  # noqa: E402


def test_tiny_shape_gives_positive_seconds_for_both_defaults(tmp_path, capsys):
    out = tmp_path / "t.json"
    with torch.random.fork_rng():
        assert refine_layer_time.main(["--shape", "tiny", "--steps-timed", "1", "--calib-tokens", "1024",
                                       "--json", str(out)]) == 0
    record = json.loads(out.read_text())
    (shape,) = record["shapes"]
    assert shape["shape"] == "tiny" and shape["sequences"] == 16 and shape["held_out"] + shape["trained"] == 16
    for name, steps, batch in (("old", 1200, 4), ("new", refine.STEPS, refine.BATCH)):
        d = shape[name]
        assert d["step_s"] > 0 and d["layer_s"] > d["steps"] * d["step_s"] * 0.99
        assert (d["steps"], d["defaults"]["batch"]) == (steps, batch)
        assert d["model_h"] == d["layer_s"] * shape["model_layers"] / 3600
    assert shape["new"]["parts_s"]["solve"] > 0 and shape["old"]["parts_s"]["solve"] == 0
    assert shape["check"]["steps_run"] == 3 and shape["check"]["measured_s"] > 0
    assert "| tiny (4->2 K/V) | 64 |" in capsys.readouterr().out
