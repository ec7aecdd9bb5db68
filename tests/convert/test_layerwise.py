"""Layer-at-a-time conversions (`--method fit`, `--grouping similar`) read each source tensor once."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from uptrain.convert import convert
from uptrain.convert.io.source import SourceCheckpoint


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


@pytest.mark.parametrize("method", ["fit", "mean"])
def test_refine_reads_every_source_tensor_once(method, mha8: Path, tmp_path, reads, one_torch_thread):
    """--refine too: the calibration stream reads each layer's tensors once (as float32 modules), the
    conversion once more for the layer's first output; nothing is read a third time."""
    from conftest import TRAIN_TXT
    from uptrain.convert.layers.calibrate import Calibration
    from uptrain.convert.layers.refine_layer import RefineSettings

    convert(str(mha8), tmp_path / "out", 2, method, calibration=Calibration(TRAIN_TXT, 600),
            refine=RefineSettings(steps=2))
    attention = {n: c for n, c in reads.items() if ".self_attn." in n}
    assert len(attention) == 5 * 4
    assert attention == {n: 2 for n in attention}, attention  # the stream's read + the conversion's
    layers = {n: c for n, c in reads.items() if n not in attention and ".layers." in n}
    assert layers and set(layers.values()) == {1}, layers  # norms and MLP: the stream's read only


def test_checkpoint_names_that_transformers_renames_on_load(tmp_path, one_torch_thread):
    """EXAONE checkpoints store attention as `attn.attention.{q,k,v,out}_proj` (transformers loads them
    as `self_attn.*_proj`): fit and similar grouping find all four projections by the registry's
    checkpoint names and merge duplicated heads back exactly. (Before: "layer … lacks some of its
    q/k/v/o projections".)"""
    import torch

    from families import tiny_config
    from tiny import load, logits, random_model, save

    ids = torch.tensor([[3, 17, 42, 5, 99, 23, 64, 7, 11]])
    gqa = save(random_model(tiny_config("exaone", {})), tmp_path / "gqa")
    reference = logits(load(gqa), ids)
    convert(str(gqa), tmp_path / "mha", 8, allow_expand=True)
    for grouping in ("contiguous", "similar"):
        convert(str(tmp_path / "mha"), tmp_path / grouping, 2, "fit", grouping=grouping)
        torch.testing.assert_close(logits(load(tmp_path / grouping), ids), reference, rtol=0, atol=1e-4)
