"""The demo's training blocks: as long as the distances its source copies over, with passages read again.

The demo's config trains in 128-token blocks (configs/demo-cpu.yaml). A block never shows the model
a repeat further back than its own length, so a source that retrieves from across its context loses
that skill in short blocks: examples/copy-mha8, converted to 2 K/V heads, kept 91% of its copy gain
before the demo's uptraining and 87% after it in 128-token blocks; 94% in blocks of its 512-token
context; 96% in those with half of them reading a passage again (`data.copy_repeats`,
uptrain.data.blocks.read_again), at the same KL (results/copy-conversions.md). So the demo first
reads the source's copy probe on the training text: where the second reading of a passage half a
window later removes at least COPIES of the first reading's loss, the uptraining trains in blocks of
that window (the scoring window: the model's context, at most 2,048 tokens), the same tokens per
step where it divides, REPEATS of them with a passage read again. stories260K-mha8 (9% at half its
window) keeps 128-token blocks, in which it ends better than in 512-token ones (1.827 against
1.837). Set data.seq_len yourself to choose.
"""

from __future__ import annotations

from pathlib import Path

import torch

from uptrain.data import DataSource, read_documents

COPIES = 0.25  # the share of a passage's loss its half-window repeat must remove for long blocks
REPEATS = 0.5  # data.copy_repeats of those long blocks (1.0: 97% of the copy gain kept, +0.003 nats more loss)
PROBE_TOKENS = 65_536  # training text tokenized for the probe (its passages are spread over it)


def half_window_copy(source: Path, text: Path, window: int) -> tuple[float, int] | None:
    """(the share of a passage's first-reading loss that the source removes when it reads the passage
    again half a `window` later, that distance in tokens: the copy probe's middle one) on `text`; None
    where the text is too short for the probe."""
    from uptrain.measure.copy_probe import probe_model
    from uptrain.measure.eval import tokenize_texts
    from uptrain.measure.models import load_model

    model, tokenizer = load_model(str(source))  # as uptrain.eval loads it: the checkpoint's own dtype
    sequences, used = [], 0
    for ids in tokenize_texts(tokenizer, read_documents(DataSource(files=[str(text)]), field_option=None)):
        sequences.append(ids)
        used += len(ids)
        if used >= PROBE_TOKENS:
            break
    with torch.no_grad():
        probe = probe_model(model, sequences, window)
    del model
    if probe is None or len(probe["copy_distances"]) < 2:
        return None
    distance = probe["copy_distances"][len(probe["copy_distances"]) // 2]
    middle = probe["copy_by_distance"][str(distance)]
    return (1 - middle["second_loss"] / middle["first_loss"], distance) if middle["first_loss"] > 0 else None


def block_frame(source: Path, text: Path, window: int, seq_len: int, micro_batch: int
                ) -> tuple[list[str], str]:
    """(the trainer's overrides, the line the demo prints) for blocks of `window` tokens where the source
    copies across half of it (module doc), else none: the config's `seq_len` x `micro_batch` kept."""
    if window <= seq_len:
        return [], f"training blocks: {seq_len} tokens (the config's; the model's window is {window})"
    found = half_window_copy(source, text, window)
    if found is None:
        return [], f"training blocks: {seq_len} tokens (the config's; too little training text for the copy probe)"
    share, distance = found
    if share < COPIES:
        return [], (f"training blocks: {seq_len} tokens (the config's): the source's second reading of a passage "
                    f"{distance} tokens later removes {share:.0%} of its loss (longer blocks from {COPIES:.0%})")
    micro = max(1, seq_len * micro_batch // window)
    return [f"data.seq_len={window}", f"batch.micro_batch={micro}", f"data.copy_repeats={REPEATS}"], (
        f"training blocks: {window} tokens, {micro} per micro-batch, {REPEATS:.0%} of them with a passage read again "
        f"(data.copy_repeats): the source copies across its window (its "
        f"second reading of a passage {distance} tokens later removes {share:.0%} of its loss; longer blocks from "
        f"{COPIES:.0%}), which {seq_len}-token blocks never show (results/copy-conversions.md)")
