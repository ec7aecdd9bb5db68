"""Model FLOPs utilisation: training FLOPs per token and the bf16 dense peak of known GPUs.

One formula for every throughput report (scripts/bench/bench_trainer.py, scripts/tools/gpu_check.py):
FLOPs per token = 6 x N + 12 x layers x (heads x head_dim) x seq_len, where N counts the
parameters that take part in matrix multiplies (all but the input embedding table, which is a
lookup; a tied table is the output head's matrix and counts once) and the second term is the
attention scores and weighted sum, forward and backward, counted over the full (not causal)
square as PaLM and torchtitan count it. MFU = tokens/s x FLOPs per token / peak FLOP/s.
"""

from __future__ import annotations

# bf16 dense tensor-core peaks (TFLOP/s, no sparsity) from the vendors' data sheets, by a
# substring of torch.cuda.get_device_name(). Order matters: the first match wins.
BF16_PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("H200", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
)


def flops_per_token(matmul_params: int, layers: int, attention_width: int, seq_len: int) -> int:
    """Training FLOPs per token: 6 x matmul_params + 12 x layers x attention_width x seq_len.

    attention_width: query heads x head_dim (the hidden size for most models).
    """
    return 6 * matmul_params + 12 * layers * attention_width * seq_len


def model_flops_per_token(model, seq_len: int) -> int:
    """`flops_per_token` of a Hugging Face causal LM (the parameters counted as the module doc says)."""
    config = model.config.get_text_config()
    total = sum(p.numel() for p in model.parameters())  # a tied weight is one parameter, counted once
    embedding = model.get_input_embeddings().weight
    tied = any(p is embedding for p in model.get_output_embeddings().parameters())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return flops_per_token(total if tied else total - embedding.numel(), config.num_hidden_layers,
                           heads * head_dim, seq_len)


def bf16_peak_tflops(device_name: str) -> float | None:
    """The bf16 dense peak of the GPU called `device_name`, None when it is not in the table."""
    for key, tflops in BF16_PEAK_TFLOPS:
        if key in device_name:
            return tflops
    return None


def mfu(tokens_per_s: float, per_token: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation in [0, 1] (above 1 means the FLOP count or the peak is wrong)."""
    return tokens_per_s * per_token / (peak_tflops * 1e12)
