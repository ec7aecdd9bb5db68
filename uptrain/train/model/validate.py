"""In-loop validation: the loss over packed validation blocks, split over the processes; with a
teacher (distillation), how closely the model behaves like it on the same tokens."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from uptrain.train.model.losses import kd_loss_sum, lm_loss_sum


def eval_share(n_blocks: int, world: int, rank: int) -> range:
    """Process `rank`'s contiguous share of `n_blocks`: the first n_blocks % world ranks get one more."""
    base, extra = divmod(n_blocks, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@torch.no_grad()
def validate_blocks(model, val_blocks, accelerator: Accelerator, batch_size: int, max_batches: int | None,
                    teacher=None) -> dict:
    """In-loop validation: loss over packed validation blocks (the training data format).

    Every block is a full seq_len window cut from the concatenated token stream, so tokens near
    a block start see little context: this is NOT uptrain.eval's per-document strided perplexity
    (each document scored alone, every token with up to max_length of context), and the two
    numbers differ; compare models with uptrain.eval, watch the run with this.

    The first `max_batches` x `batch_size` blocks (all when None) are all evaluated, whatever the
    number of processes: each process scores a contiguous share (shares differ by at most one
    block) and (loss sum, tokens) are summed over processes. Every process runs the same number
    of forwards, as sharded models (FSDP) need: one whose share is used up runs a forward on
    block 0 that is not counted.

    With a `teacher` (the distillation's, usually the source model) also, over the same target
    tokens: `val_kl_to_teacher`, the mean KL(teacher || model) in nats (temperature 1), and
    `val_top1_agreement`, the share where both argmaxes agree (uptrain.eval --reference's
    `kl_to_source` / `top1_agreement`, on packed blocks): one teacher forward per batch more.
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    n_blocks = len(val_blocks) if max_batches is None else min(len(val_blocks), max_batches * batch_size)
    share = eval_share(n_blocks, world, rank)
    n_forwards = math.ceil(math.ceil(n_blocks / world) / batch_size)  # the largest share's
    sums = torch.zeros(4, dtype=torch.float64, device=accelerator.device)  # [loss sum, tokens, KL sum, agreed]
    model.eval()
    for i in range(n_forwards):
        rows = share[i * batch_size:(i + 1) * batch_size]
        counted = len(rows) > 0
        first, last = (rows.start, rows.stop) if counted else (0, 1)
        ids = torch.tensor(val_blocks[first:last]["input_ids"], device=accelerator.device)
        logits = model(input_ids=ids).logits  # [batch, seq, vocab]
        loss_sum, n = lm_loss_sum(logits, ids)
        batch = [loss_sum.double(), torch.tensor(float(n), dtype=torch.float64, device=sums.device)]
        zero = torch.zeros((), dtype=torch.float64, device=sums.device)
        batch += _against(logits, teacher(input_ids=ids).logits) if teacher is not None else [zero, zero]
        if counted:
            sums += torch.stack([x.to(sums.device, torch.float64) for x in batch])
    model.train()
    total_loss, tokens, kl, agreed = accelerator.reduce(sums, reduction="sum").tolist()
    if tokens == 0:  # prevented by the plan (plan/checked.py, check_validation_size); never report a perfect score on nothing
        raise RuntimeError("validation scored no tokens")
    loss = total_loss / tokens
    record = {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)), "val_tokens": int(tokens)}
    if teacher is not None:
        record |= {"val_kl_to_teacher": kl / tokens, "val_top1_agreement": agreed / tokens}
    return record


def _against(logits: torch.Tensor, teacher_logits: torch.Tensor) -> list[torch.Tensor]:
    """[KL(teacher || model) summed over the target positions, how many argmaxes agree there]
    (logits [batch, seq, vocab]; the last position has no target, as in the loss)."""
    agreed = (logits[:, :-1].argmax(-1) == teacher_logits[:, :-1].argmax(-1)).sum()
    return [kd_loss_sum(logits, teacher_logits, 1.0), agreed]


def validation_line(step: int, record: dict) -> str:
    """The line every validation prints (the step-0 one, each `eval.every`, the final one):
    `step N: val loss L, ppl P`, with a teacher also its KL and top-1 agreement."""
    against = (f"; against the teacher: KL {record['val_kl_to_teacher']:.4f} nats/token, top-1 agreement "
               f"{record['val_top1_agreement']:.1%}" if "val_kl_to_teacher" in record else "")
    copied = (f"; copy probe: loss {record['val_copy_first_loss']:.3f} -> {record['val_copy_second_loss']:.3f} on "
              f"the second reading, top-1 {record['val_copy_top1']:.1%}" if "val_copy_top1" in record else "")
    return f"step {step}: val loss {record['val_loss']:.4f}, ppl {record['val_ppl']:.2f}{against}{copied}"


COPY_BLOCKS = 64  # validation blocks the copy probe draws its passages from (the first ones)


@torch.no_grad()
def validation_copy_probe(model, val_blocks, seq_len: int, passages: int, teacher=None) -> dict:
    """The copy probe (`uptrain.measure.copy_probe`) on the validation blocks' tokens in `seq_len`
    windows: val_copy_first_loss / val_copy_second_loss / val_copy_top1, with a teacher also
    val_copy_gain_kept (the model's gain over the teacher's). Every process runs the same passages
    (sharded models need every rank in each forward); {} when the blocks are too short for one."""
    from uptrain.measure.copy_probe import copy_against, probe_model

    blocks = [torch.tensor(row) for row in val_blocks.select(range(min(len(val_blocks), COPY_BLOCKS)))["input_ids"]]
    was_training = model.training
    model.eval()
    probe = probe_model(model, blocks, seq_len, passages)
    if was_training:
        model.train()
    if probe is None:
        return {}
    record = {"val_copy_first_loss": probe["copy_first_loss"], "val_copy_second_loss": probe["copy_second_loss"],
              "val_copy_top1": probe["copy_top1"]}
    if teacher is not None:
        kept = copy_against(probe, probe_model(teacher, blocks, seq_len, passages))["copy_gain_kept"]
        record |= {"val_copy_gain_kept": kept} if kept is not None else {}  # None: the teacher gains nothing
    return record
