"""The uptraining run, top to bottom: set up, resume, loop, finish (the CLI is __main__.py).

    train(config)
      setup_run      checks (config, run folder, models, budget, data) before any weights load,
                     then model, teacher, optimizer, data loader, trackers
      resume_state   the checkpoint's weights, optimizer, RNG and data position (if resuming; on
                     another process count grad_accum keeps the global batch: setup_run)
      train_steps    the loop (steps.py): forward, backward, step, log, eval, checkpoint, and on a stop
                     signal (SIGTERM/SIGUSR1/Ctrl-C, agreed by all processes) a checkpoint and Preempted
      finish_run     final validation, model folder with its card, loss plot

One readable loop in the spirit of nanoGPT; accelerate handles devices, processes, mixed
precision, state saving and trackers. See uptrain/train/config.py for every config field.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from uptrain.train.config import TrainConfig, to_dict
from uptrain.train.health import TrainingDiverged  # noqa: F401 (public here)
from uptrain.train.report import MetricsLog, plot_losses, save_final_model, write_held_out
from uptrain.train.run_state import (
    PREEMPTED_FILE, RUN_FILE, check_checkpoint_identity, check_run_dir, checkpoint_state, elastic_grad_accum,
    clear_run_dir, load_checkpoint, mark_finished,
)
from uptrain.train.runtime import check_deepspeed, check_shared_run_dir, deepspeed_facts, make_accelerator
from uptrain.train import shard
from uptrain.train.identity import run_identity
from uptrain.train.preempt import Preempted, StopRequest, stop_grace
from uptrain.train.setup import (
    ModelFolders, apply_threads, build_data, check_models, check_validation_size, make_optimizer,
    final_model_dtype, plan_run, resolve_models,
)
from uptrain.train.teacher_samples import check_samples_budget, ensure_teacher_samples
from uptrain.errors import UsageError
from uptrain.train.trainable import apply_trainable, param_numel, stage_steps, stages_line, trainable_line
from uptrain.train.steps import Run, sharded_io, train_steps


def train(config: TrainConfig) -> dict:
    """Run the training described by `config`; return the final metrics."""
    # SIGTERM/SIGUSR1/Ctrl-C: during set-up, StoppedInSetup at once; then a checkpoint after the step
    with StopRequest().installed() as stop:
        run = setup_run(config, stop)
        stop.connect(run.accelerator.process_index, run.accelerator.num_processes)
        stop.enter("checkpoint load" if run.resume_from else "step-0 evaluation")
        start_step, batches = resume_state(run)
        if start_step == 0 and config.eval.at_start:
            first = run.validate()
            run.log({"step": 0, **first})  # the alpha = 0 point: the converted model before training
            run.accelerator.print(f"step 0: val loss {first['val_loss']:.4f}, ppl {first['val_ppl']:.2f}")
        stop.phase_done()  # (a test hook: a stop here, after the load and the evaluation, is still in set-up)
        stop.setup_done()
        try:
            last_record = train_steps(run, start_step, batches, stop)
        except Preempted:
            run.accelerator.end_training()  # trackers flush what the steps logged
            raise
        return finish_run(run, last_record)


def setup_run(config: TrainConfig, stop: StopRequest | None = None) -> Run:
    """Check everything, then build model, teacher, optimizer and loader (nothing trained yet).

    `stop`: told which phase set-up is in (a stop signal meanwhile raises StoppedInSetup)."""
    enter = stop.enter if stop is not None else (lambda phase: None)
    enter("checks")
    run_dir = Path(config.run_dir)
    accelerator = make_accelerator(config, run_dir)
    world = accelerator.num_processes

    # --- checks first: config, run folder, models, budget, data; all before weights load ---
    apply_threads(config.threads)
    check_deepspeed(config, deepspeed_facts(accelerator))
    if config.shard == "fsdp2":
        shard.check_fsdp2(config, accelerator)
    if config.compile:
        shard.check_compile(accelerator.device.type)
    check_shared_run_dir(accelerator, run_dir)  # before any process reads it: all must see one folder
    resume_from = check_run_dir(run_dir, to_dict(config), config.resume, config.overwrite)
    config, state, lines = _resume_checks(config, resume_from, accelerator)
    plan = plan_run(config, world)
    ranges = []
    if config.trainable_stages:
        if world > 1:  # DDP/FSDP fix the set of parameters with gradients when they wrap the model
            raise UsageError("trainable_stages runs in one process for now; use one process or a single trainable")
        ranges = stage_steps(config.trainable_stages, plan.tokens_per_step, plan.steps, config.trainable)
    config_dict = to_dict(config)
    folders = resolve_models(config)
    tokenizer = check_models(config, folders)
    final_dtype, dtype_line = final_model_dtype(config, folders)
    data_config = config
    if config.data.train.teacher_samples is not None:  # the teacher writes the training text (once per run)
        check_samples_budget(config, plan.steps * plan.tokens_per_step)
        enter("teacher-samples generation")
        source, samples_line = ensure_teacher_samples(config, tokenizer, accelerator, folders.teacher)
        data_config = dataclasses.replace(config, data=dataclasses.replace(config.data, train=source))
        lines.append(samples_line)
    set_seed(config.seed)
    enter("data tokenization")
    data = build_data(data_config, tokenizer, plan, accelerator, state.get("samples", 0))
    check_validation_size(config, len(data.val))
    identity = run_identity(config_dict, accelerator.mixed_precision, data.fingerprint)
    if resume_from is not None:
        check_checkpoint_identity(resume_from, state, identity)
    grace_s, grace_source, grace_warning = stop_grace(config.stop_grace_s, os.environ)
    accelerator.wait_for_everyone()  # every rank has passed the checks before anything is removed
    if accelerator.is_main_process:
        _write_run_folder(config, run_dir, config_dict, data.held_out)

    # --- model, optional teacher, optimizer, loader ---
    enter("models loading")
    model, teacher, optimizer, loader = _build_training(config, folders, accelerator, data.train)
    n_params = sum(param_numel(p) for p in accelerator.unwrap_model(model).parameters())
    n_trained = sum(param_numel(p) for p in accelerator.unwrap_model(model).parameters() if p.requires_grad)
    accelerator.print(plan.describe(data_config, world, n_params, data.n_available, len(data.val)))
    for line in [*lines, dtype_line, trainable_line(config.trainable, n_trained, n_params),
                 *([stages_line(ranges)] if ranges else []), grace_line(grace_s, grace_source),
                 *([grace_warning] if grace_warning else [])]:
        accelerator.print(line)
    metrics = MetricsLog(run_dir / "metrics.jsonl", accelerator.is_main_process)
    return Run(config, accelerator, plan, run_dir, resume_from, tokenizer, data.val,
               model, teacher, optimizer, loader, metrics, folders, final_dtype, ranges, identity,
               grace_s, state.get("write_s"))


def _resume_checks(config: TrainConfig, resume_from: Path | None,
                   accelerator: Accelerator) -> tuple[TrainConfig, dict, list[str]]:
    """(config, the checkpoint's trainer state or {}, lines for the plan) of a run that may resume.

    The checkpoint's recorded identity is compared with the settings first (before any data is
    read; the data's fingerprint once it is known, in setup_run). Elastic resume: on another
    process count, grad_accum keeps the checkpoint's global batch (the returned config has it)."""
    if resume_from is None:
        return config, {}, []
    world = accelerator.num_processes
    state = checkpoint_state(resume_from)
    recorded_data = (state.get("identity") or {}).get("data_fingerprint")
    check_checkpoint_identity(resume_from, state, run_identity(to_dict(config), accelerator.mixed_precision,
                                                               recorded_data))
    accum = elastic_grad_accum(resume_from, state, world, config.batch.micro_batch, config.batch.grad_accum)
    if accum == config.batch.grad_accum:
        return config, state, []
    written = state.get("processes", "?")
    line = (f"checkpoint written by {written} process{'es' * (written != 1)}, resumed on {world}: "
            f"grad_accum {config.batch.grad_accum} -> {accum} keeps the global batch of "
            f"{accum * world * config.batch.micro_batch} sequences")
    return dataclasses.replace(config, batch=dataclasses.replace(config.batch, grad_accum=accum)), state, [line]


def _write_run_folder(config: TrainConfig, run_dir: Path, config_dict: dict, held_out) -> None:
    """The run folder as this start begins it (main process): cleared with overwrite, run.yaml
    written whole (a stop signal may come at any moment), the last stop's mark removed (this start
    continues that run), the held-out documents written for uptrain.eval."""
    if config.overwrite:
        clear_run_dir(run_dir, config.log.project)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / PREEMPTED_FILE).unlink(missing_ok=True)
    tmp = run_dir / f".{RUN_FILE}.tmp"
    tmp.write_text(yaml.safe_dump(config_dict, sort_keys=False))
    os.replace(tmp, run_dir / RUN_FILE)
    if held_out is not None:
        write_held_out(run_dir, held_out["text"])


