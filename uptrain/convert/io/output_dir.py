"""The all-or-nothing output folder: written beside DIR, swapped into place only when complete.

`atomic_output_dir` yields a hidden temporary folder next to the output; when the block completes,
every file and folder is fsynced and the new folder takes DIR's place in one atomic exchange where
the OS has one (Linux renameat2 RENAME_EXCHANGE), else in two renames after marking the new folder
complete, which `recover_output` finishes or undoes on the next run after a crash. So after any
crash DIR is the old state or the complete new folder. Used by the converter and by the trainer's
final model folder. Standard library only.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import os
import shutil
import sys
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from uptrain.stopping import at_once
from uptrain.errors import UsageError


def check_output_path(out: Path, source: Path, force: bool) -> None:
    """Refuse an output that would touch the source or replace something without --force.

    First finishes a replacement of `out` that a killed run left half done (`recover_output`), so
    that what exists is judged as it will be.
    """
    out = check_apart(out, source)
    recover_output(out)
    if out.exists() and not force:
        raise UsageError(f"output {out} already exists; pass --force to replace it or choose another folder")
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file; choose a folder path")
    check_writable(out, "output")


def check_apart(out: Path, source: Path, what: str = "output") -> Path:
    """Refuse an output folder that is the source, lies inside it or holds it (symlinks followed:
    a link to the source is the source); returns `out` resolved. Also the sweep's, before any work."""
    out, source = out.resolve(), source.resolve()
    if out == source or out.is_relative_to(source):
        raise UsageError(f"{what} {out} is inside the source checkpoint {source}; choose a folder outside it")
    if source.is_relative_to(out):
        raise UsageError(f"the source checkpoint {source} is inside {what} {out}; choose another {what}")
    return out


def check_writable(out: Path, what: str = "--out") -> None:
    """Refuse, before any work, an output folder that cannot be written: a read-only file system, a
    folder without write permission, a file where a parent folder must be. What is written beside
    `out` (the temporary folder) and the parents that would be made go into the nearest existing
    folder above it: a hidden folder is made and removed there (and inside `out`, when it is an
    existing folder that is written into: the sweep's, a run folder)."""
    out = Path(os.path.abspath(out))
    for _ in range(10):  # a folder that vanishes meanwhile (another process's check removing what it made): again
        place = next(p for p in (out.parent, *out.parent.parents) if p.exists() or p == p.parent)
        if not place.is_dir():
            if not place.exists():  # removed since it was found: look again
                continue
            raise UsageError(f"{what} {out}: {place} is a file, not a folder; choose another path")
        try:
            for folder in (place, out) if out.is_dir() else (place,):
                try:
                    os.rmdir(tempfile.mkdtemp(prefix=".uptrain-write-check-", dir=folder))
                except FileNotFoundError:
                    raise
                except OSError as err:
                    raise UsageError(f"{what} {out}: cannot write in {folder} ({err.strerror}); choose a folder "
                                     f"you can write to") from None
            return
        except FileNotFoundError:
            continue


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# Hidden siblings of an output folder DIR, each `.DIR.<kind>-PID-HEX` (PID: the process that made it):
#   partial   being written; after an exchange, the old output being removed: always garbage once its process is gone
#   complete  written and fsynced, waiting for the two-step swap: the new output
#   old       the previous DIR, moved aside by the two-step swap
_KINDS = ("partial", "complete", "old")


def _sibling(out: Path, kind: str, tag: str) -> Path:
    return out.parent / f".{out.name}.{kind}-{tag}"


def _leftovers(out: Path, kind: str) -> list[Path]:
    """`kind` siblings of `out` whose process is gone (an `old` folder without a PID, left by
    versions before the PID was added to its name, counts as gone), oldest first."""
    found = []
    for path in out.parent.glob(f".{glob.escape(out.name)}.{kind}-*"):
        pid = path.name[len(out.name) + len(kind) + 3:].split("-")[0]
        if path.is_dir() and not path.is_symlink() and not (pid.isdigit() and _pid_alive(int(pid))):
            found.append(path)
    return sorted(found, key=lambda p: p.stat().st_mtime_ns)


