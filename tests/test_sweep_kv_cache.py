"""uptrain.sweep --kv-cache: the trade over K/V heads x cache precision (uptrain/sweep/precision.py).

Every point in every format is uptrain.eval --kv-cache's number; the recommendation, recomputed here
from sweep.json, is the pair of fewest KV bytes within the bound; the frontier is what no point beats;
a point in a format is kept by the content of the folder it scored, never by its path.
"""

from __future__ import annotations

import json
import random
import re
from types import SimpleNamespace

import pytest
from safetensors.torch import load_file, save_file

from conftest import EXAMPLE_MHA8, VALID_TXT
from uptrain.measure.eval import main as eval_main
from uptrain.measure.plots import frontier
from uptrain.sweep.precision import recommend_pair
from uptrain.sweep.run import main

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARGS = ["--data", str(VALID_TXT), "--stories", "4", "--threads", "1", "--kv-heads", "4,2"]


def _points(out) -> dict[str, dict]:
    return {p["label"]: p for p in json.loads((out / "sweep.json").read_text())["points"]}


def _recomputed(points: dict[str, dict], bound: float) -> dict:
    """The pair the recommendation must name: of the chosen method's points and the source's quantized
    ones, the fewest KV bytes per token (then the lower loss) within `bound` x the source's loss."""
    source = points["source"]
    candidates = [p for p in points.values() if p["method"] != "source" or p["kv_cache"] != "model"]
    fits = [p for p in candidates if p["loss"] <= source["loss"] * (1 + bound)]
    return min(fits, key=lambda p: (p["kv_bytes_per_token"], p["loss"]))


