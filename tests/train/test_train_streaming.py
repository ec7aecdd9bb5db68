"""Streaming training data: packed on the fly, budgeted, resumable (real stories260K, CPU)."""

from __future__ import annotations

import shutil

import pytest

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, TRAIN_TXT, need_models, read_metrics, stories_new_to_the_model, tiny_overrides, train_losses
from uptrain.train.state.run_state import FINISHED_FILE, complete_checkpoints
from uptrain.errors import UsageError
from uptrain.train import train
from uptrain.train.config import load_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # a tiny model: one thread is fastest
STEPS = 8


def test_streaming_run_lowers_the_loss_and_resumes_on_the_same_data(tmp_path):
    need_models()
    train_txt, val_txt = stories_new_to_the_model(tmp_path)
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, steps=STEPS, **{
        "data.train.files": f"[{train_txt}]", "data.train.streaming": "true", "data.shuffle_buffer": 64,
        "data.val.files": f"[{val_txt}]", "data.val.streaming": "true", "checkpoint.every": 4,
        "checkpoint.keep": 2})
    result = train(load_config(DEMO, args))
    val = [r["val_loss"] for r in read_metrics(run_dir) if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0] - 0.05, val  # the model learnt from the stream
    assert result["steps"] == STEPS
    reference = train_losses(run_dir)
    assert sorted(reference) == list(range(1, STEPS + 1))

    # Interrupted after the checkpoint of step 4: the resumed run skips the 4 x 8 blocks already
    # consumed in the deterministic stream and reproduces the uninterrupted losses.
    shutil.rmtree(run_dir / "model")  # as if the run had stopped before finishing:
    (run_dir / FINISHED_FILE).unlink()  # no model, no finished mark
    shutil.rmtree(complete_checkpoints(run_dir)[-1])
    assert complete_checkpoints(run_dir)[-1].name == "checkpoint-00000004"
    train(load_config(DEMO, args + ["resume=latest"]))
    resumed = train_losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step


def test_stream_shorter_than_the_budget_fails_unless_repeat_data(tmp_path):
    need_models()
    short = tmp_path / "short.txt"
    short.write_text("\n".join(TRAIN_TXT.read_text().splitlines()[:3]) + "\n")  # a few blocks of 64 tokens
    args = tiny_overrides(tmp_path / "run", steps=2, **{"data.train.files": f"[{short}]", "data.train.streaming": "true"})
    with pytest.raises(UsageError, match="stream .* ended after .* set data.repeat_data=true"):
        train(load_config(DEMO, args))
    result = train(load_config(DEMO, tiny_overrides(tmp_path / "again", steps=2, **{
        "data.train.files": f"[{short}]", "data.train.streaming": "true", "data.repeat_data": "true"})))
    assert result["steps"] == 2 and result["last_loss"] is not None
