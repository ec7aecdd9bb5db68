"""The trainer on the real stories260K model and real TinyStories text, on CPU."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import (DEMO, GQA4, MHA8, REPO, need_models, read_metrics, stories_new_to_the_model, tiny_overrides,
                           train_losses)
from uptrain.train.run_state import FINISHED_FILE, complete_checkpoints
from uptrain.train.losses import kd_loss_sum, lm_loss_sum
from uptrain.train import train
from uptrain.train.__main__ import main
from uptrain.train.config import load_config


def run(tmp_path, name="run", **extra):
    need_models()
    run_dir = tmp_path / name
    return run_dir, train(load_config(DEMO, tiny_overrides(run_dir, **extra)))


def test_few_steps_lower_the_loss_and_leave_a_loadable_model(tmp_path):
    # Capitalised stories are new to this TinyStories model: a few steps must adapt it measurably.
    new_text, _ = stories_new_to_the_model(tmp_path)
    run_dir, result = run(tmp_path, steps=16, **{"log.log_with": "[tensorboard]", "eval.every": 8,
                                                  "data.train.files": f"[{new_text}]", "data.val": "null",
                                                  "data.val_fraction": 0.02})
    records = read_metrics(run_dir)
    val = [r["val_loss"] for r in records if "val_loss" in r]
    assert [r["step"] for r in records if "val_loss" in r] == [0, 8, 16]
    assert val[-1] < val[0] - 0.05, val  # real text, real model: validation loss goes down
    losses = train_losses(run_dir)
    assert sorted(losses) == list(range(1, 17))
    model_dir = run_dir / "model"
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    assert AutoConfig.from_pretrained(model_dir).num_key_value_heads == 4
    assert "Uptraining record" in (model_dir / "README.md").read_text()
    assert (model_dir / "tokenizer.json").is_file() and list(model_dir.glob("*.safetensors"))
    # The saved weights are the trained ones, not the starting ones, and they still work.
    start = AutoModelForCausalLM.from_pretrained(GQA4)
    assert not torch.equal(model.model.layers[0].self_attn.k_proj.weight, start.model.layers[0].self_attn.k_proj.weight)
    ids = torch.tensor([list(range(3, 67))])
    assert math.isfinite(lm_loss_sum(model(input_ids=ids).logits, ids)[0].item())
    assert (run_dir / "loss.png").stat().st_size > 0
    assert list((run_dir / "uptrain").rglob("events.out.tfevents*"))  # TensorBoard via accelerate
    assert result["val_loss"] == pytest.approx(val[-1])

    # A finished run is not resumed (that would redo its last steps and overwrite model/): one
    # line says it is finished and how to train further.
    args = tiny_overrides(run_dir, steps=16, **{"log.log_with": "[tensorboard]", "eval.every": 8,
                                                "data.train.files": f"[{new_text}]", "data.val": "null",
                                                "data.val_fraction": 0.02})
    before = (run_dir / "metrics.jsonl").read_text()
    assert main([str(DEMO), *args, "resume=latest"]) == 2
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_resume_after_a_kill_reproduces_the_uninterrupted_losses(tmp_path):
    need_models()
    steps = 30
    reference_dir, _ = run(tmp_path, "reference", steps=steps)
    reference = train_losses(reference_dir)

    # A real interruption: SIGKILL the run right after its first checkpoint is complete.
    run_dir = tmp_path / "interrupted"
    args = tiny_overrides(run_dir, steps=steps, **{"checkpoint.every": 4, "checkpoint.keep": 2})
    proc = subprocess.Popen([sys.executable, "-m", "uptrain.train", str(DEMO), *args], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not complete_checkpoints(run_dir) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    saved = complete_checkpoints(run_dir)
    assert saved, "no checkpoint was written before the kill"
    assert not (run_dir / "model").exists(), "the run finished before it could be interrupted"
    resumed_from = int(saved[-1].name.split("-")[-1])

    # A half-written checkpoint (no completion mark) must never be taken as latest.
    (run_dir / "checkpoints" / "checkpoint-99999999").mkdir()
    (run_dir / "checkpoints" / ".tmp-checkpoint-00000099").mkdir()
    assert complete_checkpoints(run_dir)[-1] == saved[-1]

    train(load_config(DEMO, args + ["resume=latest"]))
    resumed = train_losses(run_dir)
    assert sorted(resumed) == list(range(1, steps + 1))  # records past the checkpoint were redone
    for step in range(1, steps + 1):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), (step, resumed_from)
    assert len(complete_checkpoints(run_dir)) == 2  # keep: 2


def test_resume_with_dropout_restores_the_random_state(tmp_path, one_torch_thread):
    # With dropout on, every step draws masks from the RNG: a resumed run reproduces the
    # uninterrupted losses only if the checkpoint's RNG state (every process's) is restored.
    model = tmp_path / "dropout-model"
    shutil.copytree(REPO / "examples" / "stories260K-mha8", model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.2}))
    probe = AutoModelForCausalLM.from_pretrained(model).train()
    ids = torch.tensor([list(range(3, 40))])
    assert not torch.equal(probe(input_ids=ids).logits, probe(input_ids=ids).logits)  # dropout is live

    data = REPO / "examples" / "data"
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, steps=8, **{"model": model, "data.train.files": f"[{data / 'tinystories-train-sample.txt'}]",
                                               "data.val.files": f"[{data / 'tinystories-valid-sample.txt'}]",
                                               "checkpoint.every": 4, "checkpoint.keep": 2, "eval.max_batches": 1})
    train(load_config(DEMO, args))
    reference = train_losses(run_dir)
    shutil.rmtree(run_dir / "model")
    (run_dir / FINISHED_FILE).unlink()  # as if interrupted: a finished run refuses any resume
    shutil.rmtree(complete_checkpoints(run_dir)[-1])  # as if stopped right after step 4's checkpoint
    assert complete_checkpoints(run_dir)[-1].name == "checkpoint-00000004"
    train(load_config(DEMO, args + ["resume=latest"]))
    resumed = train_losses(run_dir)
    assert sorted(resumed) == list(range(1, 9))
    for step in range(1, 9):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step


def test_kd_loss_matches_a_hand_computation():
    torch.manual_seed(0)
    student, teacher = torch.randn(2, 5, 7), torch.randn(2, 5, 7)
    assert kd_loss_sum(teacher, teacher, 2.0).item() == pytest.approx(0.0, abs=1e-6)
    t = 2.0
    p = F.softmax(teacher[:, :-1] / t, -1)
    q = F.softmax(student[:, :-1] / t, -1)
    by_hand = t * t * (p * (p.log() - q.log())).sum()  # KL(teacher || student) on 2 x 4 targets
    assert kd_loss_sum(student, teacher, t).item() == pytest.approx(by_hand.item(), rel=1e-5)
    lm, n = lm_loss_sum(student, torch.zeros(2, 5, dtype=torch.long))
    assert n == 8 and lm.item() == pytest.approx(-F.log_softmax(student[:, :-1], -1)[..., 0].sum().item(), rel=1e-5)


def test_distillation_from_an_identical_teacher_has_zero_kl(tmp_path):
    # stories260K-mha8 computes the same function as the gqa4 student (K/V heads duplicated),
    # so KL(teacher || student) is 0 and the loss is (1 - alpha_kd) x the LM loss.
    need_models()
    student = tmp_path / "student"  # a converted model comes with a model card: it is extended
    shutil.copytree(GQA4, student)
    (student / "README.md").write_text("# Converted stories260K\n\nConversion record here.\n")
    run_dir, _ = run(tmp_path, steps=1, **{"optim.warmup_steps": 0, "model": student, "distill.teacher": MHA8, "distill.alpha_kd": 0.3,
                                           "distill.temperature": 2.0, "gradient_checkpointing": "true"})
    (record,) = [r for r in read_metrics(run_dir) if "loss" in r]
    assert record["kd_loss"] == pytest.approx(0.0, abs=1e-5)
    assert record["loss"] == pytest.approx(0.7 * record["lm_loss"] + 0.3 * record["kd_loss"], rel=1e-6)
    assert record["lm_loss"] > 1.0
    card = (run_dir / "model" / "README.md").read_text()
    assert card.startswith("# Converted stories260K\n\nConversion record here.") and "Uptraining record" in card
    assert str(MHA8) in card  # the teacher is part of the record


def test_non_finite_loss_stops_the_run_and_names_the_step(tmp_path, capsys):
    need_models()
    run_dir = tmp_path / "nan"
    args = tiny_overrides(run_dir, steps=12, **{"optim.lr": 1e12, "optim.warmup_steps": 0, "optim.grad_clip": 0,
                                                "checkpoint.every": 1, "checkpoint.keep": 1})
    assert main([str(DEMO), *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # above it: loading progress bars
    assert err.startswith("error: loss is") and "at step" in err
    bad_step = int(err.split("at step ")[1].split(";")[0])
    saved = complete_checkpoints(run_dir)
    assert saved and int(saved[-1].name.split("-")[-1]) == bad_step - 1  # the last good one
    assert not (run_dir / "model").exists()
