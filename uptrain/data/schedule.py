"""The run's order of blocks (step 4 of `uptrain.data`): a seeded schedule over the token budget.

A whole dataset's blocks are drawn by a seeded shuffle per epoch (`schedule_blocks`); a stream's
are read in order or through a seeded shuffle buffer (`StreamSchedule`). Both depend only on the
seed, so a resumed run, or one on another number of processes, sees the same blocks.
"""

from __future__ import annotations

import datasets
import numpy as np
import torch

from uptrain.errors import UsageError


def schedule_blocks(
    blocks: datasets.Dataset, n_sequences: int, seed: int, repeat_data: bool
) -> datasets.Dataset:
    """The first `n_sequences` blocks of a seeded shuffle, reshuffled per epoch when repeating.

    The order depends only on `seed`, so a resumed run (or a run on another number of
    processes) sees the same sequence of blocks.
    """
    if n_sequences > len(blocks) and not repeat_data:
        raise UsageError(
            f"the budget needs {n_sequences} blocks but the training data has {len(blocks)}; "
            "lower the budget, add data, or set data.repeat_data=true to loop over it"
        )
    epochs = -(-n_sequences // len(blocks))
    order = np.concatenate([np.random.default_rng(seed + e).permutation(len(blocks)) for e in range(epochs)])
    return blocks.select(order[:n_sequences])


class StreamSchedule(torch.utils.data.IterableDataset):
    """The run's training blocks from a stream of packed blocks (`token_blocks` of a streaming source).

    Yields {"input_ids": LongTensor[seq_len]}: the first `n_blocks` blocks of the stream, in
    stream order (or through a seeded buffer shuffle, `shuffle_buffer` > 0, seed + epoch), from
    block `skip` on (what a resumed run already consumed: the order is deterministic, so
    skipping re-reads and re-tokenizes that text but yields exactly the blocks not yet seen).
    Each epoch reads the stream again from its start. When the stream ends before `n_blocks`, it
    restarts (next epoch) if `repeat_data`, else raises UsageError; `name` says which source.
    """

    def __init__(
        self,
        blocks: datasets.IterableDataset,
        n_blocks: int,
        seed: int,
        repeat_data: bool,
        shuffle_buffer: int = 0,
        skip: int = 0,
        name: str = "the training stream",
    ):
        self.blocks, self.n_blocks, self.seed, self.repeat_data = blocks, n_blocks, seed, repeat_data
        self.shuffle_buffer, self.skip, self.name = shuffle_buffer, skip, name

    def epoch_blocks(self, epoch: int) -> datasets.IterableDataset:
        """Epoch `epoch` of the stream as packed blocks (column "input_ids")."""
        if self.shuffle_buffer:
            return self.blocks.shuffle(seed=self.seed + epoch, buffer_size=self.shuffle_buffer)
        return self.blocks

    def __iter__(self):
        position, epoch = 0, 0  # blocks of the run produced so far (skipped ones included)
        while True:
            in_epoch = 0
            for row in self.epoch_blocks(epoch):
                in_epoch += 1
                if position >= self.skip:
                    yield {"input_ids": torch.tensor(row["input_ids"], dtype=torch.long)}
                position += 1
                if position == self.n_blocks:
                    return
            if in_epoch == 0:
                raise UsageError(f"{self.name} gives no full block; give more text or a shorter data.seq_len")
            if not self.repeat_data:
                raise UsageError(
                    f"{self.name} ended after {position} blocks but the budget needs "
                    f"{self.n_blocks}; lower the budget, add data, or set data.repeat_data=true to loop over it"
                )
            epoch += 1
