"""What `uptrain.demo` keeps between runs: its finished steps, keyed by what made them.

`OUT/.uptrain-demo` (JSON) holds the demo's key and the steps it finished. The key is a SHA-256 over
uptrain's code, the source model's files (by content: another model at the same path is another
model), the texts it reads (`--data`, `--valid`, the shipped ones), configs/demo-cpu.yaml and every
option but `--out` and `--threads`. A rerun with the same key keeps OUT as it is and continues:
the samples, the conversion and a finished uptraining are kept; an uptraining stopped after a
checkpoint resumes from it; the scores are computed again (seconds). Another key empties OUT, as
a new demo (a conversion's finished layers aside: they carry a key of their own).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from uptrain.errors import UsageError

DEMO_MARK = ".uptrain-demo"
STEPS = ("samples", "convert", "uptrain", "context")
_UNKEYED = ("out", "threads")  # where the demo writes and how fast: the same steps either way


def demo_key(args, source: Path, texts: list[Path], config: Path, digests: dict) -> str:
    """The key of this demo's steps (module doc); `digests`: the file-hash cache (`record.file_digest`)."""
    from uptrain import code_fingerprint
    from uptrain.fingerprint import file_digest, folder_fingerprint

    options = {k: (str(v) if isinstance(v, Path) else v) for k, v in sorted(vars(args).items()) if k not in _UNKEYED}
    made = {"uptrain": code_fingerprint(), "source": folder_fingerprint(source, digests),
            "texts": [file_digest(t, digests) for t in texts if t.is_file()],
            "config": hashlib.sha256(config.read_bytes()).hexdigest(), "options": options}
    return hashlib.sha256(json.dumps(made, sort_keys=True, default=str).encode()).hexdigest()


class DemoRecord:
    """OUT's record: the key and the finished steps (`finish` writes it whole after each step)."""

    def __init__(self, out: Path, key: str, digests: dict | None = None):
        self.out, self.key, self.steps, self.digests = out, key, [], digests if digests is not None else {}
        self._earlier = earlier(out)

    def prepare(self) -> list[str]:
        """Make OUT this demo's folder; the steps kept from a stopped run of the same demo ([] for none:
        an earlier demo's folder of another key is emptied; any other non-empty folder is refused)."""
        from uptrain.convert.io.output_dir import check_writable

        check_writable(self.out, "--out")
        if self.out.exists() and any(self.out.iterdir()):
            if not (self.out / DEMO_MARK).is_file():
                raise UsageError(f"--out {self.out} is a non-empty folder the demo did not make; give another --out "
                                 "(the demo replaces only its own folders)")
            if self._earlier is not None and self._earlier.get("key") == self.key:
                self.steps = [s for s in self._earlier.get("steps", []) if s in STEPS]
                return list(self.steps)
            _empty(self.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self._write()
        return []

    def done(self, step: str) -> bool:
        return step in self.steps

    def finish(self, step: str) -> None:
        """`step` is finished and whole: kept by a rerun of this demo."""
        if step not in self.steps:
            self.steps.append(step)
        self._write()

    def _write(self) -> None:
        tmp = self.out / f"{DEMO_MARK}.tmp"
        tmp.write_text(json.dumps({"made_by": "python -m uptrain.demo; a rerun of the same demo continues it, another "
                                   "demo into this folder replaces it", "key": self.key, "steps": self.steps,
                                   "digests": self.digests}, indent=1) + "\n")
        os.replace(tmp, self.out / DEMO_MARK)


def earlier(out: Path) -> dict | None:
    """The record an earlier demo left in `out` (None: none, or an older demo's plain-text mark)."""
    try:
        data = json.loads((out / DEMO_MARK).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def earlier_digests(out: Path) -> dict:
    """The file-hash cache an earlier demo kept in `out` (`fingerprint.file_digest`): a rerun reads only changed files."""
    digests = (earlier(out) or {}).get("digests")
    return digests if isinstance(digests, dict) else {}


def _empty(out: Path) -> None:
    """Remove OUT's entries but a stopped conversion's finished layers (`.NAME.layers-KEY`)."""
    for entry in out.iterdir():
        if entry.is_dir() and entry.name.startswith(".") and ".layers-" in entry.name:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def checkpoints(run_dir: Path) -> list[Path]:
    """The uptraining's checkpoints a stopped run left in `run_dir`, oldest first."""
    return sorted((run_dir / "checkpoints").glob("checkpoint-*")) if (run_dir / "checkpoints").is_dir() else []
