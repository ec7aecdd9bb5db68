"""In-loop validation: the loss over packed validation blocks, split over the processes."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from uptrain.train.losses import lm_loss_sum


def eval_share(n_blocks: int, world: int, rank: int) -> range:
    """Process `rank`'s contiguous share of `n_blocks`: the first n_blocks % world ranks get one more."""
    base, extra = divmod(n_blocks, world)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@torch.no_grad()
def validate_blocks(model, val_blocks, accelerator: Accelerator, batch_size: int, max_batches: int | None) -> dict:
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
    """
    world, rank = accelerator.num_processes, accelerator.process_index
    n_blocks = len(val_blocks) if max_batches is None else min(len(val_blocks), max_batches * batch_size)
    share = eval_share(n_blocks, world, rank)
    n_forwards = math.ceil(math.ceil(n_blocks / world) / batch_size)  # the largest share's
    sums = torch.zeros(2, dtype=torch.float64, device=accelerator.device)  # [loss sum, tokens]
    model.eval()
    for i in range(n_forwards):
        rows = share[i * batch_size:(i + 1) * batch_size]
        counted = len(rows) > 0
        first, last = (rows.start, rows.stop) if counted else (0, 1)
        ids = torch.tensor(val_blocks[first:last]["input_ids"], device=accelerator.device)
        loss_sum, n = lm_loss_sum(model(input_ids=ids).logits, ids)
        if counted:
            sums += torch.stack([loss_sum.double(), torch.tensor(float(n), dtype=torch.float64, device=sums.device)])
    model.train()
    total_loss, tokens = accelerator.reduce(sums, reduction="sum").tolist()
    if tokens == 0:  # prevented by setup.check_validation_size; never report a perfect score on nothing
        raise RuntimeError("validation scored no tokens")
    loss = total_loss / tokens
    return {"val_loss": loss, "val_ppl": math.exp(min(loss, 80.0)), "val_tokens": int(tokens)}