def _build_training(config: TrainConfig, folders: ModelFolders, accelerator: Accelerator, train_blocks):
    """(model, teacher, optimizer, loader), prepared by accelerate (the model sharded first with shard=fsdp2)."""
    model, teacher = _load_models(config, folders, accelerator)
    if config.shard == "fsdp2":  # sharded by the trainer, before the optimizer sees the parameters
        model = shard.shard_model(model, accelerator, config.gradient_checkpointing, config.compile)
    optimizer = make_optimizer(model, config.optim)
    # Blocks are already in run order; accelerate gives process r every world-th batch, so one
    # step sees the same global batch whatever the number of processes. A stream (an
    # IterableDataset) is read by the main process only and its batches dispatched the same way:
    # process r gets the r-th of each group of `world` consecutive batches. A streaming source
    # cannot skip batches in the loader: the stream itself starts after the blocks the interrupted
    # run consumed (build_data's skip_blocks, the checkpoint's data position).
    dataset = train_blocks if config.data.train.streaming else train_blocks.with_format("torch")
    loader = DataLoader(dataset, batch_size=config.batch.micro_batch, shuffle=False)
    if config.shard == "fsdp2":  # accelerate would wrap the model in DDP: it prepares the loader only
        loader = accelerator.prepare(loader)
    else:
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    return model, teacher, optimizer, loader


