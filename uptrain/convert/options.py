"""What one conversion is made with, decided in one place for `uptrain.convert` and `uptrain.sweep`.

Both commands take the same options (`add_conversion_args`), turn them into the same
`ConversionOptions` (`conversion_options`) and ask it the same questions: is the calibration text
used (`calibrated`), is the combination refused (`check`, one line each), what does the conversion
record say (`record`). So a sweep's K/V-count folder is what `uptrain.convert` writes with the
same options, and a sweep refuses what convert refuses, with the same line.

Standard library only at import: the commands check their arguments before torch is imported.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from uptrain.convert.registry.choices import (CALIB_HAS_NO_EFFECT, CALIB_WINDOWS, GROUPINGS, METHODS, REFINE_INPUTS,
                                             REFINE_NOT_RANDOM, SIMILAR_NOT_RANDOM, calibration_applies)
from uptrain.data.source import TEXT_UNITS, DataSource
from uptrain.errors import UsageError

REFINE_NEEDS_CALIB = ("--refine needs --calib FILE (the text whose attention outputs the converted layers "
                      "are tuned to match)")
DEFAULT_CALIB_TOKENS = 32768
DEFAULT_REFINE_STEPS = 400  # refine.STEPS (kept equal by tests/convert/test_refine.py)
DEFAULT_REFINE_LR = 6e-2  # refine.LR (idem)
DEFAULT_GROUP_CANDIDATES = 3  # layerwise.GROUP_CANDIDATES (idem: tests/convert/test_grouping.py)
GROUP_CANDIDATES_UNUSED = ("--group-candidates applies only with --grouping similar and --calib (each layer's "
                           "candidate head groupings are measured on the calibration text): drop it, or add them")
QUALITY_PATH = "--method fit --grouping similar --calib TRAIN.txt --refine"  # the best start measured


@dataclass(frozen=True)
class ConversionOptions:
    """The options a conversion is made with, besides the source and the K/V count.

    method / grouping: `--method`, `--grouping`; calib: `--calib` text (None: none given);
    calib_tokens / calib_text_unit: how much of it and how a .txt file is cut into documents;
    calib_windows: how it is cut into forward passes (`calibrate.calibration_sequences`);
    refine, refine_steps, refine_lr, refine_inputs: `--refine` and its settings; seed: `--method
    random`'s; device: the calibration pass's torch device; group_candidates: `--group-candidates`
    (--grouping similar with --calib: the head groupings measured per layer, 1: the similarity's best).
    """

    method: str = "mean"
    grouping: str = "contiguous"
    calib: Path | None = None
    calib_tokens: int = DEFAULT_CALIB_TOKENS
    calib_text_unit: str = DataSource.text_unit
    calib_windows: str = CALIB_WINDOWS[0]
    refine: bool = False
    refine_steps: int = DEFAULT_REFINE_STEPS
    refine_lr: float = DEFAULT_REFINE_LR
    refine_inputs: str = "original"
    seed: int = 0
    device: str = "cpu"
    group_candidates: int | None = None  # None: not given (DEFAULT_GROUP_CANDIDATES where it applies)

    @property
    def candidates(self) -> int:
        """The head groupings measured per layer: `--group-candidates`, or its default where not given."""
        return DEFAULT_GROUP_CANDIDATES if self.group_candidates is None else self.group_candidates

    @property
    def calibrated(self) -> bool:
        """The calibration text is given and this conversion uses it."""
        return self.calib is not None and calibration_applies(self.method, self.grouping, self.refine)

    def check(self, calib_used_elsewhere: bool = False) -> None:
        """UsageError (one line) for a combination no conversion can run; reads no model.

        calib_used_elsewhere: the command has another use for --calib (the sweep's uptraining text),
        so calibration text the conversion does not read is not refused."""
        if self.calib_tokens <= 0:
            raise UsageError(f"--calib-tokens must be positive, got {self.calib_tokens}")
        if self.group_candidates is not None and self.group_candidates < 1:
            raise UsageError(f"--group-candidates must be at least 1 (1: the similarity's best alone), got "
                             f"{self.group_candidates}")
        if self.group_candidates is not None and not (self.grouping == "similar" and self.calibrated):
            raise UsageError(GROUP_CANDIDATES_UNUSED)
        if self.refine and self.calib is None:
            raise UsageError(REFINE_NEEDS_CALIB)
        if self.refine and self.method == "random":
            raise UsageError(REFINE_NOT_RANDOM)
        if self.grouping == "similar" and self.method == "random":
            raise UsageError(SIMILAR_NOT_RANDOM)
        if self.calib is not None and not self.calibrated and not calib_used_elsewhere:
            raise UsageError(CALIB_HAS_NO_EFFECT)
        if self.calib is not None and not self.calib.exists():  # as `read_calibration_texts` says it
            raise UsageError(f"--calib file {self.calib} does not exist; pass a text file (.txt, .jsonl, .json "
                             f"or .parquet)")
        if self.refine and self.refine_steps < 1:
            raise UsageError(f"--refine-steps must be at least 1, got {self.refine_steps}")
        if self.refine and not self.refine_lr > 0:
            raise UsageError(f"--refine-lr must be positive, got {self.refine_lr}")

    def start_note(self) -> str | None:
        """'a <kind of> start, not the best one: ...' when these options are not the quality path's
        (None when they are: fit, calibrated, refined); said beside a sweep's table and after a
        conversion, so that nobody takes mean pooling's numbers for what the tool can do."""
        if self.method == "fit" and self.calibrated and self.refine:
            return None
        if self.method == "fit" and self.calibrated:
            return ("fit + calibration start without --refine, not the best one: on the models measured fit + "
                    "calibration closed 64-91% of mean pooling's loss gap to the source, with --refine 85-99% "
                    "(results/refine.md)")
        what = f"{self.method}-pooling" if self.method != "fit" else "fit (uncalibrated)"
        return (f"{what} start, not the best one: the quality path ({QUALITY_PATH}) closed 85-99% of mean "
                f"pooling's loss gap to the source on the models measured (results/refine.md)")

    def baseline(self) -> "ConversionOptions":
        """The paper's mean pooling of contiguous groups, with nothing else (the sweep's --baseline)."""
        return replace(ConversionOptions(), seed=self.seed, device=self.device)

    def record(self) -> dict[str, Any]:
        """What the conversion depends on among these options (calibration and refinement settings
        only where they are used), for a record a rerun compares."""
        calibrated = self.calibrated
        return {"method": self.method, "grouping": self.grouping,
                "calib": str(self.calib.resolve()) if calibrated else None,
                "calib_tokens": self.calib_tokens if calibrated else None,
                "calib_text_unit": self.calib_text_unit if calibrated else None,
                "calib_windows": self.calib_windows if calibrated else None,
                "refine": self.refine,
                "refine_steps": self.refine_steps if self.refine else None,
                "refine_lr": self.refine_lr if self.refine else None,
                "refine_inputs": self.refine_inputs if self.refine else None,
                "seed": self.seed if self.method == "random" else None,
                "group_candidates": self.candidates if calibrated and self.grouping == "similar" else None}

    def calibration(self) -> Any:
        """A fresh `Calibration` of the text where this conversion uses it, else None (imports torch)."""
        if not self.calibrated:
            return None
        from uptrain.convert.layers.calibrate import Calibration

        return Calibration(self.calib, self.calib_tokens, self.device, self.calib_text_unit, self.calib_windows)

    def refine_settings(self, log: Callable[[str], None] | None = None) -> Any:
        """The `RefineSettings` of `--refine` (None without it); `log` gets a line per refined layer."""
        if not self.refine:
            return None
        from uptrain.convert.layers.refine_layer import RefineSettings

        return RefineSettings(self.refine_steps, self.refine_lr, self.refine_inputs, log=log)


def add_conversion_args(p: argparse.ArgumentParser, calib_help: str = "") -> None:
    """The options of `ConversionOptions`, as both commands spell them."""
    p.add_argument("--method", choices=METHODS, default="mean",
                   help="mean: the paper's mean pooling (default); first / random: the paper's ablations; "
                        "fit: least-squares K/V fit with compensation in Q and O")
    p.add_argument("--grouping", choices=GROUPINGS, default="contiguous",
                   help="contiguous: heads j*g..(j+1)*g-1 share K/V head j (default); similar: equal groups "
                        "of the most alike heads (q/o permuted to match)")
    p.add_argument("--calib", type=Path, metavar="FILE",
                   help=calib_help or "text (.txt cut by --calib-text-unit, .jsonl/.json/.parquet 'text'; read as "
                        "the trainer and eval read it) whose attention-input statistics weight --method fit / "
                        "--grouping similar and which --refine tunes on; runs the model one layer at a time")
    p.add_argument("--calib-text-unit", choices=list(TEXT_UNITS), default=DataSource.text_unit,
                   help="what one document of a .txt --calib file is: a paragraph (documents separated by a "
                        "blank line; default, as the trainer's data.*.text_unit), a line or the whole file")
    p.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIB_TOKENS,
                   help=f"tokens of --calib to run (default {DEFAULT_CALIB_TOKENS})")
    p.add_argument("--calib-windows", choices=CALIB_WINDOWS, default=CALIB_WINDOWS[0],
                   help="repeats (default): documents joined as the trainer packs them, each forward pass a "
                        "passage, up to a window of text, the passage again, so the heads that copy are fitted "
                        "at work (results/copy-conversions.md); documents: one document per pass, as before")
    p.add_argument("--refine", action="store_true",
                   help="after the closed-form start (fit, or mean where fit refuses the family), tune each layer's "
                        "attention weights with Adam so its output matches the original layer's on --calib text")
    p.add_argument("--refine-steps", type=int, default=DEFAULT_REFINE_STEPS,
                   help=f"Adam steps per layer, the length of the warm-up and cosine schedule (default "
                        f"{DEFAULT_REFINE_STEPS}; a held-out slice of --calib may stop it sooner)")
    p.add_argument("--refine-lr", type=float, default=DEFAULT_REFINE_LR,
                   help=f"peak Adam learning rate relative to each weight's RMS (default {DEFAULT_REFINE_LR:g})")
    p.add_argument("--refine-inputs", choices=REFINE_INPUTS, default="original",
                   help="each layer learns on the original model's activations (default; measured as good, "
                        "results/refine.md) or on the converted model's own (one more activation copy)")
    p.add_argument("--group-candidates", type=int, metavar="N",
                   help=f"--grouping similar with --calib: make each layer's start in up to N candidate head "
                        f"groupings and keep the one of lowest output error on the calibration text (default "
                        f"{DEFAULT_GROUP_CANDIDATES}; 1: the similarity's best alone; each extra candidate costs one "
                        f"more closed-form fit per layer)")
    p.add_argument("--device", default="cpu", help="torch device of the calibration pass (default cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of --method random")


def conversion_options(args: argparse.Namespace) -> ConversionOptions:
    """The `ConversionOptions` of parsed `add_conversion_args` options."""
    return ConversionOptions(args.method, args.grouping, args.calib, args.calib_tokens, args.calib_text_unit,
                             args.calib_windows, args.refine, args.refine_steps, args.refine_lr, args.refine_inputs, args.seed,
                             args.device, args.group_candidates)