def recover_output(out: Path) -> None:
    """Finish what a killed run left half done for output `out`; folders of live processes are left alone.

    Without `out`: the newest complete new folder is renamed into place, else the old output is
    restored. Then every leftover (partial, complete, old) of a dead process is deleted.
    """
    out = out.resolve()
    if not out.parent.is_dir():
        return
    for path in _leftovers(out, "partial"):  # unfinished, or an old output already swapped out
        shutil.rmtree(path, ignore_errors=True)
    if not out.exists() and not out.is_symlink():
        restore = (_leftovers(out, "complete") or _leftovers(out, "old"))[-1:]
        for path in restore:
            try:
                path.rename(out)
                fsync_path(out.parent)
            except OSError:  # another run restored it first, or `out` appeared meanwhile
                pass
    for kind in ("complete", "old"):
        for path in _leftovers(out, kind):
            shutil.rmtree(path, ignore_errors=True)


_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100
# renameat2 errors that mean "no exchange here" (old kernel, filesystem without it), not "failed"
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV}


def exchange_paths(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step: renameat2(RENAME_EXCHANGE), Linux >= 3.15 with
    glibc >= 2.28, on filesystems that support it (ext4, xfs, btrfs, tmpfs, ...). False, with
    nothing changed, where there is none (another OS, older glibc, a filesystem without it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _NO_EXCHANGE:
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def fsync_path(path: Path) -> None:
    """Flush a file's or a folder's data and metadata to the disk.

    Folders cannot be opened for fsync on Windows; there the folder step is skipped (NTFS
    journals the rename itself).
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) * path.is_dir()
    try:
        fd = os.open(path, flags)
    except (IsADirectoryError, PermissionError):
        if path.is_dir():
            return
        raise
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(folder: Path) -> None:
    """fsync every file under `folder`, then every folder, deepest first, `folder` last."""
    folders = []
    for root, _, names in os.walk(folder):
        folders.append(Path(root))
        for name in names:
            fsync_path(Path(root) / name)
    for sub in reversed(folders):
        fsync_path(sub)


@contextmanager
def atomic_output_dir(out: Path, replace: bool = True) -> Iterator[Path]:
    """Yield a temporary folder beside `out`; it becomes `out` only if the block completes.

    replace: an `out` that exists when the folder is put in place may be replaced (the trainer's
    final model; --force). Without it, an `out` that appeared meanwhile (another conversion into the
    same folder finished first) is refused: UsageError, nothing written, that folder kept.

    On any error (disk full, a bad tensor, Ctrl-C) the temporary folder is removed and `out` is
    untouched. Every file and the folder are fsynced before the folder is put in place, and the
    parent folder after each rename, so even across a power loss or a SIGKILL `out` ends as the
    old state or the complete new folder:

    - no `out` yet: one rename;
    - an existing `out` (--force): one atomic exchange of the two folders where the OS has one
      (`exchange_paths`), then the old one is removed; else two renames, with the new folder
      first marked complete (`.NAME.complete-*`) so that a run killed between them is finished by
      `recover_output`, which the next run for `out` calls (here and in `check_output_path`).

    A run killed while writing leaves a hidden `.NAME.partial-PID-*` folder, which the next run removes.
    """
    out = out.resolve()
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_output(out)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = _sibling(out, "partial", tag)
    tmp.mkdir()
    at_once.register(tmp)
    try:
        yield tmp
        sync_tree(tmp)
        at_once.pause("rename")
        if not replace and (out.exists() or out.is_symlink()):
            raise UsageError(f"output {out} appeared while this run wrote it (another run into the same folder "
                             f"finished first); nothing was written and it is kept: choose another folder, "
                             f"or pass --force to replace it")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        at_once.unregister(tmp)
        raise
    with at_once.shielded():  # the point of no return: a signal now is reported after it (`at_once`)
        _put_in_place(out, tmp, tag)
        at_once.unregister(tmp)
        at_once.written(out)


def _put_in_place(out: Path, tmp: Path, tag: str) -> None:
    """Make the complete folder `tmp` the output `out` (see `atomic_output_dir`)."""
    if not out.exists() and not out.is_symlink():
        tmp.rename(out)
        fsync_path(out.parent)
        return
    if exchange_paths(tmp, out):  # `tmp` now holds the old output
        fsync_path(out.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        return
    complete, old = _sibling(out, "complete", tag), _sibling(out, "old", tag)
    tmp.rename(complete)
    fsync_path(out.parent)  # marked complete on disk before `out` moves
    out.rename(old)
    try:
        complete.rename(out)
    except BaseException:
        old.rename(out)
        shutil.rmtree(complete, ignore_errors=True)
        raise
    fsync_path(out.parent)
    shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_output_dirs(outs: list[Path], replace: bool = False) -> Iterator[list[Path]]:
    """`atomic_output_dir` for several folders at once: all of them take their place, or none does.

    Yields a temporary folder beside each output (in the order of `outs`). Only once the block has
    completed for all of them are they swapped into place, one after another; if a swap fails (an
    output path blocked meanwhile, a full disk) the swaps already made are undone, so every output
    is as it was. On any error in the block every temporary folder is removed. (A SIGKILL between
    two swaps leaves some outputs new and some old, each whole: the same per-folder guarantee as
    `atomic_output_dir`.) replace: an output folder that exists may be replaced (--force); a
    file, or a folder without `replace`, at an output path when the swaps start fails them all.
    """
    resolved = [out.resolve() for out in outs]
    tags = [f"{os.getpid()}-{uuid.uuid4().hex[:8]}" for _ in resolved]
    tmps = [_sibling(out, "partial", tag) for out, tag in zip(resolved, tags)]
    try:
        for out, tmp in zip(resolved, tmps):
            out.parent.mkdir(parents=True, exist_ok=True)
            recover_output(out)
            tmp.mkdir()
            at_once.register(tmp)  # a signal that ends the process removes it
        yield tmps
        for tmp in tmps:
            sync_tree(tmp)
        with at_once.shielded():  # the swaps: all or none, a signal reported after them
            for tmp in tmps:
                at_once.unregister(tmp)
            _swap_all(resolved, tmps, replace)
    finally:
        for tmp in tmps:  # after a swap a temporary folder holds the old output; else it is unfinished
            at_once.unregister(tmp)
            shutil.rmtree(tmp, ignore_errors=True)


def _swap_all(outs: list[Path], tmps: list[Path], replace: bool) -> None:
    """Put each `tmps[i]` in place of `outs[i]`, leaving the old output (if any) at `tmps[i]`; on a
    failure undo the swaps made, newest first, and raise."""
    done: list[tuple[Path, Path, bool]] = []  # (out, tmp, whether out existed before)
    try:
        for out, tmp in zip(outs, tmps):
            existed = out.exists() or out.is_symlink()
            if existed and (out.is_symlink() or not out.is_dir()):
                raise UsageError(f"output {out} is a file (it appeared during the conversion); nothing was "
                                 f"written: move it away and run again")
            if existed and not replace:
                raise UsageError(f"output {out} appeared during the conversion; nothing was written: move it "
                                 f"away or pass --force, and run again")
            if not existed:
                tmp.rename(out)
            elif not exchange_paths(tmp, out):  # no atomic exchange here: two renames
                aside = _sibling(out, "old", tmp.name.rsplit("partial-", 1)[-1])
                out.rename(aside)
                tmp.rename(out)
                aside.rename(tmp)
            done.append((out, tmp, existed))
            fsync_path(out.parent)
    except BaseException:
        for out, tmp, existed in reversed(done):
            if not existed:
                out.rename(tmp)
            elif not exchange_paths(tmp, out):
                new = _sibling(out, "partial", uuid.uuid4().hex[:8] + "-undo")
                out.rename(new)
                tmp.rename(out)
                new.rename(tmp)
            fsync_path(out.parent)
        raise