def grace_line(grace_s: float | None, source: str) -> str:
    """The plan's line on stop signals and the grace this run assumes."""
    grace = "unknown" if grace_s is None else f"{grace_s:g} s"
    return f"stop signals (SIGTERM, SIGUSR1, Ctrl-C): checkpoint after the step, exit 75; grace {grace} ({source})"


def _load_models(config: TrainConfig, folders: ModelFolders,
                 accelerator: Accelerator) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """The model to train (fp32 master weights) and the frozen teacher, if distilling."""
    model = AutoModelForCausalLM.from_pretrained(folders.model, dtype=torch.float32)
    # frozen parameters: requires_grad False, not in the optimizer
    apply_trainable(model, config.trainable, *(s.trainable for s in config.trainable_stages))
    model.train()  # from_pretrained returns eval mode: no dropout (a resumed run skips the step-0 eval)
    sharded = config.shard == "fsdp2"  # shard_model applies checkpointing and compile per decoder layer
    if config.gradient_checkpointing and not sharded:
        # Recompute activations in backward: less memory, more compute (renamed in transformers 5.x).
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.config.use_cache = False
    if config.compile and not sharded:
        model = torch.compile(model)
    teacher = None
    if folders.teacher is not None:
        teacher_dtype = torch.bfloat16 if accelerator.mixed_precision == "bf16" else torch.float32
        teacher = AutoModelForCausalLM.from_pretrained(folders.teacher, dtype=teacher_dtype).to(accelerator.device)
        teacher.requires_grad_(False).eval()  # frozen: only a source of target distributions
    return model, teacher


