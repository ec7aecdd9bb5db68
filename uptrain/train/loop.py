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
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM

from uptrain.train.config import TrainConfig, to_dict
from uptrain.train.stop.health import TrainingDiverged  # noqa: F401 (public here)
from uptrain.train.plan.checked import (  # noqa: F401 (grace_line: public here too)
    Plan, apply_threads, check_data, check_run, grace_line,
)
from uptrain.train.plan.folders import ModelFolders
from uptrain.threads import available_memory
from uptrain.train.report.report import plot_losses, save_final_model
from uptrain.train.state.run_state import MetricsLog, begin_run_folder, load_checkpoint, mark_finished
from uptrain.train.parallel import shard
from uptrain.train.stop.preempt import Preempted, StopRequest
from uptrain.train.setup import build_data, make_accelerator, make_optimizer
from uptrain.train.model.cpu_attention import use_bf16_attention
from uptrain.train.model.teacher_cache import TeacherCache, cache_budget
from uptrain.train.model.teacher_samples import ensure_teacher_samples
from uptrain.train.model.trainable import apply_trainable, param_numel, stages_line, trainable_line
from uptrain.train.model.validate import validation_line
from uptrain.train.steps import Run, plain_lines_while, train_steps


def train(config: TrainConfig) -> dict:
    """Run the training described by `config`; return the final metrics."""
    # SIGTERM/SIGUSR1/Ctrl-C: during set-up, StoppedInSetup at once; then a checkpoint after the step
    with StopRequest().installed() as stop:
        run = setup_run(config, stop)
        stop.connect(run.accelerator.process_index, run.accelerator.num_processes)
        stop.enter("checkpoint load" if run.resume_from else "step-0 evaluation")
        start_step, batches = resume_state(run)
        if start_step == 0 and run.config.eval.at_start:
            with plain_lines_while(run, 0):
                first = run.validate()
            run.log({"step": 0, **first})  # the alpha = 0 point: the converted model before training
            run.accelerator.print(validation_line(0, first))
        stop.phase_done()  # (a test hook: a stop here, after the load and the evaluation, is still in set-up)
        stop.setup_done()
        try:
            last_record = train_steps(run, start_step, batches, stop)
        except Preempted:
            run.accelerator.end_training()  # trackers flush what the steps logged
            raise
        with plain_lines_while(run, run.plan.steps):
            return finish_run(run, last_record)


def setup_run(config: TrainConfig, stop: StopRequest | None = None) -> Run:
    """Check everything (the plan), then build model, teacher, optimizer and loader (nothing trained yet).

    `stop`: told which phase set-up is in (a stop signal meanwhile raises StoppedInSetup)."""
    enter = stop.enter if stop is not None else (lambda phase: None)
    enter("checks")
    accelerator = make_accelerator(config, Path(config.run_dir))  # the launch: processes, precision, sharding
    apply_threads(config.threads)
    # --- every check, before any data is read or weights load: the plan (uptrain/train/plan/) ---
    plan, tokenizer = check_run(config, accelerator)
    lines, data_config = list(plan.lines), plan.config
    if plan.config.data.train.teacher_samples is not None:  # the teacher writes the training text (once per run)
        enter("teacher-samples generation")
        source, samples_line = ensure_teacher_samples(plan.config, tokenizer, accelerator, plan.folders.teacher)
        data_config = dataclasses.replace(plan.config, data=dataclasses.replace(plan.config.data, train=source))
        lines.append(samples_line)
    set_seed(plan.config.seed)
    enter("data tokenization")
    data = build_data(data_config, tokenizer, plan, accelerator, plan.resumed.get("samples", 0))
    plan = check_data(plan, len(data.val), data.fingerprint)
    lines += calibration_overlap_lines(plan.config, data.held_out)
    accelerator.wait_for_everyone()  # every rank has passed the checks before anything is removed
    if accelerator.is_main_process:  # cleared with overwrite, run.yaml, the held-out documents for uptrain.eval
        begin_run_folder(plan.run_dir, plan.config_dict, plan.config.overwrite, plan.config.log.project,
                         None if data.held_out is None else data.held_out["text"])

    # --- model, optional teacher, optimizer, loader ---
    enter("models loading")
    model, teacher, optimizer, loader = _build_training(plan, accelerator, data.train)
    n_params = sum(param_numel(p) for p in accelerator.unwrap_model(model).parameters())
    n_trained = sum(param_numel(p) for p in accelerator.unwrap_model(model).parameters() if p.requires_grad)
    accelerator.print(plan.describe(data_config, n_params, data.n_available, len(data.val)))
    ranges = list(plan.stage_ranges)
    for line in [*lines, plan.models.dtype_line, trainable_line(plan.config.trainable, n_trained, n_params),
                 *([stages_line(ranges)] if ranges else []), grace_line(plan.grace_s, plan.grace_source),
                 *([plan.grace_warning] if plan.grace_warning else [])]:
        accelerator.print(line)
    cache = _teacher_cache(plan, accelerator, data.n_available)
    if cache is not None:
        accelerator.print(f"teacher cache: the source's log-probabilities of each block kept for its next reading, "
                          f"up to {cache.max_bytes / 1e9:.1f} GB per process in float16 (distill.teacher_cache_gb)")
    metrics = MetricsLog(plan.run_dir / "metrics.jsonl", accelerator.is_main_process)
    return Run(plan, accelerator, tokenizer, data.val, model, teacher, optimizer, loader, metrics,
               plan.resumed.get("write_s"), cache)


