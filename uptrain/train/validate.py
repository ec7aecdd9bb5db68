"""In-loop validation: the loss over packed validation blocks, split over the processes."""

from __future__ import annotations

import math

import torch
from accelerate import Accelerator

from uptrain.train.losses import lm_loss_sum


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