def resume_state(run: Run) -> tuple[int, Iterator[dict]]:
    """Restore the checkpoint (weights, optimizer, RNG) if resuming.

    Returns the first step to run and the iterator of the run's remaining micro batches.
    """
    start_step = checkpoint_state(run.resume_from)["step"] if run.resume_from is not None else 0
    accum = run.config.batch.grad_accum
    # Skip what the interrupted run already consumed: the data order is fixed by the seed (a
    # stream was already started after the consumed blocks in setup_run).
    skip = start_step and not run.config.data.train.streaming
    batches = iter(run.accelerator.skip_first_batches(run.loader, start_step * accum) if skip else run.loader)
    if run.resume_from is not None:
        # Starting a data iterator draws from the RNG (the DataLoader's base seed; accelerate may
        # synchronise RNG states over processes): start it *before* restoring the checkpoint's
        # RNG states, so step start_step + 1 draws the dropout masks the uninterrupted run drew.
        first = next(batches, None)
        batches = itertools.chain([] if first is None else [first], batches)
        load_checkpoint(run.accelerator, run.resume_from, sharded_io(run, shard.load_sharded))
        run.accelerator.print(f"resuming from {run.resume_from} at step {start_step}")
    run.metrics.truncate_after(start_step if run.resume_from else -1)  # records past the checkpoint are redone
    flat = _flat(to_dict(run.config))
    run.accelerator.init_trackers(run.config.log.project, config={
        k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()})
    return start_step, batches


def finish_run(run: Run, last_record: dict) -> dict:
    """Final validation, the model folder with its card, the loss plot; return the final metrics."""
    config, accelerator, plan = run.config, run.accelerator, run.plan
    final_eval = run.validate()
    run.log({"step": plan.steps, **final_eval})
    against = (f"; against the teacher: KL {final_eval['val_kl_to_teacher']:.4f} nats/token, top-1 agreement "
               f"{final_eval['val_top1_agreement']:.1%}" if "val_kl_to_teacher" in final_eval else "")
    accelerator.print(f"step {plan.steps}: val loss {final_eval['val_loss']:.4f}, ppl {final_eval['val_ppl']:.2f}{against}")
    history = run.metrics.read()
    start_val = next((r["val_loss"] for r in history if r["step"] == 0 and "val_loss" in r), None)
    card = {
        "base model": config.model, "tokens": plan.steps * plan.tokens_per_step, "optimizer steps": plan.steps,
        "global batch (sequences x seq_len)": f"{plan.sequences_per_step} x {config.data.seq_len}",
        "processes": accelerator.num_processes, "peak lr": config.optim.lr,
        "distillation teacher": config.distill.teacher or "none",
        "training data": config.data.train.files or config.data.train.dataset
        or ("samples of the teacher" if config.data.train.teacher_samples else None),
        "val loss before / after": f"{start_val if start_val is None else round(start_val, 4)} / {final_eval['val_loss']:.4f}",
        "val perplexity after": round(final_eval["val_ppl"], 3), "mixed precision": accelerator.mixed_precision,
        **({"val KL to the teacher / top-1 agreement after": f"{final_eval['val_kl_to_teacher']:.4f} nats / "
            f"{final_eval['val_top1_agreement']:.1%}"} if "val_kl_to_teacher" in final_eval else {}),
    }
    save_final_model(accelerator, run.model, run.run_dir / "model", run.folders.model, card, dtype=run.save_dtype,
                     tokenizer_dir=run.folders.tokenizer, source_name=config.model)
    if accelerator.is_main_process:
        plot_losses(history, run.run_dir / "loss.png")
        mark_finished(run.run_dir, {"steps": plan.steps, "tokens": plan.steps * plan.tokens_per_step,
                                    "val_loss": final_eval["val_loss"]})
        accelerator.print(f"saved {run.run_dir / 'model'} and {run.run_dir / 'loss.png'}")
    accelerator.end_training()
    return {**final_eval, "last_loss": last_record.get("loss"), "steps": plan.steps}


def _flat(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1} (tracker hyper-parameters must be flat)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
