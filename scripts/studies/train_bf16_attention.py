"""`python -m uptrain.train` with the attention by hand in bfloat16 in both models (the lead of results/quality-curve.md,
round two, seventh part; not a setting yet): step_parts.py's `_in_model` registered as transformers' "sdpa".

    python scripts/studies/train_bf16_attention.py configs/demo-cpu.yaml key=value ...
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from transformers import AttentionInterface

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_parts import _in_model  # noqa: E402

from uptrain.train.__main__ import main  # noqa: E402

if __name__ == "__main__":
    AttentionInterface._global_mapping["sdpa"] = _in_model(torch.bfloat16)
    sys.exit(main(sys.argv[1:]))
