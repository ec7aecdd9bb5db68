"""The all-or-nothing output folder (`uptrain.convert.io.output_dir`): a failure leaves the old
state, a kill at any step of a --force swap leaves DIR old or complete new, and the next run cleans up."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from uptrain.errors import UsageError
from uptrain.convert.io.output_dir import atomic_output_dir


def test_atomic_output_dir_leaves_nothing_on_failure_and_keeps_the_old_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(OSError):
        with atomic_output_dir(out) as tmp:
            (tmp / "half.safetensors").write_bytes(b"x")
            raise OSError(28, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "old.txt").exists()
    with atomic_output_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# ------------------------------------------------------------------ --force killed in the middle of the swap

SWAP_SCRIPT = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from uptrain.convert.io import output_dir as shards
    out, mode = Path(sys.argv[1]).resolve(), sys.argv[2]
    if mode.startswith("two-step"):  # as where the OS or filesystem has no atomic exchange
        shards.exchange_paths = lambda a, b: False

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    real_rename, real_rmtree = os.rename, shutil.rmtree

    def rename(a, b, *args, **kwargs):  # Path.rename calls os.rename
        if (mode == "two-step-between" and Path(b) == out) or (mode == "two-step-first" and Path(a) == out):
            die()  # two-step-between: the old output is already moved aside, the new one not yet in place
        if mode == "exchange" and Path(a) == out:
            sys.exit(3)  # the two-step fallback was taken: not what this mode tests
        return real_rename(a, b, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        if mode in ("exchange", "two-step-last"):
            die()  # the new output is in place; the old one is not removed yet
        return real_rmtree(path, *args, **kwargs)
    os.rename, shutil.rmtree = rename, rmtree
    with shards.atomic_output_dir(out) as tmp:
        (tmp / "model.txt").write_text("new")
        if mode == "writing":
            die()
""")


def killed_swap(tmp_path: Path, mode: str) -> Path:
    """An existing output `out` (old.txt), replaced by a process SIGKILLed at `mode`."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    proc = subprocess.run([sys.executable, "-c", SWAP_SCRIPT, str(out), mode], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr  # it died where it was told to
    return out


def contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def exchange_supported(tmp_path: Path) -> bool:
    from uptrain.convert.io import output_dir as shards
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir()
    b.mkdir()
    try:  # (before the fix there was no exchange_paths: run the test, it must fail)
        return bool(getattr(shards, "exchange_paths", lambda a, b: True)(a, b))
    finally:
        a.rmdir()
        b.rmdir()


@pytest.mark.parametrize("mode,expect", [("two-step-between", "new"), ("two-step-first", "old"),
                                         ("two-step-last", "new"), ("exchange", "new"), ("writing", "old")])
def test_a_kill_during_the_swap_leaves_old_or_new_and_the_next_run_cleans_up(tmp_path, mode, expect):
    """SIGKILL at each step of replacing an existing output: the next run (here its first step,
    check_output_path, which refuses to replace without --force) finds `out` whole, old or new, and
    no hidden leftovers; a run after that replaces it normally."""
    from uptrain.convert.io.output_dir import check_output_path
    if mode == "exchange" and sys.platform.startswith("linux") and not exchange_supported(tmp_path):
        pytest.skip("this filesystem has no renameat2(RENAME_EXCHANGE)")
    out = killed_swap(tmp_path, mode)
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(UsageError, match="already exists"):
        check_output_path(out, src, force=False)
    assert contents(out) == ({"model.txt": "new"} if expect == "new" else {"old.txt": "old"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    with atomic_output_dir(out) as tmp:
        (tmp / "again.txt").write_text("again")
    assert contents(out) == {"again.txt": "again"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_recovery_restores_an_old_output_alone_and_leaves_live_runs_alone(tmp_path):
    """No `out` and only the moved-aside old output (a name without PID, as older versions wrote it):
    it is put back. Folders of a live process (here this one) are not touched."""
    from uptrain.convert.io.output_dir import recover_output
    out = tmp_path / "out"
    old = tmp_path / ".out.old-deadbeef"
    old.mkdir()
    (old / "old.txt").write_text("old")
    recover_output(out)
    assert contents(out) == {"old.txt": "old"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    out.rename(tmp_path / "elsewhere")
    live = tmp_path / f".out.complete-{os.getpid()}-0000abcd"
    live.mkdir()
    recover_output(out)
    assert not out.exists() and live.is_dir()


def test_exchange_paths_swaps_two_folders(tmp_path):
    from uptrain.convert.io.output_dir import exchange_paths
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "name.txt").write_text(folder.name)
    if not exchange_paths(a, b):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here: the two-step path is used (tested above)")
    assert (a / "name.txt").read_text() == "b" and (b / "name.txt").read_text() == "a"


def test_the_write_check_is_not_fooled_by_a_folder_removed_while_it_runs(tmp_path):
    """Another process may remove the folder the check probes (the trainer's process 0 removes the
    run_dir it made to test that every process shares it, while the others check it): not a refusal.
    Before: "run_dir ...: cannot write in ... (No such file or directory)", exit 2 on one rank."""
    import random
    import shutil
    import threading

    from uptrain.convert.io.output_dir import check_writable

    rng = random.Random(0)
    run = tmp_path / "a" / "run"
    refused = 0
    for _ in range(400):
        run.mkdir(parents=True, exist_ok=True)
        remover = threading.Timer(rng.uniform(0, 1e-4), shutil.rmtree, args=(tmp_path / "a",),
                                  kwargs={"ignore_errors": True})
        remover.start()
        try:
            check_writable(run, "run_dir")
        except UsageError:
            refused += 1
        remover.join()
    assert refused == 0
