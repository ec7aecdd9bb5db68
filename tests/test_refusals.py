"""Outputs that cannot be written are refused up front, in one line, exit 2, in every command that
writes one (convert, sweep, demo, train), and no two runs silently write one folder.

Before: `--out` on a read-only file system printed the whole plan, worked 12-16 s, then ended in
`uptrain.convert: OSError: [Errno 30] Read-only file system: '.../.gqa2.partial-...'`, exit 1; a
sweep into a model folder wrote kv1/, kv2/ and sweep.json into it; two conversions into one --out
both exited 0, the later silently replacing the earlier."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT, VALID_TXT
from train_helpers import DEMO, fresh_accelerate_state, need_models, tiny_overrides  # noqa: F401 (autouse fixture)


@pytest.fixture
def read_only_dir():
    """A real read-only folder: a read-only tmpfs (as root), else a folder without write permission."""
    folder = Path(tempfile.mkdtemp(prefix="uptrain-ro-"))
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "none", str(folder)],
                             capture_output=True).returncode == 0
    if not mounted:
        folder.chmod(0o555)
    try:
        try:
            (folder / "probe").mkdir()
            pytest.skip("no read-only folder can be made here (not root, and permissions do not bind this user)")
        except OSError:
            pass
        yield folder
    finally:
        if mounted:
            subprocess.run(["umount", str(folder)], check=True)
        folder.chmod(0o755)
        shutil.rmtree(folder, ignore_errors=True)


def _commands(out: Path, run_dir: Path) -> dict:
    from uptrain.convert.__main__ import main as convert_main
    from uptrain.demo import main as demo_main
    from uptrain.sweep.run import main as sweep_main
    from uptrain.train.__main__ import main as train_main

    return {
        "convert": lambda: convert_main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--out", str(out)]),
        "convert fit": lambda: convert_main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib",
                                             str(TRAIN_TXT), "--refine", "--out", str(out)]),
        "sweep": lambda: sweep_main([str(EXAMPLE_MHA8), "--data", str(VALID_TXT), "--kv-heads", "2", "--out", str(out)]),
        "demo": lambda: demo_main(["--out", str(out), "--tasks", "none", "--threads", "1"]),
        "train": lambda: train_main([str(DEMO), *tiny_overrides(run_dir)]),
    }


@pytest.mark.parametrize("command", ["convert", "convert fit", "sweep", "demo", "train"])
def test_an_output_on_a_read_only_file_system_is_refused_up_front(read_only_dir, capsys, command):
    need_models()
    run = _commands(read_only_dir / "out" / "gqa2", read_only_dir / "run")[command]
    assert run() == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "cannot write in" in lines[0] and "choose a folder you can write to" in lines[0], captured.err
    assert ".partial" not in captured.err and "plan" not in captured.out.lower(), captured.out  # before any work


@pytest.mark.parametrize("command", ["convert", "sweep", "demo", "train"])
def test_an_output_under_a_file_is_refused_up_front(tmp_path, capsys, command):
    need_models()
    (tmp_path / "notes.txt").write_text("mine\n")
    run = _commands(tmp_path / "notes.txt" / "gqa2", tmp_path / "notes.txt" / "run")[command]
    assert run() == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file, not a folder" in err[0], err
    assert (tmp_path / "notes.txt").read_text() == "mine\n"


def test_the_sweep_refuses_a_folder_it_did_not_make_and_continues_its_own(tmp_path, capsys):
    from uptrain.sweep.run import main as sweep_main

    model = tmp_path / "my-model"
    shutil.copytree(EXAMPLE_MHA8, model)
    before = sorted(p.name for p in model.iterdir())
    argv = [str(EXAMPLE_MHA8), "--data", str(VALID_TXT), "--stories", "2", "--kv-heads", "4", "--threads", "1"]
    assert sweep_main([*argv, "--out", str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a sweep's folder" in err[0], err
    assert sorted(p.name for p in model.iterdir()) == before
    out = tmp_path / "sweep"
    assert sweep_main([*argv, "--out", str(out)]) == 0
    assert sweep_main([*argv, "--out", str(out)]) == 0  # its own folder: a rerun continues
    assert "kept" in capsys.readouterr().out


def _race(first: list[str], second: list[str], env: dict) -> int:
    """`first` held just before it puts its folder in place while `second` runs whole; both into one folder
    without --force: one exits 0, the other is refused in one line with exit 2. Returns `first`'s exit code."""
    held = subprocess.Popen(first, cwd=REPO, env={**env, "UPTRAIN_TEST_PAUSE_AT": "rename:10"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen = ""
    while held.poll() is None and "paused at rename" not in seen:
        seen = held.stderr.readline()
    other = subprocess.run(second, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    err = held.communicate(timeout=300)[1]
    codes = sorted([held.returncode, other.returncode])
    assert codes == [0, 2], (held.returncode, err[-2000:], other.returncode, other.stderr[-2000:])
    refused = err if held.returncode == 2 else other.stderr
    assert "appeared while this run wrote it" in refused and refused.strip().count("\n") == 0, refused
    return held.returncode


def test_two_conversions_into_one_folder_one_is_refused(tmp_path):
    """The first is held just before it puts its folder in place while the second runs whole: one
    of them (whichever comes second to that point) is refused, and the folder is the other's."""
    out = tmp_path / "gqa2"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "uptrain.convert", str(EXAMPLE_MHA8), "--kv-heads", "2", "--out", str(out)]
    held = _race(command, command + ["--method", "first"], env)
    record = json.loads((out / "uptrain_conversion.json").read_text())
    assert record["method"] == ("mean" if held == 0 else "first"), record  # the one that was not refused
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_two_fit_conversions_into_one_folder_one_is_refused(tmp_path):
    """As above with `--method fit --calib` (the layer-at-a-time path, which keeps each finished layer
    beside the output and writes through `pipeline.write_converted`): two runs, calibrated on 1,024 and
    2,048 tokens, neither with --force. The first is held just before it puts its folder in place
    while the second runs whole: whichever comes second to that point is refused in one line, exit 2,
    and the folder is the other's (its record's calibration); no temporary folder is left."""
    out = tmp_path / "gqa2"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    command = [sys.executable, "-m", "uptrain.convert", str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit",
               "--calib", str(TRAIN_TXT), "--threads", "1", "--out", str(out)]
    held = _race([*command, "--calib-tokens", "1024"], [*command, "--calib-tokens", "2048"], env)
    record = json.loads((out / "uptrain_conversion.json").read_text())
    assert record["method"] == "fit", record
    assert record["calibration"]["tokens_requested"] == (1024 if held == 0 else 2048), record["calibration"]
    assert not [p for p in tmp_path.iterdir() if ".partial-" in p.name or ".complete-" in p.name]


@pytest.mark.parametrize("where", ["inside", "link", "itself"])
def test_a_sweep_into_its_source_is_refused_before_any_work(tmp_path, capsys, where):
    """--out inside the source, a symlink to it, or the source folder: one line, exit 2, as
    uptrain.convert refuses it, and the source untouched. Before: SRC/sub scored the source, wrote
    sweep.json into the model folder, and was refused only by the first conversion."""
    from uptrain.sweep.run import main as sweep_main

    model = tmp_path / "my-model"
    shutil.copytree(EXAMPLE_MHA8, model)
    (tmp_path / "link").symlink_to(model)
    before = {p.name: p.stat().st_mtime_ns for p in model.iterdir()}
    out = {"inside": model / "sub", "link": tmp_path / "link", "itself": model}[where]
    argv = [str(model), "--data", str(VALID_TXT), "--stories", "2", "--kv-heads", "4", "--threads", "1"]
    assert sweep_main([*argv, "--out", str(out)]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and f"--out {model.resolve()}" in err[0] and "is inside the source checkpoint" in err[0], err
    assert captured.out == "", captured.out  # nothing announced, nothing scored
    assert {p.name: p.stat().st_mtime_ns for p in model.iterdir()} == before


def test_a_sweep_of_a_folder_of_its_own_into_it_is_refused(tmp_path, capsys):
    """The source inside --out (a sweep's converted model swept again into that sweep): refused too."""
    from uptrain.sweep.run import main as sweep_main

    out = tmp_path / "sweep"
    shutil.copytree(EXAMPLE_MHA8, out / "kv8")
    assert sweep_main([str(out / "kv8"), "--data", str(VALID_TXT), "--kv-heads", "4", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is inside --out" in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["kv8"]


def test_a_sweep_given_a_folder_as_data_says_it_is_a_folder(tmp_path, capsys):
    from uptrain.sweep.run import main as sweep_main

    assert sweep_main([str(EXAMPLE_MHA8), "--data", str(tmp_path), "--out", str(tmp_path / "sweep")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--data {tmp_path} is a folder; pass the held-out text file" in err[0], err
    assert "does not exist" not in err[0] and not (tmp_path / "sweep").exists()
