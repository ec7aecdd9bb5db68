"""What a sweep's numbers depend on, recorded beside them: a rerun keeps only what is provably the same.

`OUT/sweep.json` holds, besides the points, the sweep's record: its id, uptrain's code (`uptrain.code_fingerprint`), and
content fingerprints (SHA-256) of the checkpoint folder, the held-out text and the calibration
text, never their paths alone (another checkpoint at the same path is another checkpoint). Each
point's settings hold what its numbers were made from (`conversion`: checkpoint, options, texts;
`scoring`: the held-out text and how much of it); a rerun keeps a point's folder only when its
conversion matches and its score only when its scoring matches too, and says what changed.

Ownership: every folder the sweep writes holds `MARK` with the sweep's id. The sweep replaces
only folders with its own mark: a folder at one of its paths that it did not write is refused,
never deleted. A checkpoint's files are hashed once: the digest is kept with the file's size and
modification time (`digests`), and read again only when those change (as git does).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

from uptrain import __version__, code_fingerprint
from uptrain.fingerprint import file_digest, folder_fingerprint  # noqa: F401 (public here too)
from uptrain.errors import UsageError

MARK = ".uptrain-sweep"  # in every folder a sweep wrote: that sweep's id
RECORDS = "sweep.json"


def text_fingerprint(path: Path | None, digests: dict[str, list]) -> str | None:
    return None if path is None else file_digest(path, digests)


def changes(old: dict, new: dict) -> list[str]:
    """What differs between two settings dicts, each as 'key old -> new' (fingerprints shortened)."""
    def shown(value):
        return value[:12] if isinstance(value, str) and len(value) == 64 else value

    return [f"{key} {shown(old.get(key))} -> {shown(new.get(key))}" for key in sorted(set(old) | set(new))
            if old.get(key) != new.get(key)]


class SweepFolder:
    """The sweep's folder OUT: its record (id, digests, points as dicts) and what it owns."""

    def __init__(self, out: Path):
        self.out = out
        self.id, self.digests, self.points = uuid.uuid4().hex, {}, []
        path = out / RECORDS
        if path.exists():
            try:
                data = json.loads(path.read_text())
                self.id, self.digests, self.points = data["sweep"]["id"], data["digests"], data["points"]
            except (ValueError, KeyError, TypeError):
                raise UsageError(f"{path} is not a record this version of uptrain.sweep wrote (no sweep id); "
                                 f"choose another --out, or remove {out} to start over") from None
        elif (out / "sweep.png").exists():
            raise UsageError(f"{out} holds a sweep.png but no {RECORDS}: not a sweep folder this sweep can "
                             f"continue; choose another --out")
        elif out.is_dir() and any(not p.name.startswith(".") for p in out.iterdir()):
            # (hidden entries: what a stopped first run of this sweep keeps, finished layers, partial folders)
            raise UsageError(f"--out {out} already exists and is not a sweep's folder (no {RECORDS}); the sweep "
                             f"writes only into a new folder or its own: choose another --out")
        elif out.exists() and not out.is_dir():
            raise UsageError(f"--out {out} is a file; choose a folder path")

    def owns(self, folder: Path) -> bool:
        """Whether `folder` is one this sweep wrote (its mark holds our id)."""
        mark = folder / MARK
        try:
            return mark.is_file() and mark.read_text().strip() == self.id
        except OSError:
            return False

    def check_free(self, folders: list[Path]) -> None:
        """UsageError naming the first of `folders` that exists and is not ours (nothing is written)."""
        for folder in folders:
            if (folder.exists() or folder.is_symlink()) and not self.owns(folder):
                raise UsageError(f"{folder} exists and was not written by this sweep (no {MARK} with its id); "
                                 f"the sweep never replaces it: move it away or choose another --out")

    def mark(self, folder: Path) -> None:
        """Mark a folder the sweep is about to fill (a run folder) as its own."""
        folder.mkdir(parents=True, exist_ok=True)
        (folder / MARK).write_text(self.id + "\n")

    def fingerprints(self, checkpoint: Path, data: Path, calib: Path | None) -> dict[str, str | None]:
        return {"uptrain": code_fingerprint(), "checkpoint": folder_fingerprint(checkpoint, self.digests),
                "data": text_fingerprint(data, self.digests), "calib": text_fingerprint(calib, self.digests)}

    def write(self, points: list[dict]) -> None:
        """sweep.json, written whole (after every point: a stopped sweep keeps what it finished)."""
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{RECORDS}.tmp"
        record = {"sweep": {"id": self.id, "uptrain": __version__}, "points": points, "digests": self.digests}
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, self.out / RECORDS)