def _teacher_cache(plan: Plan, accelerator: Accelerator, n_available: int | None) -> TeacherCache | None:
    """The cache of the teacher's outputs per block (uptrain/train/model/teacher_cache.py), or None: no teacher,
    attention matching (it needs the teacher's layers at every step), or a budget of 0 (`cache_budget`)."""
    d = plan.config.distill
    if plan.folders.teacher is None or d.attention_match > 0:
        return None
    reads_again = n_available is not None and plan.steps * plan.sequences_per_step > n_available
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    budget = cache_budget(d.teacher_cache_gb, accelerator.device.type == "cpu", reads_again, available_memory(),
                          processes)
    return TeacherCache(budget) if budget > 0 else None


def calibration_overlap_lines(config, held_out) -> list[str]:
    """The warning when the validation documents (held out of data.train, or a local data.val) were
    calibration text of the conversion being uptrained (`uptrain.data.overlap`); [] when none were."""
    from uptrain.data import read_documents
    from uptrain.data.overlap import calibration_overlap_warning

    model, val = Path(str(config.model)), config.data.val
    if not model.is_dir():
        return []
    if held_out is not None:
        texts, named = list(held_out["text"]), f"the held-out {config.data.val_fraction:g} of data.train"
    elif val is not None and val.files and not val.streaming:
        texts, named = read_documents(val), f"data.val {', '.join(map(str, val.files))}"
    else:
        return []
    line = calibration_overlap_warning(model, texts, named)
    return [line] if line else []


def _build_training(plan: Plan, accelerator: Accelerator, train_blocks):
    """(model, teacher, optimizer, loader), prepared by accelerate (the model sharded first with shard=fsdp2)."""
    config = plan.config
    model, teacher = _load_models(config, plan.folders, accelerator)
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
    if config.bf16_attention:  # both models' training attention (a CPU run: checked in the plan)
        for m in (model, teacher) if teacher is not None else (model,):
            use_bf16_attention(getattr(m, "_orig_mod", m))
    return model, teacher


def resume_state(run: Run) -> tuple[int, Iterator[dict]]:
    """Restore the checkpoint (weights, optimizer, RNG) if resuming.

    Returns the first step to run and the iterator of the run's remaining micro batches.
    """
    start_step = run.plan.resumed["step"] if run.resume_from is not None else 0
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
        load_checkpoint(run.accelerator, run.resume_from,
                        shard.sharded_io(run.model, run.optimizer, shard.load_sharded))
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
    accelerator.print(validation_line(plan.steps, final_eval))
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
    if run.teacher_cache is not None:
        c = run.teacher_cache
        accelerator.print(f"teacher cache: {c.hits / max(1, c.hits + c.misses):.0%} of the source's outputs came from "
                          f"memory ({len(c.blocks):,} blocks, {c.bytes / 1e9:.2f} GB)")
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
