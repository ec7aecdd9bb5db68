"""Content fingerprints: what every result kept for reuse is keyed by (a sweep's points, the demo's
steps, the teacher's samples), never a path alone: another checkpoint at the same path is another
checkpoint. A file's SHA-256 is kept with its size and modification time (`digests`) and read again
only when those change (as git does). Standard library only."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

_CHUNK = 8 << 20


def file_digest(path: Path, digests: dict[str, list]) -> str:
    """SHA-256 of the file's bytes; reused from `digests` (path -> [size, mtime_ns, digest], updated
    here) while its size and modification time are those recorded."""
    real = path.resolve()  # a Hub snapshot's files are links to its blobs
    stat = real.stat()
    known = digests.get(str(real))
    if known and known[:2] == [stat.st_size, stat.st_mtime_ns]:
        return known[2]
    sha = hashlib.sha256()
    with open(real, "rb") as f:
        while chunk := f.read(_CHUNK):
            sha.update(chunk)
    digests[str(real)] = [stat.st_size, stat.st_mtime_ns, sha.hexdigest()]
    return sha.hexdigest()


def folder_fingerprint(folder: Path, digests: dict[str, list]) -> str:
    """SHA-256 over every file of a model folder (names relative to it and their digests), hidden
    folders (.git, .cache) left out: the same content anywhere gives the same fingerprint."""
    sha = hashlib.sha256()
    for root, dirs, names in os.walk(folder, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            path = Path(root) / name
            if path.is_file():
                sha.update(f"{path.relative_to(folder).as_posix()}\0{file_digest(path, digests)}\n".encode())
    return sha.hexdigest()
