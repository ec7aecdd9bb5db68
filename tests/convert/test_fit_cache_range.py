"""`--method fit` keeps the source's key and value sizes (the `keep_scale` gauge on every layer), so a
quantized cache stores a converted model as well as its source: vLLM's fp8 cache saturates at 448 at
its default scale 1.0, which the other gauge's keys passed (716 on stories260K at 2 K/V heads)."""

from __future__ import annotations

import pytest
import torch

from conftest import EXAMPLE_MHA8, VALID_TXT
from uptrain.convert import convert
from uptrain.measure.eval import evaluate_paths

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _cache_amax(path) -> list[tuple[float, float]]:
    """(max |K|, max |V|) per layer, after RoPE, over the first held-out story."""
    from transformers import DynamicCache

    from uptrain.measure.models import load_model

    model, tokenizer = load_model(str(path))
    ids = torch.tensor(tokenizer(VALID_TXT.read_text().split("\n\n")[0])["input_ids"])[None]
    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=ids, cache=cache, use_cache=True)
    return [(float(layer.keys.abs().max()), float(layer.values.abs().max())) for layer in cache.layers]


def test_a_fit_conversion_keeps_the_cache_in_the_source_range_and_an_fp8_cache_costs_what_it_costs_the_source(
        tmp_path):
    texts = VALID_TXT.read_text().split("\n\n")[:6]
    kv4, kv2 = tmp_path / "kv4", tmp_path / "kv2"
    convert(str(EXAMPLE_MHA8), kv4, 4, "fit")  # the bundled model's heads are pairwise identical: lossless
    convert(str(EXAMPLE_MHA8), kv2, 2, "fit")
    source, four = evaluate_paths([str(EXAMPLE_MHA8), str(kv4)], texts, 512, 256, kv_cache="fp8")
    # identical heads come back as they were, sizes included: the fp8 cache stores the same values
    assert four.loss == pytest.approx(source.loss, abs=1e-6)
    for (k_src, v_src), (k2, v2) in zip(_cache_amax(EXAMPLE_MHA8), _cache_amax(kv2)):
        assert k2 < 2 * k_src and v2 < 3 * v_src, (k_src, k2, v_src, v2)  # the source's range, not the queries'
