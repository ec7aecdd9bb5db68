"""The uptraining run: set up, resume, loop, finish (the CLI is uptrain/train/__main__.py).

One readable loop in the spirit of nanoGPT; accelerate handles devices, processes, mixed
precision, state saving and trackers. See uptrain/train_config.py for every config field.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DistributedType, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM

from uptrain.train.run_state import (
    RUN_FILE, STATE_FILE, check_run_dir, clear_run_dir, load_checkpoint, save_checkpoint,
)
from uptrain.errors import UsageError
from uptrain.train.losses import kd_loss_sum, lm_loss_sum
from uptrain.train.config import TrainConfig, to_dict
from uptrain.train.report import MetricsLog, plot_losses, save_final_model
from uptrain.train.setup import build_data, check_models, lr_at, make_optimizer, plan_run


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the run stops and keeps its last good checkpoint."""


def make_accelerator(config: TrainConfig, run_dir: Path) -> Accelerator:
    """An Accelerator for this machine; trackers named in log.log_with."""
    if "wandb" in config.log.log_with:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise UsageError("log.log_with asks for wandb but it is not installed; pip install wandb") from None
    return Accelerator(
        # Without cpu=True on a machine without CUDA, `accelerate launch --multi_gpu` ranks would
        # not join one process group: each would silently train alone.
        cpu=not torch.cuda.is_available(),
        mixed_precision=config.mixed_precision,
        log_with=config.log.log_with or None,
        project_dir=str(run_dir),
    )


