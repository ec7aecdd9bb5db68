"""uptrain: MHA -> GQA conversion of Hugging Face checkpoints, uptraining, and measuring the trade."""

import os as _os

__version__ = "0.1.0"


def code_fingerprint(*modules: str, root=None) -> str:
    """A hash of this package's code (every .py file under it, by content): what a kept result
    (a conversion's kept layers, a sweep's numbers) was made by. `__version__` changes only at a
    release; a checkout's code changes with every edit.

    `modules` (paths under the package, e.g. "train/model/sampling.py"): hash only those files, for a
    result whose making is confined to them (the teacher's samples), so an edit elsewhere keeps it.
    `root`: another copy of the package (tests); this one by default. Only the whole package's own
    hash is kept for the process (it is asked for often; the others are a few files)."""
    global _code
    if modules or root is not None:
        return _files_digest(root, modules)
    if _code is None:
        _code = _files_digest(None, ())
    return _code


def _files_digest(root, modules: tuple[str, ...]) -> str:
    """The first 16 hex digits of a sha256 over `modules` (all .py files when empty) under `root`."""
    import hashlib
    from pathlib import Path

    root = Path(__file__).parent if root is None else Path(root)
    paths = [root / name for name in modules] if modules else sorted(root.rglob("*.py"))
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


_code: str | None = None

# One progress bar per long step, ours: the libraries' own bars (weights loading, shard writing,
# dataset maps, downloads) are off unless the user asks for them by setting these to 0.
for _var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
    _os.environ.setdefault(_var, "1")
