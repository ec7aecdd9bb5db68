"""Issue 50: behind a key norm, `--method fit --calib` (no `--refine`) writes a model never further from
the source than mean pooling's on the calibration text (`layers/whole_check.py`).

Proven on examples/qwen3-keynorm-trained (a Qwen3-style model trained here, results/key-norm-trained.md),
where each layer's chosen start is at least as close as mean pooling's but the model of them is further:
the KLs the record gives are measured again here with transformers on the same sequences, the written
model is mean pooling's conversion, tensor for tensor, and the model the check turned down (obtained by
keeping the chosen starts) takes the per-layer choice both ways. Then on random-weight models of every
key-norm family, where the check keeps the chosen starts; across a stop and a rerun; and, with the
verdict forced, behind the key norms the conversion rewrites (OLMo-2's whole-K, Cohere's per head).
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT, VALID_TXT
from families import tiny_config
from tiny import load, random_model, save
from uptrain.convert import RECORD_FILE, convert
from uptrain.convert.layers import whole_check
from uptrain.convert.layers.calibrate import Calibration
from uptrain.convert.layers.whole_check import first_sequences

sys.path.insert(0, str(REPO / "scripts" / "studies"))
from fit_starts import errors as layer_errors, kl_to  # noqa: E402 (scripts/studies/: the measurement's own)

TRAINED = REPO / "examples" / "qwen3-keynorm-trained"
TOKENS = 4096


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_the_check_runs_the_first_sequences_up_to_its_tokens():
    """`first_sequences` over random and structured lengths: the sequences taken hold at least the
    tokens asked (or are all there are), and one fewer would not."""
    rng = random.Random(0)
    cases = [[1], [5000], [100] * 41, [4096, 1], [4095, 1, 7], [2048] * 8]
    cases += [[rng.randint(1, 3000) for _ in range(rng.randint(1, 30))] for _ in range(200)]
    for lengths in cases:
        for tokens in (1, 100, 4096, 10**6):
            count = first_sequences(lengths, tokens)
            assert 1 <= count <= len(lengths)
            assert sum(lengths[:count]) >= tokens or count == len(lengths), (lengths, tokens, count)
            assert count == 1 or sum(lengths[:count - 1]) < tokens, (lengths, tokens, count)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict:
    """examples/qwen3-keynorm-trained converted to 2 K/V heads: by `--method mean`; by `--method fit
    --calib` as it is (`fit`); and the same keeping the chosen starts whatever the check finds
    (`chosen`: the check's verdict forced, its KLs still measured)."""
    base = tmp_path_factory.mktemp("trained")
    torch.set_num_threads(1)
    convert(str(TRAINED), base / "mean", 2, "mean")
    convert(str(TRAINED), base / "fit", 2, "fit", calibration=Calibration(TRAIN_TXT, TOKENS))
    judge = whole_check.WholeModelCheck._judge
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(whole_check.WholeModelCheck, "_judge", lambda self: {**judge(self), "written": "chosen"})
        convert(str(TRAINED), base / "chosen", 2, "fit", calibration=Calibration(TRAIN_TXT, TOKENS))
    calibration = Calibration(TRAIN_TXT, TOKENS).bind(TRAINED)
    windows = calibration.windows()[0]
    checked = [torch.tensor(w) for w in windows[:first_sequences([len(w) for w in windows])]]
    return {"base": base, "windows": [torch.tensor(w) for w in windows], "checked": checked,
            "record": json.loads((base / "fit" / RECORD_FILE).read_text())}


def test_on_trained_key_norm_weights_the_written_model_is_mean_poolings_where_the_chosen_starts_are_further(
        trained, one_torch_thread):
    """The record's two KLs are the ones measured here (transformers, the same sequences); the model
    written is the closer one, mean pooling's conversion tensor for tensor; the plan says so. Red when
    the verdict is not written (`pipeline.write_mean_if_closer` returning early)."""
    base, verdict = trained["base"], trained["record"]["whole_model"]
    source = load(TRAINED)
    with torch.no_grad():
        measured = {name: kl_to(source, load(base / name), trained["checked"]) for name in ("chosen", "mean")}
    assert verdict["kl_chosen"] == pytest.approx(measured["chosen"], rel=1e-3), (verdict, measured)
    assert verdict["kl_mean"] == pytest.approx(measured["mean"], rel=1e-3), (verdict, measured)
    assert verdict["tokens"] == sum(len(w) for w in trained["checked"])
    assert verdict["kl_mean"] < verdict["kl_chosen"] and verdict["written"] == "mean", verdict
    written, mean = _tensors(base / "fit"), _tensors(base / "mean")
    assert written.keys() == mean.keys()
    for name in written:
        torch.testing.assert_close(written[name], mean[name], rtol=0, atol=1e-6, msg=name)
    notes = " ".join(trained["record"]["notes"])
    assert "mean pooling's start is written on every layer" in notes, notes
    assert "mean pooling's start is written" in (base / "fit" / "README.md").read_text()  # the model card too


def test_the_model_turned_down_took_the_per_layer_choice_both_ways(trained, one_torch_thread):
    """The chosen starts' model (the one the check turned down) holds, layer by layer, the start with the
    lower error on the calibration text, and both kinds occur: the check overrides a real choice."""
    record = json.loads((trained["base"] / "chosen" / RECORD_FILE).read_text())
    note = next(n for n in record["notes"] if n.startswith("start behind the key norm chosen per layer"))
    pairs = [tuple(map(float, p.split("/"))) for p in re.search(r"per layer: ([^)]*)\)", note)[1].split(", ")]
    assert 0 < sum(m < f for f, m in pairs) < len(pairs), note
    source = load(TRAINED)
    with torch.no_grad():
        got = layer_errors(source, load(trained["base"] / "chosen"), trained["windows"])
    for layer, ((fit_e, mean_e), error) in enumerate(zip(pairs, got)):
        assert error == pytest.approx(min(fit_e, mean_e), rel=2e-3, abs=1e-4), (layer, note, got)


BASE = ["--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT), "--calib-tokens", str(TOKENS),
        "--threads", "1"]


def _convert(out: Path, pause: str | None = None) -> subprocess.CompletedProcess:
    """The CLI on the trained model into `out`; with `pause` ('kept-K'), stopped by SIGTERM once there."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if pause:
        env["UPTRAIN_TEST_PAUSE_AT"] = f"{pause}:0"
    cmd = [sys.executable, "-m", "uptrain.convert", str(TRAINED), *BASE, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    if pause:
        for line in proc.stderr:
            if line.strip() == f"paused at {pause}":
                time.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                break
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


@pytest.mark.parametrize("pause", ["kept-1", "kept-3"])
def test_a_stopped_conversion_continued_checks_the_whole_model_the_same(pause, trained, tmp_path):
    """Stopped after layer 1 or after the last layer was kept, then rerun: the kept layers run through
    the check as made ones do, and the output is the uninterrupted one's (mean pooling's here). Red
    when kept layers skip the check (the verdict never comes, the chosen starts are written)."""
    out = tmp_path / "out"
    stopped = _convert(out, pause)
    assert stopped.returncode == 143, stopped.stderr
    finished = _convert(out)
    assert finished.returncode == 0, finished.stderr
    assert "kept from the interrupted run" in finished.stdout
    record = json.loads((out / RECORD_FILE).read_text())
    want = trained["record"]["whole_model"]
    assert record["whole_model"]["written"] == want["written"] == "mean", record["whole_model"]
    assert record["whole_model"]["kl_chosen"] == pytest.approx(want["kl_chosen"], rel=1e-4)
    # the per-layer start choice of the kept layers comes back into the notes as measured then
    chosen = [[n for n in r["notes"] if n.startswith("start behind the key norm")] for r in (record, trained["record"])]
    assert len(chosen[1]) == 1 and chosen[0] == chosen[1], chosen
    written, uninterrupted, mean = (_tensors(f) for f in (out, trained["base"] / "fit", trained["base"] / "mean"))
    for name in written:
        torch.testing.assert_close(written[name], uninterrupted[name], rtol=0, atol=1e-6, msg=name)
        torch.testing.assert_close(written[name], mean[name], rtol=0, atol=1e-6, msg=name)


def test_a_sweep_checks_each_count_as_its_conversion_does(trained, tmp_path):
    """`uptrain.sweep --method fit --calib` on the trained key-norm model: each K/V count a user of one
    calibration stream, each checked on its own (the head pass one user at a time). Before: the sweep
    stopped with LayerGone (the two starts each took the layer's moments) and, once past that, two
    users' head passes ran into each other. Its 2-K/V-head model equals the single conversion's."""
    out = tmp_path / "sweep"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "uptrain.sweep", str(TRAINED), "--data", str(VALID_TXT),
                           "--out", str(out), "--method", "fit", "--calib", str(TRAIN_TXT),
                           "--calib-tokens", str(TOKENS), "--threads", "1"], capture_output=True, text=True, env=env,
                          cwd=REPO, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    verdicts = {kv: json.loads((out / f"kv{kv}" / RECORD_FILE).read_text())["whole_model"] for kv in (1, 2, 4)}
    assert all("kl_chosen" in v for v in verdicts.values()), verdicts
    want = trained["record"]["whole_model"]
    assert verdicts[2]["written"] == want["written"] and verdicts[2]["kl_mean"] == pytest.approx(want["kl_mean"],
                                                                                                 rel=1e-4)
    written, single = _tensors(out / "kv2"), _tensors(trained["base"] / "fit")
    for name in written:
        torch.testing.assert_close(written[name], single[name], rtol=0, atol=1e-6, msg=name)


# key norms that carry K/V heads, so that the conversion rewrites them: over the whole K projection
# (OLMo-2: [K/V heads x head_dim]) and per head (Cohere with use_qk_norm: [heads, head_dim])
KEY_NORMS = {"olmo2": ("olmo2", {}), "cohere": ("cohere", dict(use_qk_norm=True))}


def _forced(verdict: str):
    """`WholeModelCheck._judge` with its KLs measured but `verdict` written."""
    judge = whole_check.WholeModelCheck._judge
    return lambda self: {**judge(self), "written": verdict}


@pytest.mark.parametrize("case", sorted(KEY_NORMS))
def test_mean_poolings_start_written_by_the_check_rewrites_the_key_norms_too(case, tmp_path, monkeypatch,
                                                                             one_torch_thread):
    """Where the check writes mean pooling's start (its verdict forced here), the written model is a
    `--method mean` conversion's, tensor for tensor: the key norms that carry K/V heads included, which
    the fit's start rewrites differently (checked: the chosen starts' k_norm differs from mean
    pooling's). Red when the check's mean outputs leave a whole-K or per-head key norm unwritten
    (`layer_outputs._mean_outputs`): k_norm was the fit's, off by up to 0.51."""
    model_type, extra = KEY_NORMS[case]
    model = random_model(tiny_config(model_type, dict(extra, num_key_value_heads=8, vocab_size=512)), seed=0)
    with torch.no_grad():  # peaked attention: the keys (and so their norm) matter to the fit
        for name, p in model.named_parameters():
            if ".q_proj." in name or ".k_proj." in name:
                p.mul_(4.0)
    src = save(model, tmp_path / "src")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (src / f).write_bytes((EXAMPLE_MHA8 / f).read_bytes())
    convert(str(src), tmp_path / "pooled", 2, "mean")
    for verdict in ("mean", "chosen"):
        monkeypatch.setattr(whole_check.WholeModelCheck, "_judge", _forced(verdict))
        convert(str(src), tmp_path / verdict, 2, "fit", calibration=Calibration(TRAIN_TXT, 1024))
    record = json.loads((tmp_path / "mean" / RECORD_FILE).read_text())
    assert record["whole_model"]["written"] == "mean", record["whole_model"]
    written, pooled, chosen = (_tensors(tmp_path / f) for f in ("mean", "pooled", "chosen"))
    norms = sorted(name for name in written if "k_norm" in name)
    assert len(norms) == 2, sorted(written)  # one per layer
    assert any((chosen[n] - pooled[n]).abs().max() > 1e-3 for n in norms), "the fit left the key norms as pooled"
    assert written.keys() == pooled.keys()
    for name in written:
        torch.testing.assert_close(written[name], pooled[name], rtol=0, atol=1e-6, msg=name)
