"""Token blocks (step 3 of `uptrain.data`): documents tokenized and packed for causal-LM training.

Documents are tokenized in batches (`datasets.map`, cached on disk, optionally in parallel),
joined with the tokenizer's EOS token between them, and cut into blocks of `seq_len` token ids.
Every block is full, so a batch has no padding and every position after the first is a target.
A streaming source goes through the same packing lazily, block by block.

The on-disk cache is keyed by the documents' fingerprint, the tokenizer's content (its
serialized form and special tokens, not its folder name), `PACKING_VERSION` and the share of blocks
read again (`read_again`), so a different tokenizer saved in the same folder, a change to the
packing code or another share never reuses old blocks.
"""

from __future__ import annotations

import array
import hashlib
import itertools
import json
import random
import zlib

import datasets
from transformers import PreTrainedTokenizerBase

from uptrain.errors import UsageError

# Bump when the blocks made from the same text and tokenizer change (the packing code's version).
PACKING_VERSION = 2

# Documents per `map` batch: the tail of each batch that does not fill a block is dropped, so
# large batches waste little text (at most seq_len - 1 tokens per batch).
_MAP_BATCH = 1000


def read_again(block: list[int], share: float) -> list[int]:
    """`block`, or for a `share` of blocks the same text with a passage read again (copy-aware
    training: the model sees a repeat as far back as the block reaches, which plain text of short
    stories never shows it; results/copy-conversions.md): P = len // 8 tokens from the block's start,
    the next g tokens (g uniform in 0..len - 2P), the passage again, then the text that followed,
    cut to the block's length. Whether and where are drawn from the block's own tokens (crc32), so
    every process, every resume and a streamed source draw the same."""
    if share <= 0 or len(block) < 2:
        return block
    rng = random.Random(zlib.crc32(array.array("q", block).tobytes()))
    if rng.random() >= share:
        return block
    n = len(block)
    p = max(1, n // 8)
    g = rng.randint(0, n - 2 * p)
    return block[:p + g] + block[:p] + block[p + g:n - p]


def _packer(tokenizer: PreTrainedTokenizerBase, seq_len: int, repeats: float = 0.0):
    """The batched map function: documents' tokens, each followed by EOS, cut into full blocks (a
    `repeats` share of them with a passage read again: `read_again`)."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise UsageError("the tokenizer has no EOS token; packing needs one to separate documents")

    def tokenize_and_pack(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        stream: list[int] = []
        for ids in tokenizer(batch["text"], add_special_tokens=True)["input_ids"]:
            stream.extend(ids)
            stream.append(eos)
        n_blocks = len(stream) // seq_len
        return {"input_ids": [read_again(stream[i * seq_len:(i + 1) * seq_len], repeats) for i in range(n_blocks)]}

    return tokenize_and_pack


def token_blocks(
    texts: datasets.Dataset | datasets.IterableDataset,
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    num_proc: int | None = None,
    repeats: float = 0.0,
) -> datasets.Dataset | datasets.IterableDataset:
    """Tokenize the "text" column and pack it into a dataset with one column "input_ids".

    Each row is a list of `seq_len` ints: documents' tokens, each followed by EOS, concatenated
    (`repeats`: the share of blocks with a passage read again, `read_again`; training only).
    A streaming (iterable) dataset is packed lazily, in the same map batches, so it gives the
    same blocks in the same order as the same text loaded whole.
    """
    tokenize_and_pack = _packer(tokenizer, seq_len, repeats)
    if isinstance(texts, datasets.IterableDataset):
        return texts.map(tokenize_and_pack, batched=True, batch_size=_MAP_BATCH, remove_columns=["text"])
    # An explicit fingerprint keeps the cache hit stable: hashing a tokenizer object is not
    # always deterministic across processes, which would re-tokenize on every run.
    key = hashlib.sha256((
        f"{texts._fingerprint}|{tokenizer_fingerprint(tokenizer)}|{seq_len}|{_MAP_BATCH}|{PACKING_VERSION}"
        + (f"|repeats {repeats!r}" if repeats else "")).encode()
    ).hexdigest()[:32]
    return texts.map(
        tokenize_and_pack,
        batched=True,
        batch_size=_MAP_BATCH,
        remove_columns=texts.column_names,
        num_proc=num_proc,
        new_fingerprint=key,
        desc="tokenize + pack",
    )


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """sha256 of what decides a text's token ids: the tokenizer's serialized content and special tokens.

    A fast tokenizer serializes whole (`backend_tokenizer.to_str()`: vocabulary, merges,
    normalizer, pre-tokenizer, post-processor with its BOS/EOS); another is hashed from its
    vocabulary and, for sentencepiece, the model proto. Deterministic across processes.
    """
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
        sp_model = getattr(tokenizer, "sp_model", None)
        if sp_model is not None:
            h.update(sp_model.serialized_model_proto())
    specials = [tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.special_tokens_map,
                getattr(tokenizer, "add_bos_token", None), getattr(tokenizer, "add_eos_token", None)]
    h.update(json.dumps(specials, sort_keys=True, default=str).encode())
    return h.hexdigest()


def first_blocks(blocks: datasets.IterableDataset, n: int) -> datasets.Dataset:
    """The first `n` blocks of a stream as a fixed, indexable dataset (e.g. a validation set)."""
    return datasets.Dataset.from_list(list(itertools.islice(blocks, n)))


def require_blocks(blocks: datasets.Dataset, seq_len: int, what: str, hint: str = "") -> datasets.Dataset:
    """`blocks`, or UsageError when `what` (a source's name) gave no full block of `seq_len` tokens."""
    if len(blocks) == 0:
        raise UsageError(f"{what} gives no full block of {seq_len} tokens" + (f"; {hint}" if hint else
                         "; give more text or a shorter data.seq_len"))
    return blocks

