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
CALIB_WINDOWS = ("repeats", "documents")  # --calib-windows, the default first: see calibrate.calibration_sequences
QKVLayout = Literal["blocks", "grouped"]  # fused q/k/v rows: see heads.split_qkv

SIMILAR_NOT_RANDOM = ("--grouping similar has no effect with --method random (K/V are re-initialised); "
                      "use --grouping contiguous")
REFINE_NOT_RANDOM = "--refine starts from a closed-form conversion; use --method fit or mean, not random"
CALIB_HAS_NO_EFFECT = ("--calib has no effect with --method mean/first/random and --grouping contiguous; "
                       "use it with --method fit or --grouping similar")


def calibration_applies(method: str, grouping: str, refine: bool) -> bool:
    """Whether a conversion reads calibration text: the fit weights its least squares by it, the
    similar grouping measures head likeness on it, refinement tunes each layer on it; mean / first
    / random pooling of contiguous groups reads none. The one rule: `layerwise_settings` and
    `options.ConversionOptions` (the convert and sweep commands) both ask it."""
    return method == "fit" or grouping != "contiguous" or refine
