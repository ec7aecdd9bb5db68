"""The trainer on the real stories260K model and real TinyStories text, on CPU."""

from __future__ import annotations

import json
import math
import os
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
from uptrain.train.state.run_state import FINISHED_FILE, complete_checkpoints
from uptrain.train.model.losses import kd_loss_sum, lm_loss_sum
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
    shutil.rmtree(run_dir / "model")  # as if the run had stopped before finishing:
    (run_dir / FINISHED_FILE).unlink()  # no model, no finished mark
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


_BLOCK_TENSORBOARD = '''
import sys
from importlib.machinery import PathFinder

class _WithoutTensorBoard(PathFinder):
    """The path finder, blind to tensorboard: as if it were not installed."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in ("tensorboard", "tensorboardX"):
            return None
        return PathFinder.find_spec(name, path, target)

sys.meta_path[:] = [_WithoutTensorBoard if f is PathFinder else f for f in sys.meta_path]
'''


def test_tensorboard_tracker_without_tensorboard_is_refused_in_one_line(tmp_path):
    # log.log_with defaults to [tensorboard], an optional extra: accelerate alone only warns and
    # the run logs nothing. A real process in which tensorboard cannot be imported (sitecustomize).
    need_models()
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_BLOCK_TENSORBOARD)
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    probe = subprocess.run([sys.executable, "-c", "import tensorboard"], env=env, capture_output=True, text=True)
    assert "No module named 'tensorboard'" in probe.stderr  # the block works
    args = tiny_overrides(run_dir, steps=1, **{"optim.warmup_steps": 0, "log.log_with": "[tensorboard]"})
    proc = subprocess.run([sys.executable, "-m", "uptrain.train", str(DEMO), *args], cwd=REPO, env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr[-2000:]
    assert "tensorboard" in proc.stderr and "pip install" in proc.stderr and "log.log_with" in proc.stderr
    assert not run_dir.exists()


def _poison_gradient(param: torch.nn.Parameter, at_call: int) -> list[int]:
    """Make `param`'s gradient NaN from its `at_call`-th backward on (a real autograd hook); the
    loss stays finite. Returns the call counter."""
    calls = [0]

    def hook(grad):
        calls[0] += 1
        return grad * float("nan") if calls[0] >= at_call else grad

    param.register_hook(hook)
    return calls


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_non_finite_gradient_with_a_finite_loss_stops_before_the_update(tmp_path, grad_clip):
    from safetensors.torch import load_file
    from uptrain.train.loop import TrainingDiverged, resume_state, setup_run, train_steps

    need_models()
    run_dir = tmp_path / "nan-grad"
    config = load_config(DEMO, tiny_overrides(run_dir, steps=4, **{
        "optim.warmup_steps": 0, "optim.grad_clip": grad_clip, "checkpoint.every": 1, "checkpoint.keep": 5,
        "eval.at_start": "false"}))
    run = setup_run(config)
    inner = run.accelerator.unwrap_model(run.model)
    weight = inner.model.layers[0].self_attn.q_proj.weight
    _poison_gradient(weight, at_call=2 * 2 + 1)  # grad_accum 2: step 3's first micro batch
    start, batches = resume_state(run)
    with pytest.raises(TrainingDiverged, match=r"gradient norm is nan at step 3.*before the update"):
        train_steps(run, start, batches)
    assert [p.name for p in complete_checkpoints(run_dir)] == ["checkpoint-00000001", "checkpoint-00000002"]
    saved = load_file(complete_checkpoints(run_dir)[-1] / "model.safetensors")
    state = inner.state_dict()
    for name, tensor in saved.items():  # the weights are those of the last good checkpoint: no step applied
        assert torch.isfinite(state[name]).all() and torch.equal(state[name], tensor), name
    assert not (run_dir / "model").exists()


def _safetensors_dtypes(folder) -> set[str]:
    from uptrain.convert.io.passthrough import read_header

    return {meta["dtype"] for file in folder.glob("*.safetensors")
            for name, meta in read_header(file)[0].items() if name != "__metadata__"}


def test_final_model_is_saved_in_the_source_dtype(tmp_path, capsys):
    need_models()
    source = tmp_path / "bf16-source"  # the real stories260K stored in bfloat16, like most Hub checkpoints
    AutoModelForCausalLM.from_pretrained(GQA4, dtype=torch.bfloat16).save_pretrained(source)
    for name in ("tokenizer.json", "tokenizer_config.json", "LICENSE"):
        shutil.copyfile(GQA4 / name, source / name)
    assert _safetensors_dtypes(source) == {"BF16"}
    for save_dtype, stored in ((None, "BF16"), ("float32", "F32")):
        run_dir = tmp_path / f"run-{save_dtype}"
        extra = {} if save_dtype is None else {"save_dtype": save_dtype}
        assert main([str(DEMO), *tiny_overrides(run_dir, steps=1, **{"optim.warmup_steps": 0, "model": source,
                                                                    "eval.at_start": "false", **extra})]) == 0
        model_dir = run_dir / "model"
        assert _safetensors_dtypes(model_dir) == {stored}, save_dtype
        plan = {None: "final model: saved in bfloat16, the source's dtype", "float32": "final model: saved in float32"}
        printed = capsys.readouterr().out
        assert plan[save_dtype] in printed
        # what its val loss is, and why uptrain.eval's differs (the plan says it before step 1)
        assert "val loss: the mean over the " in printed and "documents packed end to end into 64-token blocks" in printed
        assert "uptrain.eval scores each document on its own in windows of the model's context" in printed
        assert AutoConfig.from_pretrained(model_dir).dtype == {"BF16": torch.bfloat16, "F32": torch.float32}[stored]


def test_final_model_folder_is_ready_to_publish(tmp_path):
    # Publishable as is: files readable by others (the umask honoured, not 0600), the source's
    # tokenizer files byte for byte (no loader flags of this machine such as "is_local" added).
    need_models()
    umask = os.umask(0o022)
    os.umask(umask)
    run_dir = tmp_path / "run"
    assert main([str(DEMO), *tiny_overrides(run_dir, steps=1, **{"optim.warmup_steps": 0,
                                                                "eval.at_start": "false"})]) == 0
    model_dir = run_dir / "model"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).read_bytes() == (GQA4 / name).read_bytes(), name
    for file in model_dir.iterdir():
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, (file.name, oct(file.stat().st_mode))
    assert oct(model_dir.stat().st_mode & 0o777) == oct(0o777 & ~umask)


