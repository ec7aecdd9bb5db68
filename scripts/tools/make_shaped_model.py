"""Save a randomly initialised causal LM with the shapes of a real config, for size/speed benchmarks.

    python scripts/tools/make_shaped_model.py ../shared/data/configs/llama-2-7b-hf.json OUT_DIR \
        [--layers 8] [--kv-heads 8] [--dtype bfloat16] [--device cuda]

Weights are random (the numbers it gives are about memory and speed, never quality); only
`num_hidden_layers` and `num_key_value_heads` are overridden, so per-layer shapes, head_dim
and the KV-cache bytes per layer are those of the real model. No tokenizer is written
(`uptrain.bench` does not need one).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a config.json of a real checkpoint")
    parser.add_argument("out", help="folder to write the model to")
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--kv-heads", type=int, default=None, help="override num_key_value_heads")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default="cpu", help="where to initialise (cuda is much faster for big shapes)")
    args = parser.parse_args(argv)
    raw = json.loads(Path(args.config).read_text())
    raw.pop("torch_dtype", None)
    if args.layers:
        raw["num_hidden_layers"] = args.layers
    if args.kv_heads:
        if raw["num_attention_heads"] % args.kv_heads:
            parser.error(f"--kv-heads {args.kv_heads} does not divide {raw['num_attention_heads']} query heads")
        raw["num_key_value_heads"] = args.kv_heads
    config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    torch.manual_seed(0)
    with torch.device(args.device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype))
    model.save_pretrained(args.out)
    print(f"wrote {args.out}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
