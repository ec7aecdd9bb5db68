"""Tokenize text and pack it into fixed-length blocks for causal-LM training.

Documents are tokenized in batches (`datasets.map`, cached on disk, optionally in parallel),
joined with the tokenizer's EOS token between them, and cut into blocks of `seq_len` token ids.
Every block is full, so a batch has no padding and every position after the first is a target.
A streaming source goes through the same packing lazily (`StreamSchedule`), block by block.
"""

from __future__ import annotations

import dataclasses
import hashlib

import datasets
import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from uptrain.train.sources import DataSource, load_texts
from uptrain.errors import UsageError

# Documents per `map` batch: the tail of each batch that does not fill a block is dropped, so
# large batches waste little text (at most seq_len - 1 tokens per batch).
_MAP_BATCH = 1000


def _packer(tokenizer: PreTrainedTokenizerBase, seq_len: int):
    """The batched map function: documents' tokens, each followed by EOS, cut into full blocks."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UsageError("the tokenizer has no EOS token; packing needs one to separate documents")

    def tokenize_and_pack(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        stream: list[int] = []
        for ids in tokenizer(batch["text"], add_special_tokens=True)["input_ids"]:
            stream.extend(ids)
            stream.append(eos)
        n_blocks = len(stream) // seq_len
        return {"input_ids": [stream[i * seq_len:(i + 1) * seq_len] for i in range(n_blocks)]}

    return tokenize_and_pack


def pack_texts(
    texts: datasets.Dataset | datasets.IterableDataset,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    num_proc: int | None = None,
) -> datasets.Dataset | datasets.IterableDataset:
    """Tokenize the "text" column and pack it into a dataset with one column "input_ids".

    Each row is a list of `seq_len` ints: documents' tokens, each followed by EOS, concatenated.
    A streaming (iterable) dataset is packed lazily, in the same map batches, so it gives the
    same blocks in the same order as the same text loaded whole.
    """
    tokenize_and_pack = _packer(tokenizer, seq_len)
    if isinstance(texts, datasets.IterableDataset):
        return texts.map(tokenize_and_pack, batched=True, batch_size=_MAP_BATCH, remove_columns=["text"])
    # An explicit fingerprint keeps the cache hit stable: hashing a tokenizer object is not
    # always deterministic across processes, which would re-tokenize on every run.
    tok_id = getattr(tokenizer, "name_or_path", "") + str(len(tokenizer)) + str(tokenizer.eos_token_id)
    key = hashlib.sha256(f"{texts._fingerprint}|{tok_id}|{seq_len}|{_MAP_BATCH}".encode()).hexdigest()[:32]
    return texts.map(
        tokenize_and_pack,
        batched=True,
        batch_size=_MAP_BATCH,
        remove_columns=texts.column_names,
        num_proc=num_proc,
        new_fingerprint=key,
        desc="tokenize + pack",
    )


def load_blocks(
    source: DataSource, tokenizer: PreTrainedTokenizerBase, seq_len: int, num_proc: int | None = None
) -> datasets.Dataset:
    """`load_texts(source)` packed into blocks of `seq_len` tokens (column "input_ids")."""
    blocks = pack_texts(load_texts(source), tokenizer, seq_len, num_proc)
    if len(blocks) == 0:
        raise UsageError(f"data source {source.files or source.dataset} gives no full block of {seq_len} tokens")
    return blocks


def load_stream_blocks(source: DataSource, tokenizer: PreTrainedTokenizerBase, seq_len: int) -> datasets.IterableDataset:
    """`source` read as a stream and packed lazily into blocks of `seq_len` tokens ("input_ids")."""
    return pack_texts(load_texts(dataclasses.replace(source, streaming=True)), tokenizer, seq_len)


def split_documents(
    texts: datasets.Dataset, val_fraction: float, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, val) texts: a seeded `val_fraction` of the documents held out, each one whole.

    Splitting documents, not packed blocks, keeps every document on one side: a block split
    would put the two halves of a document that straddles a block edge into train and validation.
    """
    if len(texts) < 2:
        raise UsageError("too little data to hold out a validation set: fewer than 2 documents; give data.val")
    parts = texts.train_test_split(test_size=max(1, round(val_fraction * len(texts))), seed=seed)
    return parts["train"], parts["test"]


def load_split_blocks(
    source: DataSource, val_fraction: float, seed: int, tokenizer: PreTrainedTokenizerBase, seq_len: int,
    num_proc: int | None = None,
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, val) blocks of `source` with a `val_fraction` of its documents held out (`split_documents`)."""
    train, val = split_documents(load_texts(source), val_fraction, seed)
    train_blocks = pack_texts(train, tokenizer, seq_len, num_proc)
    val_blocks = pack_texts(val, tokenizer, seq_len, num_proc)
    name = source.files or source.dataset
    if len(train_blocks) == 0:
        raise UsageError(f"data source {name} gives no full block of {seq_len} tokens")
    if len(val_blocks) == 0:
        raise UsageError(
            f"the held-out {val_fraction:g} of {name} ({len(val)} documents) gives no full block of {seq_len} "
            "tokens; raise data.val_fraction or give data.val"
        )
    return train_blocks, val_blocks


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
    """The run's training blocks from a streaming source, tokenized and packed on the fly.

    Yields {"input_ids": LongTensor[seq_len]}: the first `n_blocks` blocks of the stream, in
    stream order (or through a seeded buffer shuffle, `shuffle_buffer` > 0, seed + epoch), from
    block `skip` on (what a resumed run already consumed: the order is deterministic, so
    skipping re-reads and re-tokenizes that text but yields exactly the blocks not yet seen).
    When the stream ends before `n_blocks`, it restarts (next epoch) if `repeat_data`, else
    raises UsageError.
    """

    def __init__(
        self,
        source: DataSource,
        tokenizer: PreTrainedTokenizerBase,
        seq_len: int,
        n_blocks: int,
        seed: int,
        repeat_data: bool,
        shuffle_buffer: int = 0,
        skip: int = 0,
    ):
        self.source, self.tokenizer, self.seq_len = source, tokenizer, seq_len
        self.n_blocks, self.seed, self.repeat_data = n_blocks, seed, repeat_data
        self.shuffle_buffer, self.skip = shuffle_buffer, skip
        load_texts(source)  # checks the source (files, text column) now, before any heavy work
        _packer(tokenizer, seq_len)  # checks the EOS token

    def epoch_blocks(self, epoch: int) -> datasets.IterableDataset:
        """Epoch `epoch` of the stream as packed blocks (column "input_ids")."""
        blocks = load_stream_blocks(self.source, self.tokenizer, self.seq_len)
        if self.shuffle_buffer:
            blocks = blocks.shuffle(seed=self.seed + epoch, buffer_size=self.shuffle_buffer)
        return blocks

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
            name = self.source.files or self.source.dataset
            if in_epoch == 0:
                raise UsageError(f"data source {name} gives no full block of {self.seq_len} tokens")
            if not self.repeat_data:
                raise UsageError(
                    f"the training stream {name} ended after {position} blocks but the budget needs "
                    f"{self.n_blocks}; lower the budget, add data, or set data.repeat_data=true to loop over it"
                )
            epoch += 1