def test_every_pair_is_scored_as_uptrain_eval_and_the_recommendation_is_the_fewest_bytes_within_the_bound(
        tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main([str(EXAMPLE_MHA8), *ARGS, "--kv-cache", "fp8,bf16,q8_0", "--max-loss-increase", "0.03",
                 "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    points = _points(out)
    assert list(points) == ["source", "source fp8", "source bf16", "mean kv4", "mean kv4 fp8", "mean kv4 bf16",
                            "mean kv2", "mean kv2 fp8", "mean kv2 bf16"]
    assert "--kv-cache q8_0: left out" in printed and "head_dim 8" in printed  # llama.cpp refuses it here
    # bytes per token: 2 x 5 layers x K/V heads x 8 x bytes per value (float32 as saved, 2 for bf16, 1 for fp8)
    for p in points.values():
        per_value = {"model": 4, "bf16": 2, "fp8": 1}[p["kv_cache"]]
        assert p["kv_bytes_per_token"] == 2 * 5 * p["kv_heads"] * 8 * per_value
    # each pair's numbers are uptrain.eval --kv-cache's on the same text and folder
    subset = tmp_path / "valid4.txt"
    subset.write_text("\n\n".join(VALID_TXT.read_text().split("\n\n")[:4]))
    for label in ("source fp8", "mean kv2 bf16"):
        p = points[label]
        assert eval_main([p["folder"], "--data", str(subset), "--reference", str(EXAMPLE_MHA8), "--kv-cache",
                          p["kv_cache"], "--json", str(tmp_path / "e.json")]) == 0
        (r,) = json.loads((tmp_path / "e.json").read_text())
        assert (r["loss"], r["kl_to_source"]) == pytest.approx((p["loss"], p["kl_to_source"]), abs=1e-9)
    pick = _recomputed(points, 0.03)
    line = next(line for line in printed.splitlines() if line.startswith("over K/V heads x cache"))
    assert f"recommended {pick['kv_heads']} K/V heads" in line or (
        pick["method"] == "source" and "recommended the source" in line)
    cache = "at the model's own dtype" if pick["kv_cache"] == "model" else f" {pick['kv_cache']} cache"
    assert cache in line and f"{pick['kv_bytes_per_token']:,.4g} B/token" in line
    assert (out / "sweep.png").stat().st_size > 0


def test_a_point_in_a_format_is_kept_by_the_content_it_scored(tmp_path, capsys):
    out = tmp_path / "sweep"
    args = [str(EXAMPLE_MHA8), *ARGS[:-2], "--kv-heads", "2", "--kv-cache", "fp8", "--out", str(out)]
    assert main(args) == 0
    first = _points(out)
    capsys.readouterr()
    assert main(args) == 0
    assert "== mean kv2 fp8: kept from the earlier run" in capsys.readouterr().out
    assert _points(out)["mean kv2 fp8"]["loss"] == first["mean kv2 fp8"]["loss"]
    # the folder's weights edited in place, at the same path: its point in fp8 is scored again
    shard = next(f for f in sorted((out / "kv2").glob("*.safetensors")) if any(
        k.endswith("k_proj.weight") for k in load_file(f)))
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("k_proj.weight"))
    tensors[name] = tensors[name] * 0.5
    save_file(tensors, shard, metadata={"format": "pt"})
    points = _points(out)
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "== mean kv2 fp8: kept" not in printed
    assert _points(out)["mean kv2 fp8"]["loss"] != points["mean kv2 fp8"]["loss"]


def _point(label, method, kv_heads, cache, loss, kv_bytes, kl=None):
    return SimpleNamespace(label=label, method=method, kv_heads=kv_heads, kv_cache=cache, loss=loss,
                           kv_bytes_per_token=kv_bytes, kl_to_source=kl)


@pytest.mark.parametrize("seed", range(40))
def test_the_recommendation_and_the_frontier_over_random_trades(seed):
    """Over random trades of real shapes (32, 40, 64 query heads; every count dividing them; five formats):
    the pick is the fewest bytes within the bound, and the frontier is exactly the points nothing beats."""
    rng = random.Random(seed)
    heads = rng.choice([32, 40, 64])
    per_value = {"model": 2, "fp8": 1, "q8_0": 34 / 32, "q4_0": 18 / 32, "fp16": 2}
    source = _point("source", "source", heads, "model", 2.0, 2 * heads * 128 * 2)
    points = [source]
    for kv in [k for k in range(1, heads) if heads % k == 0]:
        for cache, bpv in per_value.items():
            loss = 2.0 * (1 + rng.choice([0, 0.001, 0.004, 0.02, 0.1]) * (heads / kv) ** 0.5 * (1 + 2 * (bpv < 1)))
            points.append(_point(f"fit kv{kv} {cache}", "fit", kv, cache, loss, 2 * kv * 128 * bpv))
    for cache, bpv in per_value.items():
        if cache != "model":
            points.append(_point(f"source {cache}", "source", heads, cache, 2.0 * (1 + rng.random() * 0.02),
                                 2 * heads * 128 * bpv))
    bound = rng.choice([0.001, 0.005, 0.01, 0.05])
    line = recommend_pair(points[1:], source, bound)
    fits = [p for p in points[1:] if p.loss <= 2.0 * (1 + bound)]
    if not fits:
        assert "no pair is within" in line
    else:
        pick = min(fits, key=lambda p: (p.kv_bytes_per_token, p.loss))
        assert f"({pick.kv_bytes_per_token:,.4g} B/token" in line and f"loss {pick.loss:.4f}" in line
        assert re.search(rf"recommended (the source \()?{pick.kv_heads} K/V heads", line)
    edge = frontier(points)
    for p in points:
        beaten = any(q.kv_bytes_per_token <= p.kv_bytes_per_token and q.loss < p.loss or
                     q.kv_bytes_per_token < p.kv_bytes_per_token and q.loss <= p.loss for q in points)
        assert (p in edge) == (not beaten) or any(  # equal (bytes, loss) twins: one of them is on the edge
            q is not p and (q.kv_bytes_per_token, q.loss) == (p.kv_bytes_per_token, p.loss) for q in edge)


def test_uptrained_points_get_every_format_too(tmp_path, capsys):
    """--uptrain-tokens: each count uptrained once (at its own dtype) and scored in every format, as
    uptrain.eval --kv-cache scores the uptrained folder; a rerun keeps them by the uptrained folder's content."""
    from conftest import TRAIN_TXT

    out = tmp_path / "sweep"
    argv = [str(EXAMPLE_MHA8), *ARGS[:-2], "--kv-heads", "2", "--kv-cache", "fp8", "--uptrain-tokens", "4096",
            "--train-data", str(TRAIN_TXT), "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    points = _points(out)
    base, fp8 = points["mean kv2"], points["mean kv2 fp8"]
    assert fp8["uptrained_folder"] == base["uptrained_folder"] == str(out / "kv2-uptrained" / "model")
    assert len(list(out.glob("*-uptrained"))) == 1  # one uptraining per count, not one per format
    subset = tmp_path / "valid4.txt"
    subset.write_text("\n\n".join(VALID_TXT.read_text().split("\n\n")[:4]))
    assert eval_main([fp8["uptrained_folder"], "--data", str(subset), "--reference", str(EXAMPLE_MHA8),
                      "--kv-cache", "fp8", "--json", str(tmp_path / "e.json")]) == 0
    (r,) = json.loads((tmp_path / "e.json").read_text())
    assert r["loss"] == pytest.approx(fp8["loss_after_uptraining"], abs=1e-9)
    assert r["kl_to_source"] == pytest.approx(fp8["fidelity_after_uptraining"]["kl_to_source"], abs=1e-9)
    assert fp8["loss_after_uptraining"] != base["loss_after_uptraining"]
    assert "after uptraining: over K/V heads x cache" in printed
    assert main(argv) == 0
    assert _points(out)["mean kv2 fp8"] == fp8 and "mean kv2 fp8 after uptraining" not in capsys.readouterr().out
