"""uptrain.sweep: the K/V trade curve, scored with uptrain.eval's own code, on the bundled model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT, VALID_TXT
from uptrain.convert import convert
from uptrain.errors import UsageError
from uptrain.measure.eval import main as eval_main
from uptrain.measure.plots import plot_sweep
from uptrain.sweep.run import Point, main, recommend, sweep_counts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARGS = ["--data", str(VALID_TXT), "--stories", "4", "--threads", "1"]


def _points(out) -> dict[str, dict]:
    return {p["label"]: p for p in json.loads((out / "sweep.json").read_text())["points"]}


def _tensors(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_sweep_scores_as_uptrain_eval_and_its_folders_are_plain_conversions(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main([str(EXAMPLE_MHA8), *ARGS, "--kv-heads", "2,1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    points = _points(out)
    assert list(points) == ["source", "mean kv2", "mean kv1"]
    assert (out / "sweep.png").stat().st_size > 0
    assert "recommended: " in printed or "none of the counts" in printed
    # uptrain.eval on the same folders and text gives the same numbers
    subset = tmp_path / "valid4.txt"
    subset.write_text("\n\n".join(VALID_TXT.read_text().split("\n\n")[:4]))
    folders = [str(EXAMPLE_MHA8), str(out / "kv2"), str(out / "kv1")]
    assert eval_main([*folders, "--data", str(subset), "--json", str(tmp_path / "eval.json")]) == 0
    records = json.loads((tmp_path / "eval.json").read_text())
    assert [r["loss"] for r in records] == pytest.approx([points[k]["loss"] for k in points], abs=1e-9)
    # fidelity to the source: uptrain.eval --reference's numbers; the source against itself exactly 0 / 1
    assert eval_main([*folders, "--data", str(subset), "--reference", str(EXAMPLE_MHA8),
                      "--json", str(tmp_path / "fidelity.json")]) == 0
    measured = json.loads((tmp_path / "fidelity.json").read_text())
    for key in ("kl_to_source", "top1_agreement", "greedy_agreement"):
        assert [r[key] for r in measured] == pytest.approx([points[k][key] for k in points], abs=1e-9), key
    source = points["source"]
    assert (source["kl_to_source"], source["top1_agreement"], source["greedy_agreement"]) == (0.0, 1.0, 1.0)
    assert 0 < points["mean kv2"]["kl_to_source"] < points["mean kv1"]["kl_to_source"]
    assert "KL to source" in printed and (out / "sweep-fidelity.png").stat().st_size > 0
    # each folder is what a plain `uptrain.convert` with the same settings writes
    convert(str(EXAMPLE_MHA8), tmp_path / "plain2", 2, "mean")
    ours, plain = _tensors(out / "kv2"), _tensors(tmp_path / "plain2")
    assert ours.keys() == plain.keys() and all(torch.equal(ours[k], plain[k]) for k in ours)
    # KV bytes: 2 x layers x kv_heads x head_dim x 4 bytes (float32), x the 512-position context
    assert points["mean kv2"]["kv_bytes_per_token"] == 2 * 5 * 2 * 8 * 4
    assert points["mean kv2"]["kv_bytes_at_context"] == 2 * 5 * 2 * 8 * 4 * 512
    assert points["source"]["kv_bytes_per_token"] == 4 * points["mean kv2"]["kv_bytes_per_token"]


def test_a_killed_sweep_leaves_whole_folders_and_the_rerun_continues_it(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = [str(EXAMPLE_MHA8), *ARGS, "--kv-heads", "4,2,1", "--method", "fit", "--calib", str(TRAIN_TXT),
            "--calib-tokens", "2048", "--out", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "uptrain.sweep", *argv], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    while proc.poll() is None and not ((out / "sweep.json").is_file() and len(_points(out)) >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # during the second conversion (or right after the first)
    proc.communicate(timeout=60)
    kept = _points(out)
    assert "fit kv4" in kept
    for folder in out.iterdir():  # only whole conversions under their own names (partials are hidden)
        if folder.is_dir() and not folder.name.startswith("."):
            assert (folder / "config.json").is_file(), folder
    before = (out / "kv4" / "config.json").stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 0  # the rerun: in this process (only the kill needs a process of its own)
    assert "fit kv4: kept from the earlier run" in capsys.readouterr().out
    assert list(_points(out)) == ["source", "fit kv4", "fit kv2", "fit kv1"]
    assert (out / "kv4" / "config.json").stat().st_mtime_ns == before  # not converted again
    assert _points(out)["fit kv4"]["settings"]["conversion"]["calib_tokens"] == 2048
    for count in (4, 2, 1):  # the counts of a run were converted together: one calibration pass for all
        record = json.loads((out / f"kv{count}" / "uptrain_conversion.json").read_text())
        assert record["calibration"]["passes"] == 1 and record["calibration"]["layers_run"] == 5, record["calibration"]
        assert any(n.startswith("converted together with K/V counts") for n in record["notes"]), record["notes"]


UPTRAIN = ["--uptrain-tokens", "4096", "--train-data", str(TRAIN_TXT)]  # one optimizer step of the recipe


def test_bench_and_uptraining_per_count_scored_as_uptrain_eval_and_kept_by_a_rerun(tmp_path, capsys):
    out = tmp_path / "sweep"
    argv = [str(EXAMPLE_MHA8), *ARGS, "--kv-heads", "2", "--bench", "--bench-context", "16", "--bench-new-tokens",
            "8", "--bench-repeats", "1", *UPTRAIN, "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    points = _points(out)
    assert list(points) == ["source", "mean kv2"]
    # decode speed: timed by uptrain.bench's code for the source and the count, a column of the table
    assert all(p["decode_tokens_per_s"] > 0 and p["bench"]["new_tokens"] == 8 for p in points.values())
    assert "decode tok/s" in printed and "loss after uptraining (4,096 tokens)" in printed
    assert "after uptraining: " in printed
    # the uptrained model is a whole folder under OUT/kv2-uptrained/, and uptrain.eval scores it as the sweep did
    after = points["mean kv2"]
    assert after["uptrain_tokens"] == 4096 and after["uptrain_steps"] == 1 and after["uptrain_seconds"] > 0
    assert after["uptrained_folder"] == str(out / "kv2-uptrained" / "model")
    assert "loss_after_uptraining" not in points["source"] or points["source"]["loss_after_uptraining"] is None
    subset = tmp_path / "valid4.txt"
    subset.write_text("\n\n".join(VALID_TXT.read_text().split("\n\n")[:4]))
    assert eval_main([after["uptrained_folder"], "--data", str(subset), "--json", str(tmp_path / "eval.json")]) == 0
    (record,) = json.loads((tmp_path / "eval.json").read_text())
    assert record["loss"] == pytest.approx(after["loss_after_uptraining"], abs=1e-9)
    assert record["perplexity"] == pytest.approx(after["perplexity_after_uptraining"], rel=1e-9)
    assert after["loss_after_uptraining"] != after["loss"]  # it was trained
    kl_after = after["fidelity_after_uptraining"]["kl_to_source"]
    assert kl_after >= 0 and kl_after != after["kl_to_source"] and "KL to source after" in printed
    # sweep.png: a second, dashed curve through the losses after uptraining
    figure = plot_sweep(list(points.values()), tmp_path / "curve.png")
    assert "mean, uptrained 4,096 tokens" in [t.get_text() for t in figure.axes[0].get_legend().get_texts()]
    # a rerun with the same arguments keeps the timings and the uptraining; another budget redoes only that
    model_file = out / "kv2-uptrained" / "model" / "config.json"
    before = model_file.stat().st_mtime_ns
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "mean kv2: uptraining kept from the earlier run" in printed and "decode speed kept" in printed
    assert model_file.stat().st_mtime_ns == before and _points(out) == points
    argv[argv.index("4096")] = "8192"
    assert main(argv) == 0
    again = _points(out)["mean kv2"]
    assert again["uptrain_tokens"] == 8192 and again["uptrain_steps"] == 2
    assert again["loss"] == after["loss"] and again["decode_tokens_per_s"] == after["decode_tokens_per_s"]


def test_bench_in_llama_cpp_where_it_is_installed(tmp_path):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (pip install llama-cpp-python)")
    import os

    if not os.environ.get("LLAMA_CPP_DIR"):
        pytest.skip("LLAMA_CPP_DIR (a llama.cpp checkout with convert_hf_to_gguf.py) is not set")
    out = tmp_path / "sweep"
    assert main([str(EXAMPLE_MHA8), *ARGS, "--kv-heads", "4", "--bench", "--runtime", "llama.cpp",
                 "--bench-context", "16", "--bench-new-tokens", "8", "--out", str(out)]) == 0
    assert all(p["decode_tokens_per_s"] > 0 and p["bench"]["runtime"] == "llama.cpp" for p in _points(out).values())


def _llama_cpp_missing() -> str:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama.cpp runs need llama-cpp-python, which is not importable"
    return "converting to GGUF needs llama.cpp's convert_hf_to_gguf.py"


@pytest.mark.parametrize("argv, message", [
    (["--uptrain-tokens", "0", "--train-data", str(TRAIN_TXT)], "--uptrain-tokens must be a positive number"),
    (["--uptrain-tokens", "-4096", "--train-data", str(TRAIN_TXT)], "--uptrain-tokens must be a positive number"),
    (["--uptrain-tokens", "many"], "not a number of tokens"),
    (["--uptrain-tokens", "100", "--train-data", str(TRAIN_TXT)], "is below one optimizer step of 4,096 tokens"),
    (["--uptrain-tokens", "4096"], "--uptrain-tokens needs training text"),
    (["--uptrain-tokens", "4096", "--train-data", str(VALID_TXT)], "--train-data and --data are the same file"),
    ([*UPTRAIN, "--uptrain-set", "budget.tokens=5"], "the sweep sets budget.tokens itself"),
    ([*UPTRAIN, "--uptrain-set", "optim.lr"], "is not key=value"),
    (["--train-data", str(TRAIN_TXT)], "--train-data applies only with --uptrain-tokens N"),
    (["--bench", "--runtime", "llama.cpp"], _llama_cpp_missing()),
    (["--runtime", "llama.cpp"], "--runtime applies only with --bench"),
    (["--bench", "--bench-context", "500", "--bench-new-tokens", "32"], "exceed the model's 512 positions"),
    (["--bench", "--bench-new-tokens", "1"], "--bench-new-tokens must be at least 2"),
    (["--kv-heads", "3"], "3 does not divide the 8 K/V heads"),
    (["--kv-heads", "8"], "--kv-heads 8 is not below the source's 8 K/V heads"),
    (["--kv-heads", "two"], "--kv-heads takes counts like 4,2,1 or all"),
    (["--calib", str(VALID_TXT), "--method", "fit"], "--calib and --data are the same file"),
    (["--refine"], "--refine needs --calib FILE"),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch, argv, message):
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    out = tmp_path / "sweep"
    assert main([str(EXAMPLE_MHA8), *ARGS, *argv, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not out.exists()


def test_no_held_out_text_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    assert main([str(EXAMPLE_MHA8), "--data", str(empty), "--out", str(tmp_path / "sweep")]) == 2
    assert "empty.txt" in capsys.readouterr().err and not (tmp_path / "sweep").exists()


@pytest.mark.parametrize("heads, kv", [(32, 32), (40, 40), (64, 64), (32, 8), (64, 8), (40, 8), (12, 6)])
def test_all_counts_are_every_count_below_the_source_that_divides_it(heads, kv):
    counts = sweep_counts("all", heads, kv, False, "llama")
    assert counts == sorted((k for k in range(1, kv) if kv % k == 0), reverse=True)
    for count in counts:
        assert sweep_counts(str(count), heads, kv, False, "llama") == [count]
    for bad in (k for k in range(1, kv + 3) if k >= kv or kv % k):
        with pytest.raises(UsageError):
            sweep_counts(str(bad), heads, kv, False, "llama")
    assert sweep_counts("all", heads, kv, True, "falcon") == [1]


def _point(kv: int, loss: float) -> Point:
    return Point(f"fit kv{kv}", "fit", kv, loss, 0.0, 0.0, 0.0, "x", {"source_kv_heads": 8}, 0.0)


def _scored(kv: int, loss: float, kl: float) -> Point:
    return Point(f"fit kv{kv}", "fit", kv, loss, 0.0, 0.0, 0.0, "x", {"source_kv_heads": 8}, 0.0, kl_to_source=kl,
                 top1_agreement=0.9, greedy_agreement=0.5)


def test_the_recommendation_bounds_the_kl_when_asked_and_rests_on_it_when_the_loss_cannot_choose():
    points = [_scored(4, 2.005, 0.004), _scored(2, 2.01, 0.05), _scored(1, 1.9, 0.3)]
    assert recommend(points, 2.0, 0.01).startswith("recommended: 1 K/V heads")  # by loss alone
    assert recommend(points, 2.0, 0.01, max_kl=0.01).startswith("recommended: 4 K/V heads")
    assert recommend(points, 2.0, 0.1, max_kl=0.1).startswith("recommended: 2 K/V heads")  # kv1: KL 0.3
    # the loss misleads (a warning said why): by the KL alone, bound by default to 1% x 2.0 = 0.02 nats
    said = recommend(points, 2.0, 0.01, loss_misleads=True)
    assert "the loss cannot choose here" in said and "recommended: 4 K/V heads" in said and "KL 0.0200" in said
    assert "recommended: 2 K/V heads" in recommend(points, 2.0, 0.01, max_kl=0.06, loss_misleads=True)
    assert "none of the counts is within KL 0.0010" in recommend(points, 2.0, 0.01, max_kl=0.001, loss_misleads=True)


def test_on_text_the_source_barely_models_the_sweep_warns_and_recommends_by_fidelity(tmp_path, capsys):
    """Random letters: the source's loss is near chance (ln 512); the losses there cannot choose a count."""
    import random

    rng = random.Random(0)
    noise = tmp_path / "noise.txt"
    noise.write_text("\n\n".join(" ".join("".join(rng.choice("qxzjkvwy") for _ in range(rng.randint(2, 9)))
                                           for _ in range(60)) for _ in range(3)))
    out = tmp_path / "sweep"
    assert main([str(EXAMPLE_MHA8), "--data", str(noise), "--threads", "1", "--kv-heads", "2,1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "warning: the source's loss on this text" in printed and "of chance (ln 512" in printed
    assert "the loss cannot choose here" in printed


def test_recommendation_is_the_smallest_count_within_the_bound_or_says_none():
    points = [_point(4, 2.005), _point(2, 2.03), _point(1, 2.5)]
    assert recommend(points, 2.0, 0.01).startswith("recommended: 4 K/V heads")
    assert recommend(points, 2.0, 0.02).startswith("recommended: 2 K/V heads")
    assert recommend(points, 2.0, 0.3).startswith("recommended: 1 K/V heads")
    said = recommend(points, 2.0, 0.001)
    assert said.startswith("none of the counts is within 0.1%") and "closest is 4 K/V heads" in said


def test_a_rerun_on_other_held_out_text_scores_again(tmp_path, capsys):
    """Scores depend on the text: a rerun with another --stories keeps no score of the earlier text
    (the source and every count scored again, the line says why), but keeps the conversions."""
    out = tmp_path / "sweep"
    base = [str(EXAMPLE_MHA8), "--data", str(VALID_TXT), "--threads", "1", "--kv-heads", "2", "--out", str(out)]
    assert main([*base, "--stories", "2"]) == 0
    first = _points(out)
    assert main([*base, "--stories", "2"]) == 0
    assert "mean kv2: kept from the earlier run" in capsys.readouterr().out
    made = (out / "kv2" / "config.json").stat().st_mtime_ns
    assert main([*base, "--stories", "3"]) == 0
    printed = capsys.readouterr().out
    assert "source: done again, the earlier run's differs: stories 2 -> 3" in printed
    assert "mean kv2: kept from the earlier run" in printed and "scored again: stories 2 -> 3" in printed
    again = _points(out)
    assert again["source"]["settings"]["scoring"]["stories"] == 3 and again["source"]["loss"] != first["source"]["loss"]
    assert again["mean kv2"]["loss"] != first["mean kv2"]["loss"]
    assert (out / "kv2" / "config.json").stat().st_mtime_ns == made  # the conversion was kept


@pytest.mark.parametrize("signame, phase", [("SIGTERM", None), ("SIGINT", "calibrate"), ("SIGTERM", "refine"),
                                            ("SIGINT", "write")])
def test_a_stop_at_any_phase_ends_the_sweep_in_one_line_with_whole_folders(tmp_path, signame, phase):
    """Ctrl-C / SIGTERM from the first instruction (phase None: during the imports) to the writing
    of the counts: one line, 130 / 143, no count's folder and no hidden partial one left."""
    out = tmp_path / "sweep"
    env = {**os.environ, "UPTRAIN_TEST_PAUSE_AT": f"{phase}:60" if phase else ""}
    proc = subprocess.Popen([sys.executable, "-m", "uptrain.sweep", str(EXAMPLE_MHA8), *ARGS, "--kv-heads", "4,2",
                             "--method", "fit", "--calib", str(TRAIN_TXT), "--calib-tokens", "1024", "--refine",
                             "--refine-steps", "5", "--out", str(out)], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if phase:
        while proc.poll() is None and f"paused at {phase}" not in proc.stderr.readline():
            pass
    else:
        time.sleep(0.5)
    proc.send_signal(getattr(signal, signame))
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 128 + getattr(signal, signame), err
    last = err.strip().splitlines()[-1]
    assert last.startswith("uptrain.sweep: ") and "every folder is whole" in last and "terminate called" not in err
    left = sorted(p.name for p in out.iterdir()) if out.exists() else []
    assert not [n for n in left if n.startswith("kv") or ".partial-" in n], left
