"""Tiny real transformers checkpoints for tests: built from real configs, random weights, saved."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel


def scaled_config(raw: dict[str, Any], layers: int = 2, head_dim: int | None = None, vocab: int = 256,
                  **overrides: Any) -> PretrainedConfig:
    """A real config.json shrunk: same head counts, biases and rotary settings; small widths.

    hidden_size becomes heads x head_dim unless the config sets head_dim explicitly (Gemma), in
    which case hidden_size is chosen to differ from it, as in the real model.
    """
    raw = {k: v for k, v in raw.items() if k not in ("architectures", "auto_map", "quantization_config")}
    heads = raw.get("num_attention_heads") or raw.get("n_head")
    explicit_head_dim = raw.get("head_dim") not in (None, raw.get("hidden_size", 0) // heads)
    hd = head_dim or 8
    small = {"num_hidden_layers": layers, "vocab_size": vocab, "intermediate_size": 32,
             "hidden_size": heads * hd if not explicit_head_dim else max(16, heads * hd // 2),
             "max_position_embeddings": min(raw.get("max_position_embeddings", 2048), 2048),
             "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    if raw.get("head_dim") is not None:
        small["head_dim"] = hd
    for alias in ("n_layer", "n_head", "n_embd", "n_layers"):
        raw.pop(alias, None)
    raw.update(small)
    raw.update(overrides)
    model_type = raw.pop("model_type")
    return AutoConfig.for_model(model_type, **raw)


def random_model(cfg: PretrainedConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The model of `cfg` with every parameter perturbed, so biases and norms are not trivial."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def save(model: PreTrainedModel, folder: Path, max_shard_size: str = "1GB") -> Path:
    model.save_pretrained(folder, max_shard_size=max_shard_size)
    return folder


def load(folder: Path, **kwargs: Any) -> PreTrainedModel:
    """Load a checkpoint and fail on any missing, unexpected or mismatched weight."""
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"loading {folder} reported {problems}"
    return model.eval()


@torch.no_grad()
def logits(model: PreTrainedModel, ids: torch.Tensor) -> torch.Tensor:
    return model(ids).logits.float()


def read_config(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "config.json").read_text())


def weights(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint folder, from all its safetensors files (one or many shards)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):
        out.update(load_file(file))
    assert out, f"no safetensors weights in {folder}"
    return out
