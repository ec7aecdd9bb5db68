"""The one FLOPs formula (6N + attention) and the GPU peak table used by every MFU figure."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from uptrain.train.report.mfu import bf16_peak_tflops, flops_per_token, mfu, model_flops_per_token


@pytest.mark.parametrize("tied", [True, False])
def test_model_flops_count_matmul_parameters_and_attention(tied):
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=16, vocab_size=1000, tie_word_embeddings=tied)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    per_layer = 64 * 8 * 16 * 2 + 64 * 2 * 16 * 2 + 3 * 64 * 160 + 2 * 64  # q,o + k,v + MLP + 2 norms
    matmul = 3 * per_layer + 64 + 1000 * 64  # + final norm + the output head (the input table is a lookup)
    # attention width is heads x head_dim (128 here), not the hidden size (64)
    assert model_flops_per_token(model, 256) == 6 * matmul + 12 * 3 * 128 * 256
    assert flops_per_token(matmul, 3, 128, 256) == model_flops_per_token(model, 256)


def test_the_bench_figure_is_reproduced():
    # results/trainer-bench.md: 41,585 tokens/s on the H200 was 26.8% MFU (1,015,441,408 params,
    # tied embeddings, so all of them count; 22 layers x 2048, seq 512).
    per_token = flops_per_token(1_015_441_408, 22, 2048, 512)
    assert mfu(41_585, per_token, bf16_peak_tflops("NVIDIA H200")) == pytest.approx(0.268, abs=1e-3)


def test_peaks_of_known_gpus():
    assert bf16_peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert bf16_peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert bf16_peak_tflops("NVIDIA H200") == 989.0
    assert bf16_peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert bf16_peak_tflops("NVIDIA L4") == 121.0
    assert bf16_peak_tflops("Some Future GPU") is None