def test_a_step_in_one_micro_batch_trains_as_its_accumulated_micro_batches(tmp_path):
    """The demo's CPU choice (uptrain.demo.steps.one_micro_batch): 4 blocks x 2 accumulated and 8 blocks in one
    micro batch are the same step (the same blocks, the summed gradient over the step's tokens), so the same
    losses, gradient norms and validation. Plain SGD (an update proportional to the gradient), distilled at
    alpha_kd 1 (where the LM term is reported without a graph) and at 0.5 (where both terms train)."""
    for alpha in (1.0, 0.5):
        records = {}
        for micro, accum in ((4, 2), (8, 1)):
            run_dir, _ = run(tmp_path, f"a{alpha}-m{micro}", steps=4, **{
                "optim.name": "sgd", "optim.lr": 0.1, "optim.grad_clip": 1000.0, "distill.teacher": MHA8,
                "distill.alpha_kd": alpha, "batch.micro_batch": micro, "batch.grad_accum": accum, "log.every": 1,
                "eval.every": 4, "eval.batch_size": 3, "eval.max_batches": 1})
            records[micro] = read_metrics(run_dir)
        assert len(records[4]) == len(records[8]) >= 5
        for accumulated, one in zip(records[4], records[8]):
            assert accumulated.keys() == one.keys()
            for key in ("loss", "lm_loss", "kd_loss", "grad_norm", "val_loss", "val_kl_to_teacher"):
                if key in one:
                    assert one[key] == pytest.approx(accumulated[key], rel=1e-5, abs=1e-7), (alpha, key, one["step"])


def test_a_loss_term_of_weight_zero_is_reported_without_a_graph():
    """_step_loss: at alpha_kd 1 the LM loss is only reported (no graph, no backward through the logits); at
    alpha_kd 0 the KL is; in between both train. The loss is the same weighted sum either way."""
    from types import SimpleNamespace

    from accelerate import Accelerator

    from uptrain.train.config import DistillConfig
    from uptrain.train.steps import _step_loss

    need_models()
    student, teacher = AutoModelForCausalLM.from_pretrained(GQA4), AutoModelForCausalLM.from_pretrained(MHA8).eval()
    ids = torch.randint(3, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    for alpha, lm_graph, kd_graph in ((1.0, False, True), (0.0, True, False), (0.5, True, True)):
        run_ = SimpleNamespace(teacher=teacher, teacher_cache=None, accelerator=Accelerator(cpu=True),
                               config=SimpleNamespace(distill=DistillConfig(teacher=str(MHA8), alpha_kd=alpha)))
        logits = student(input_ids=ids).logits
        loss, lm, kd = _step_loss(run_, logits, ids, [])
        assert (lm.requires_grad, kd.requires_grad, loss.requires_grad) == (lm_graph, kd_graph, True), alpha
        assert loss.item() == pytest.approx(alpha * kd.item() + (1 - alpha) * lm.item(), rel=1e-6)
        assert lm.item() == pytest.approx(lm_loss_sum(logits, ids)[0].item(), rel=1e-6)
        assert kd.item() == pytest.approx(kd_loss_sum(logits, teacher(input_ids=ids).logits, 1.0).item(), rel=1e-6)
