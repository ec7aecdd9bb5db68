"""The source's log-probabilities of each training block, kept for the next reading of the block.

A run that reads its blocks more than once (data.repeat_data: the no-data path reads the source's
samples about three times) computes the same teacher forward on the same tokens at every reading.
On a CPU that forward is a fifth of a distillation step (measured on the bundled model, 128-token
blocks: 17.5 ms of the ~165 ms of a 2 x 8-block step). `TeacherCache` keeps each block's
log-probabilities (float16, [seq_len, vocab]) under the block's own token ids, exactly (the dict
compares the whole key), up to a byte budget; a later reading takes them from memory.

Log-probabilities rather than logits: the likely tokens, the ones that carry the KL, sit near 0,
where float16 is finest (an error under 0.002 nats for log p above -4). With a cache every teacher
output is rounded so, at its first reading too, so a run that resumes with an empty cache trains on
the same targets as one that did not stop. `kd_loss_sum` is unchanged by the shift: log_softmax of
log p / T is log_softmax of the logits / T.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

AUTO_MEMORY_SHARE = 0.25  # of the memory available at the start, shared by the machine's processes


def cache_budget(setting: float | None, on_cpu: bool, reads_again: bool, available_bytes: int | None,
                 processes: int = 1) -> int:
    """Bytes one process may keep (0: no cache) for distill.teacher_cache_gb = `setting`.

    None (auto): a teacher on the CPU (`on_cpu`, where its forward is a fifth of a step) in a run that
    reads blocks again (`reads_again`): AUTO_MEMORY_SHARE of `available_bytes` over the `processes` on
    this machine; otherwise 0. A number: that many GB per process, on any device; 0: off. Pure.
    """
    if setting is not None:
        return int(setting * 1e9)
    if not (on_cpu and reads_again) or not available_bytes:
        return 0
    return int(available_bytes * AUTO_MEMORY_SHARE / max(1, processes))


class TeacherCache:
    """The teacher's log-probabilities per block, up to `max_bytes` (then new blocks are not kept)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.bytes = max_bytes, 0
        self.blocks: dict[bytes, torch.Tensor] = {}  # token ids' bytes -> [seq_len, vocab] float16 log p
        self.hits = self.misses = 0

    def log_probs(self, ids: torch.Tensor, forward: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The teacher's log-probabilities for the micro batch `ids` ([batch, seq_len] token ids) as
        float32 [batch, seq_len, vocab] on ids' device: from memory when every row was seen before,
        else `forward()` (the teacher's logits, [batch, seq_len, vocab]) rounded to float16, its rows kept
        while the budget lasts."""
        keys = [row.tobytes() for row in ids.detach().cpu().numpy()]
        kept = [self.blocks.get(k) for k in keys]
        if all(k is not None for k in kept):
            self.hits += len(keys)
            out = torch.empty((len(kept), *kept[0].shape), dtype=torch.float32, device=ids.device)
            for row, block in zip(out, kept):  # one converting copy (stack, then convert: two passes)
                row.copy_(block)
            return out
        self.misses += len(keys)
        rounded = torch.log_softmax(forward().float(), dim=-1).to(torch.float16)
        for key, row in zip(keys, rounded.cpu()):
            if key not in self.blocks and self.bytes + row.nbytes <= self.max_bytes:  # (a block twice in a batch: once)
                self.blocks[key] = row.clone()  # its own storage: the batch's is freed
                self.bytes += row.nbytes
        return rounded.float()
