"""The conversion's named choices, importable without torch.

`python -m uptrain.convert` parses its arguments and starts copying the tensors it keeps before
torch and transformers are imported (seconds of start-up), so its option lists live here.
"""

from __future__ import annotations

from typing import Literal

Method = Literal["mean", "first", "random", "fit"]
METHODS: tuple[Method, ...] = ("mean", "first", "random", "fit")  # fit: see convert/fit.py, layerwise.py
Grouping = Literal["contiguous", "similar"]
GROUPINGS: tuple[Grouping, ...] = ("contiguous", "similar")
RefineInputs = Literal["original", "converted"]
REFINE_INPUTS: tuple[RefineInputs, ...] = ("original", "converted")  # --refine-inputs: see convert/refine.py
QKVLayout = Literal["blocks", "grouped"]  # fused q/k/v rows: see heads.split_qkv