@torch.no_grad()
def validate_blocks(model, val_blocks, accelerator: Accelerator, batch_size: int, max_batches: int | None) -> dict:
    """In-loop validation: loss over packed validation blocks (the training data format).

    Every block is a full seq_len window cut from the concatenated token stream, so tokens near
    a block start see little context: this is NOT uptrain.eval's per-document strided perplexity
    (each document scored alone, every token with up to max_length of context), and the two
    numbers differ; compare models with uptrain.eval, watch the run with this.

    The first `max_batches` x `batch_size` blocks (all when None) are split into equal contiguous
    shares, one per process: sharded models (FSDP) run the same number of forwards everywhere,
    and the blocks evaluated do not depend on the number of processes (up to a remainder).
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    n_blocks = len(val_blocks) if max_batches is None else min(len(val_blocks), max_batches * batch_size)
    per_rank = n_blocks // world
    shard = val_blocks.select(range(rank * per_rank, (rank + 1) * per_rank))
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # [loss sum, tokens]
    model.eval()
    for start in range(0, per_rank, batch_size):
        ids = torch.tensor(shard[start:start + batch_size]["input_ids"], device=accelerator.device)
        loss_sum, n = lm_loss_sum(model(input_ids=ids).logits, ids)
        sums += torch.stack([loss_sum.double(), torch.tensor(float(n), dtype=torch.float64, device=sums.device)])
    model.train()
    total_loss, tokens = accelerator.reduce(sums, reduction="sum").tolist()
    loss = total_loss / max(tokens, 1.0)
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)), "val_tokens": int(tokens)}


def train(config: TrainConfig) -> dict:
    """Run the training described by `config`; return the final metrics."""
    run_dir = Path(config.run_dir)
    accelerator = make_accelerator(config, run_dir)
    main = accelerator.is_main_process
    world = accelerator.num_processes

    # --- checks first: config, run folder, models, budget, data; all before weights load ---
    if accelerator.distributed_type == DistributedType.DEEPSPEED and config.batch.grad_accum > 1:
        # DeepSpeed steps inside backward(); the manual accumulation below would step every micro batch.
        raise UsageError("with DeepSpeed set batch.grad_accum=1 and raise batch.micro_batch instead")
    plan = plan_run(config, world)
    config_dict = to_dict(config)
    resume_from = check_run_dir(run_dir, config_dict, config.resume, config.overwrite)
    tokenizer = check_models(config)
    set_seed(config.seed)
    # A streaming source cannot skip batches in the loader: the stream itself starts after the
    # blocks the interrupted run consumed (the checkpoint's data position).
    consumed = json.loads((resume_from / STATE_FILE).read_text())["samples"] if resume_from is not None else 0
    train_blocks, val_blocks, n_available = build_data(config, tokenizer, plan, accelerator, consumed)
    streaming = config.data.train.streaming
    accelerator.wait_for_everyone()  # every rank has passed the checks before anything is removed
    if main:
        if config.overwrite:
            clear_run_dir(run_dir, config.log.project)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / RUN_FILE).write_text(yaml.safe_dump(config_dict, sort_keys=False))

    # --- model, optional teacher, optimizer ---
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=torch.float32)  # fp32 master weights
    if config.gradient_checkpointing:
        # Recompute activations in backward: less memory, more compute (renamed in transformers 5.x).
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
        model.config.use_cache = False
    if config.compile:
        model = torch.compile(model)
    teacher = None
    if config.distill.teacher:
        teacher_dtype = torch.bfloat16 if config.mixed_precision == "bf16" else torch.float32
        teacher = AutoModelForCausalLM.from_pretrained(config.distill.teacher, dtype=teacher_dtype).to(accelerator.device)
        teacher.requires_grad_(False).eval()  # frozen: only a source of target distributions
    optimizer = make_optimizer(model, config.optim)
    micro, accum = config.batch.micro_batch, config.batch.grad_accum
    # Blocks are already in run order; accelerate gives process r every world-th batch, so one
    # step sees the same global batch whatever the number of processes. A stream (an
    # IterableDataset) is read by the main process only and its batches dispatched the same way:
    # process r gets the r-th of each group of `world` consecutive batches.
    dataset = train_blocks if streaming else train_blocks.with_format("torch")
    loader = DataLoader(dataset, batch_size=micro, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    start_step = 0
    if resume_from is not None:
        start_step = load_checkpoint(accelerator, resume_from)["step"]
    metrics = MetricsLog(run_dir / "metrics.jsonl", main)
    metrics.truncate_after(start_step if resume_from else -1)  # records past the checkpoint are redone
    n_params = sum(p.numel() for p in accelerator.unwrap_model(model).parameters())
    accelerator.print(plan.describe(config, world, n_params, n_available, len(val_blocks)))
    if resume_from:
        accelerator.print(f"resuming from {resume_from} at step {start_step}")
    tracker_config = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in _flat(config_dict).items()}
    accelerator.init_trackers(config.log.project, config=tracker_config)

    def log(record: dict) -> None:
        metrics.write(record)
        accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    eval_bs = config.eval.batch_size or micro
    if start_step == 0:
        first_eval = validate_blocks(model, val_blocks, accelerator, eval_bs, config.eval.max_batches)
        log({"step": 0, **first_eval})  # the alpha = 0 point: the converted model before training
        accelerator.print(f"step 0: val loss {first_eval['val_loss']:.4f}, ppl {first_eval['val_ppl']:.2f}")

    # Skip what the interrupted run already consumed: the data order is fixed by the seed.
    batches = iter(accelerator.skip_first_batches(loader, start_step * accum) if start_step and not streaming else loader)
    bar = tqdm(total=plan.steps, initial=start_step, disable=not (main and config.log.progress_bar), desc="train")
    t_start, tokens_seen, record = time.time(), 0, {}
    for step in range(start_step, plan.steps):
        lr = lr_at(step, plan.steps, config.optim)
        for group in optimizer.param_groups:
            group["lr"] = lr
        window = [next(batches)["input_ids"] for _ in range(accum)]  # each [micro_batch, seq_len]
        # Normalise by the target tokens of the whole step on all processes (sum / global count),
        # not by a mean of per-batch means. All blocks are full now, but the rule stays right
        # if padding or masking ever appears.
        local_tokens = torch.tensor(float(sum(ids[:, 1:].numel() for ids in window)), device=accelerator.device)
        global_tokens = accelerator.reduce(local_tokens, reduction="sum").item()
        sums = torch.zeros(3, device=accelerator.device)  # [loss, lm, kd] summed over tokens
        for i, ids in enumerate(window):
            # Gradients are all-reduced only on the last micro batch of the step.
            sync = contextlib.nullcontext() if i == accum - 1 else accelerator.no_sync(model)
            with sync:
                logits = model(input_ids=ids).logits  # [micro_batch, seq_len, vocab]
                lm, _ = lm_loss_sum(logits, ids)
                kd = torch.zeros((), device=lm.device)
                if teacher is not None:
                    with torch.no_grad(), accelerator.autocast():
                        teacher_logits = teacher(input_ids=ids).logits
                    kd = kd_loss_sum(logits, teacher_logits, config.distill.temperature)
                    loss = config.distill.alpha_kd * kd + (1 - config.distill.alpha_kd) * lm
                else:
                    loss = lm
                # DDP averages gradients over processes; x world turns that into sum / global count.
                accelerator.backward(loss * world / global_tokens)
                sums += torch.stack([loss.detach(), lm.detach(), kd.detach()]).float()
        loss, lm, kd = (accelerator.reduce(sums, reduction="sum") / global_tokens).tolist()
        if not math.isfinite(loss):
            # Stop before the update so the weights and the last checkpoint stay good.
            raise TrainingDiverged(f"loss is {loss} at step {step + 1}; stopped (last good checkpoint kept in {run_dir / 'checkpoints'})")
        grad_norm = accelerator.clip_grad_norm_(model.parameters(), config.optim.grad_clip) if config.optim.grad_clip > 0 else None
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

        done = step + 1
        tokens_seen += plan.tokens_per_step
        tok_s = tokens_seen / (time.time() - t_start)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}")
        if done - start_step == 3 and main:
            bar.write(f"ETA: {(plan.steps - done) * plan.tokens_per_step / tok_s / 60:.1f} min at {tok_s:,.0f} tokens/s")
        if done % config.log.every == 0 or done == plan.steps:
            record = {"step": done, "loss": loss, "lm_loss": lm, "lr": lr, "tokens": done * plan.tokens_per_step, "tok_per_s": tok_s}
            if teacher is not None:
                record["kd_loss"] = kd
            if grad_norm is not None:
                record["grad_norm"] = float(grad_norm)
            log(record)
        if config.eval.every and done % config.eval.every == 0 and done != plan.steps:
            log({"step": done, **validate_blocks(model, val_blocks, accelerator, eval_bs, config.eval.max_batches)})
        if config.checkpoint.every and done % config.checkpoint.every == 0:
            state = {"step": done, "samples": done * plan.sequences_per_step, "tokens": done * plan.tokens_per_step}
            save_checkpoint(accelerator, run_dir, done, state, config.checkpoint.keep)
    bar.close()

    final_eval = validate_blocks(model, val_blocks, accelerator, eval_bs, config.eval.max_batches)
    log({"step": plan.steps, **final_eval})
    accelerator.print(f"step {plan.steps}: val loss {final_eval['val_loss']:.4f}, ppl {final_eval['val_ppl']:.2f}")
    history = metrics.read()
    start_val = next((r["val_loss"] for r in history if r["step"] == 0 and "val_loss" in r), None)
    card = {
        "base model": config.model, "tokens": plan.steps * plan.tokens_per_step, "optimizer steps": plan.steps,
        "global batch (sequences x seq_len)": f"{plan.sequences_per_step} x {config.data.seq_len}",
        "processes": world, "peak lr": config.optim.lr, "distillation teacher": config.distill.teacher or "none",
        "training data": config.data.train.files or config.data.train.dataset,
        "val loss before / after": f"{start_val if start_val is None else round(start_val, 4)} / {final_eval['val_loss']:.4f}",
        "val perplexity after": round(final_eval["val_ppl"], 3), "mixed precision": config.mixed_precision,
    }
    save_final_model(accelerator, model, tokenizer, run_dir / "model", Path(config.model), card)
    if main:
        plot_losses(history, run_dir / "loss.png")
        accelerator.print(f"saved {run_dir / 'model'} and {run_dir / 'loss.png'}")
    accelerator.end_training()
    return {**final_eval, "last_loss": record.get("loss"), "steps": plan.steps}


def _flat(d: dict, prefix: str = "") -> dict:
    """{"a": {"b": 1}} -> {"a.b": 1} (tracker hyper-parameters must be flat)."""
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out
