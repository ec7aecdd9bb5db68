"""Held-out text that a conversion calibrated on: counted and warned, by the documents' content.

A conversion with `--calib` records a short SHA-256 of every calibration document it read
(`calibration.document_sha256` in `uptrain_conversion.json`, which the trainer carries into its
final model). Scoring a model on documents it was fitted to flatters its fidelity: in the README's
four commands, the trainer holds out documents of the same text that `--calib` read, and 15 of 45
held-out documents had been calibration text. `uptrain.eval` and `uptrain.train` warn with
`calibration_overlap_warning`; the sweep refuses the same file outright.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

RECORD_FILE = "uptrain_conversion.json"  # uptrain.convert.pipeline.RECORD_FILE (not imported: no torch here)
DIGEST_LIMIT = 200_000  # calibration documents recorded at most (3.4 MB of JSON)


def document_digest(text: str) -> str:
    """A document's identity: the first 16 hex digits of the SHA-256 of its text, ends stripped (the
    readers strip a document's trailing newlines; a .jsonl and a .txt of the same text agree)."""
    return hashlib.sha256(text.strip().encode("utf-8")).hexdigest()[:16]


def digests(texts: Iterable[str]) -> list[str]:
    """`document_digest` of each text, at most DIGEST_LIMIT of them, in order."""
    out = []
    for text in texts:
        if len(out) == DIGEST_LIMIT:
            break
        out.append(document_digest(text))
    return out


def calibration_digests(model_dir: Path) -> tuple[set[str], str] | None:
    """The calibration documents a model folder was converted with (its conversion record, carried by
    the trainer into its final model) and the calibration file's name; None without them."""
    path = Path(model_dir) / RECORD_FILE
    try:
        calibration = json.loads(path.read_text(encoding="utf-8")).get("calibration") or {}
    except (OSError, ValueError, AttributeError):
        return None
    found = calibration.get("document_sha256")
    if not isinstance(found, list) or not found:
        return None
    return set(found), Path(str(calibration.get("file", "the calibration text"))).name


def calibration_overlap_warning(model_dir: Path, texts: list[str], scored: str) -> str | None:
    """A one-line warning when some of `texts` (the documents `scored` names) were calibration text of
    the conversion behind `model_dir`; None when none were (or the model records none)."""
    known = calibration_digests(model_dir)
    if known is None or not texts:
        return None
    calibrated, calib_file = known
    shared = sum(document_digest(t) in calibrated for t in texts)
    if shared == 0:
        return None
    return (f"warning: {shared:,} of the {len(texts):,} documents of {scored} were calibration text of {model_dir} "
            f"(--calib {calib_file}): its fidelity on them flatters it; score on documents the calibration did not "
            "read (hold them out of the --calib file, or calibrate on other text)")
