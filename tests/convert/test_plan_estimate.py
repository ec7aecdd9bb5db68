"""The plan's `calibration + refinement` row (issue 43, "time a user can plan"): an upper bound on what
a refining conversion spends calibrating and refining, measured while planning
(`uptrain/convert/layers/time_estimate.py`; the bound measured idle and under load:
results/plan-estimate.md, scripts/bench/plan_estimate_check.py)."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import EXAMPLE_MHA8, TRAIN_TXT
from families import GQA_TYPES, tiny_config
from uptrain.convert.__main__ import main
from uptrain.convert.layers.time_estimate import PROBE_MARGIN, conversion_seconds, pace, pace_note, probe_layer_forward, typical_length
from uptrain.convert.math import refine
from uptrain.convert.plan import conversion_time

ROW = re.compile(r"^calibration \+ refinement +up to ([\d.,]+) (s|min|h) \(calibration ~([\d.,]+) (s|min|h), "
                 r"refinement at most ([\d.,]+) (s|min|h); measured on this machine at its present load "
                 r"\(1-minute load [\d.]+ on \d+ CPUs\), assuming it stays so: each refined layer's line checks "
                 r"the run against it\)$")


def test_the_bound_counts_the_steps_and_every_forward_without_gradients():
    probe = {"seconds_per_step": 2.0, "forward_seconds": 0.5}
    b = conversion_seconds(probe, 0.25, sequences=10, held=3, steps=100, layers=4)
    measured = 100 // refine.EVAL_EVERY + 1  # every EVAL_EVERY steps, and the last
    forwards = measured * 3 + 10 + 2 * 7 + 3 + 1  # held-out checks, before, solve + after, solve's check, +1
    assert b["refinement"] == pytest.approx(PROBE_MARGIN * 4 * (100 * 2.0 + forwards * 0.5))
    assert b["calibration"] == pytest.approx(PROBE_MARGIN * (4 + 1) * 10 * 0.25)  # the embedding pass as one more layer
    assert b["total"] == pytest.approx(b["calibration"] + b["refinement"])
    assert conversion_seconds(probe, None, 10, 3, 80, 4)["calibration"] == 0
    assert conversion_time({"total": 90.0, "calibration": 10.0, "refinement": 80.0}) == \
        ("up to 1.5 min (calibration ~10 s, refinement at most 1.33 min; measured on this machine at its present "
         "load, assuming it stays so: each refined layer's line checks the run against it)")


def test_a_refining_conversion_takes_at_most_one_and_a_half_times_the_planned_bound(tmp_path, capsys,
                                                                                    one_torch_thread):
    """A real conversion (stories260K, 2,048 calibration tokens, 40 steps): the plan prints the row, and
    calibration + refinement as recorded take at most 1.5x its bound (a bound, not a timing)."""
    out = tmp_path / "out"
    assert main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT),
                 "--calib-tokens", "2048", "--refine", "--refine-steps", "40", "--out", str(out)]) == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("calibration + refinement"))
    assert ROW.match(row), row
    record = json.loads((out / "uptrain_conversion.json").read_text())
    bound = record["refinement"]["probe"]["bound_s"]
    assert bound["total"] == pytest.approx(bound["calibration"] + bound["refinement"])
    assert bound["calibration"] > 0 and bound["refinement"] > record["refinement"]["probe"]["seconds_at_most"]
    actual = record["calibration"]["seconds"] + sum(x["seconds_with_setup"] for x in record["refinement"]["layers"])
    assert actual <= 1.5 * bound["total"], (actual, bound)


def test_the_pace_projects_every_layer_still_to_come_at_the_slowest_layer_so_far():
    """`pace` over many random and structured runs: exact where every layer took the same time and
    the calibration's passes are even; never below what a run at the slowest pace so far would take;
    and `pace_note` says 'within the plan' exactly where the projection is under the bound."""
    gen = torch.Generator().manual_seed(0)
    for layers in (1, 2, 5, 32, 40, 64, 80):
        for _ in range(25):
            done = int(torch.randint(1, layers + 1, (1,), generator=gen))
            made = (torch.rand(done, generator=gen) * 10 + 0.1).tolist()
            calibration = float(torch.rand(1, generator=gen)) * 5
            spent = calibration + sum(made)
            projected = pace(spent, calibration, made, layers)
            slowest_run = spent + (layers - done) * (max(made) + calibration / (done + 1))
            assert projected == pytest.approx(slowest_run)
            assert projected >= spent and (done < layers or projected == pytest.approx(spent))
            even = pace((done + 1) * 0.5 + done * 2.0, (done + 1) * 0.5, [2.0] * done, layers)
            assert even == pytest.approx((layers + 1) * 0.5 + layers * 2.0)  # the whole run at this pace
            bound = float(torch.rand(1, generator=gen)) * 2 * projected + 1e-3
            note = pace_note(spent, projected, bound, 1.0, 3.0)
            assert note.startswith("within the plan") == (projected <= bound), (note, projected, bound)
            assert ("load 1.0 when planned, 3.0 now" in note) == (projected > bound)
    assert pace(5.0, 1.0, [], 10) == 5.0  # nothing refined yet: nothing to project from


def test_every_pass_is_counted_at_a_length_whose_cost_covers_the_mean_cost_of_the_sequences():
    """`typical_length` over random and structured length mixes: between the mean and the longest,
    the length itself where all are equal, and for any cost a + bL + cL² (a, b, c >= 0: a pass of
    one sequence) n x cost(typical) >= the sum of the sequences' costs (the bound stays safe)."""
    gen = torch.Generator().manual_seed(0)
    mixes = [[2048] * 16, [1] * 3, [61, 503, 200, 320], [4096, 1], [7] * 40 + [2048]]
    mixes += [torch.randint(1, 4097, (int(torch.randint(1, 64, (1,), generator=gen)),), generator=gen).tolist()
              for _ in range(200)]
    for lengths in mixes:
        t = typical_length(lengths)
        assert sum(lengths) / len(lengths) <= t <= max(lengths), (lengths, t)
        if len(set(lengths)) == 1:
            assert t == lengths[0]
        for a, b, c in torch.rand(20, 3, generator=gen).tolist():
            cost = lambda n: a + b * n + c * n * n / 1000  # noqa: E731
            assert len(lengths) * cost(t) >= sum(cost(n) for n in lengths) * (1 - 1e-12), (lengths, a, b, c)


@pytest.mark.parametrize("model_type", sorted(t for t in GQA_TYPES if t != "falcon"))  # falcon: refused
def test_the_calibration_probe_builds_every_refinable_family(model_type, one_torch_thread):
    """Each registry family's decoder layer (rotary per layer type, partial rotary, key norms, fused
    qkv) runs the calibration probe: a positive time, no 'calibration not measured' in the plan."""
    times = probe_layer_forward(tiny_config(model_type, GQA_TYPES[model_type]), 16, "cpu", budget_s=0.05)
    assert times["slowest"] > 0 and times["mean"] > 0
