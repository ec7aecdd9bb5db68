"""Layer-at-a-time conversions (`--method fit`, `--grouping similar`) read each source tensor once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from uptrain.convert import convert
from uptrain.convert.source import SourceCheckpoint


@pytest.fixture
def reads(monkeypatch) -> Counter:
    """How often each source tensor is read, counted in uptrain's own reader."""
    counts: Counter = Counter()
    real = SourceCheckpoint.read

    def counted(self, info):
        counts[info.name] += 1
        return real(self, info)
    monkeypatch.setattr(SourceCheckpoint, "read", counted)
    return counts


@pytest.mark.parametrize("method, grouping", [("fit", "contiguous"), ("mean", "similar"), ("fit", "similar")])
def test_every_source_tensor_is_read_once(method, grouping, mha8: Path, tmp_path, reads, one_torch_thread):
    """A layer's q/k/v/o are read for its first output only; the other outputs come from the cache
    (before: each of a layer's 4 outputs read all 4 tensors, 4 reads each)."""
    convert(str(mha8), tmp_path / "out", 2, method, grouping=grouping)
    attention = {n: c for n, c in reads.items() if ".self_attn." in n}
    assert len(attention) == 5 * 4  # q, k, v, o of stories260K's 5 layers
    assert attention == {n: 1 for n in attention}, attention
    # the others (embeddings, norms, MLP) are copied by the kernel: never read as tensors
    assert set(reads) == set(attention)
