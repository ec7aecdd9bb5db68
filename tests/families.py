"""A scaled-down config of every registry family, each with its special features switched on.

Shared by the registry's tests (tests/convert/test_architectures.py) and `trainable`'s.
"""

from __future__ import annotations

from transformers import AutoConfig, PretrainedConfig

HEADS, KV, HD = 8, 2, 8
SMALL = dict(hidden_size=HEADS * HD, head_dim=HD, num_attention_heads=HEADS, num_key_value_heads=KV, num_hidden_layers=2,
             intermediate_size=32, vocab_size=128, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=16)

# model type -> extra config: each family's special features switched on
GQA_TYPES: dict[str, dict] = {
    "llama": dict(attention_bias=True, tie_word_embeddings=True),
    "mistral": dict(sliding_window=4), "mixtral": MOE, "qwen2": {}, "qwen2_moe": dict(MOE, qkv_bias=True),
    "qwen3": {}, "qwen3_moe": MOE, "gemma": dict(head_dim=16), "gemma2": dict(head_dim=16),
    "gemma3_text": dict(head_dim=16, sliding_window=4), "granite": {}, "granitemoe": MOE,
    "starcoder2": dict(use_bias=True), "olmo": dict(clip_qkv=8.0), "nemotron": dict(partial_rotary_factor=0.5),
    "helium": {}, "glm": {}, "glm4": {}, "smollm3": {}, "ernie4_5": dict(use_bias=True), "exaone4": {},
    "seed_oss": dict(attention_bias=True), "exaone": {}, "internlm3": dict(bias=True, qkv_bias=True), "ministral": {},
    "arcee": {}, "cohere2": {},
    "phi": dict(qk_layernorm=True, partial_rotary_factor=0.5), "phi3": {},
    "stablelm": dict(qk_layernorm=True, use_qkv_bias=True, partial_rotary_factor=0.25),
    "cohere": dict(use_qk_norm=True), "olmo2": {}, "olmo3": {},
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=KV, alibi=False, bias=True, head_dim=None),
}
MQA_TYPES: dict[str, dict] = {  # classes with only a multi_query switch: MHA -> MQA
    "falcon": dict(new_decoder_architecture=False, multi_query=True, alibi=False, bias=True, parallel_attn=True,
                   head_dim=None),
    "gpt_bigcode": dict(multi_query=True, n_positions=256, head_dim=None),
}


def tiny_config(model_type: str, extra: dict) -> PretrainedConfig:
    """SMALL with `extra` over it (a None value: the class derives it)."""
    return AutoConfig.for_model(model_type, **{k: v for k, v in {**SMALL, **extra}.items() if v is not None})
