"""uptrain: MHA -> GQA conversion of Hugging Face checkpoints, uptraining, and measuring the trade."""

import os as _os

__version__ = "0.1.0"


def code_fingerprint(*modules: str, root=None) -> str:
    """A hash of this package's code (every .py file under it, by content): what a kept result
    (a conversion's kept layers, a sweep's numbers) was made by. `__version__` changes only at a
    release; a checkout's code changes with every edit.

    `modules` (paths under the package, e.g. "train/model/sampling.py"): hash only those files, for a
    result whose making is confined to them (the teacher's samples), so an edit elsewhere keeps it.
    `root`: another copy of the package (tests); this one by default."""
    global _code
    if _code is not None and not modules and root is None:
        return _code
    import hashlib
    from pathlib import Path

    default = root is None
    root = Path(__file__).parent if default else Path(root)
    paths = [root / name for name in modules] if modules else sorted(root.rglob("*.py"))
    digest = hashlib.sha256()
    for path in paths:
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    if modules or not default:
        return digest.hexdigest()[:16]
    _code = digest.hexdigest()[:16]
    return _code


_code: str | None = None

# One progress bar per long step, ours: the libraries' own bars (weights loading, shard writing,
# dataset maps, downloads) are off unless the user asks for them by setting these to 0.
for _var in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
    _os.environ.setdefault(_var, "1")
