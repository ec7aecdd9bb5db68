"""A rerun of an interrupted layer-at-a-time conversion continues from the last finished layer, and
its output equals an uninterrupted conversion's, tensor for tensor, wherever the stop landed.

Real processes and real signals: `python -m uptrain.convert` on the bundled 5-layer stories260K
with `--method fit --refine`, paused right after layer k was kept (UPTRAIN_TEST_PAUSE_AT=kept-k,
`uptrain.stopping.at_once.pause`) and stopped by SIGTERM after a delay (0 s: between layers; 0.25 s:
inside the next layer's refinement), once or twice, then rerun to the end with the same arguments.
`io/kept_layers.py` is the unit under test; `KeptLayers` and `conversion_key` are also tested alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import EXAMPLE_MHA8, REPO, TRAIN_TXT
from uptrain.convert.io.kept_layers import KeptLayers, conversion_key

BASE = ["--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT), "--calib-tokens", "4096", "--threads", "1"]
REFINE = ["--refine", "--refine-steps", "40"]
# the kinds of layer-at-a-time conversion: refinement on either inputs, and the fit with similar-head
# grouping without refinement (the head order each kept layer carries must come back)
KINDS = {"original": [*REFINE, "--refine-inputs", "original"], "converted": [*REFINE, "--refine-inputs", "converted"],
         "similar": ["--grouping", "similar"]}


def _convert(out: Path, extra: list[str], pause: str | None = None, delay: float = 0.0) -> subprocess.CompletedProcess:
    """The CLI into `out`; with `pause` ('kept-K'), stopped by SIGTERM `delay` s after it paused there."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if pause:
        env["UPTRAIN_TEST_PAUSE_AT"] = f"{pause}:0"  # announce and go on: the signal lands `delay` later
    cmd = [sys.executable, "-m", "uptrain.convert", str(EXAMPLE_MHA8), *BASE, *extra, "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    if pause:
        for line in proc.stderr:
            if line.strip() == f"paused at {pause}":
                time.sleep(delay)
                proc.send_signal(signal.SIGTERM)
                break
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _assert_same_output(got: Path, want: Path) -> None:
    a, b = _tensors(got), _tensors(want)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    assert json.loads((got / "config.json").read_text()) == json.loads((want / "config.json").read_text())
    records = [json.loads((f / "uptrain_conversion.json").read_text()) for f in (got, want)]
    assert records[0]["head_order"] == records[1]["head_order"]
    # the measured choices (errors and picks) of the kept layers come back into the record and its notes
    assert records[0]["grouping_choice"] == records[1]["grouping_choice"]
    resumed = [n for n in records[0]["notes"] if not n.startswith("continues an interrupted conversion")]
    assert resumed == records[1]["notes"]
    rows = [(r["refinement"] or {}).get("layers", []) for r in records]
    assert [(r["layer"], r["error_after"]) for r in rows[0]] == [(r["layer"], r["error_after"]) for r in rows[1]]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, Path]:
    """The uninterrupted conversion of each kind."""
    base = tmp_path_factory.mktemp("uninterrupted")
    outs = {}
    for kind, extra in KINDS.items():
        outs[kind] = base / kind
        done = _convert(outs[kind], extra)
        assert done.returncode == 0, done.stderr
    return outs


# (kind, the stops before the run that finishes: (pause, delay) each)
CASES = [("original", [("kept-0", 0.0)]),
         ("original", [("kept-2", 0.25)]),  # inside layer 3's refinement
         ("original", [("kept-3", 0.0)]),  # the last layer left
         ("original", [("kept-0", 0.25), ("kept-3", 0.25)]),  # stopped twice, then finished
         ("converted", [("kept-1", 0.25)]),  # the kept float32 attention advances the converted inputs
         ("similar", [("kept-2", 0.0)])]


@pytest.mark.parametrize(("kind", "stops"), CASES, ids=[f"{i}-" + "+".join(f"{p}@{d}" for p, d in s)
                                                          for i, s in CASES])
def test_a_rerun_continues_where_the_stop_left_and_equals_an_uninterrupted_conversion(kind, stops, uninterrupted,
                                                                                      tmp_path):
    out = tmp_path / "out"
    extra = KINDS[kind]
    kept_before = 0
    for pause, delay in stops:
        stopped = _convert(out, extra, pause, delay)
        assert stopped.returncode == 143, stopped.stderr
        folders = list(tmp_path.glob(".out.layers-*"))
        assert len(folders) == 1 and not out.exists()
        kept = KeptLayers(folders[0]).indices()
        assert kept == list(range(len(kept))) and len(kept) >= int(pause.split("-")[1]) + 1 > kept_before
        assert stopped.stderr.strip().splitlines()[-1].endswith(
            f"{len(kept)} finished layer{'s' * (len(kept) != 1)} kept in {folders[0]}: the same command continues "
            f"from there")
        kept_before = len(kept)
    finished = _convert(out, extra)
    assert finished.returncode == 0, finished.stderr
    span = "layer 0" if kept_before == 1 else f"layers 0-{kept_before - 1}"
    assert f"continues an interrupted conversion: {span} of 5" in " ".join(finished.stdout.split())
    assert len(re.findall(r"kept from the interrupted run", finished.stdout)) == kept_before
    made = re.findall(r"refine layer \d+: held-out error \S+ -> \S+ \(\d+ steps|layer \d+ converted", finished.stdout)
    assert len(made) == 5 - kept_before  # only the layers not kept were made
    assert list(tmp_path.iterdir()) == [out], "the kept layers were not removed once the output was in place"
    _assert_same_output(out, uninterrupted[kind])


def test_a_rerun_with_other_arguments_starts_again_and_leaves_the_other_layers(tmp_path):
    out = tmp_path / "out"
    assert _convert(out, REFINE, "kept-1").returncode == 143
    [theirs] = tmp_path.glob(".out.layers-*")
    other = _convert(out, [*REFINE, "--refine-steps", "30"])
    assert other.returncode == 0, other.stderr
    text = " ".join(other.stdout.split())
    assert f"{theirs} holds layers of an interrupted conversion with other arguments" in text
    assert "continues an interrupted conversion" not in text and "kept from the interrupted run" not in other.stdout
    assert sorted(tmp_path.iterdir()) == sorted([out, theirs]) and KeptLayers(theirs).indices()[:2] == [0, 1]


@pytest.mark.parametrize("change", [["--calib-tokens", "8192"], ["--calib-text-unit", "line"]],
                         ids=["calib-tokens", "calib-text-unit"])
def test_a_rerun_with_other_calibration_settings_does_not_take_the_kept_layers(change, tmp_path):
    """Through the command: a conversion calibrated on 4,096 tokens (paragraphs) stopped once layers 0-1
    were kept, then rerun with another --calib-tokens or --calib-text-unit, makes every layer again and
    names the other run's folder. Red when the key is built at its caller (`pipeline.keep_layers`)
    without the calibration settings: the layers made from 4,096 tokens were taken as made (the key
    function alone is tested in `test_every_calibration_and_refinement_setting_is_in_the_key`)."""
    out = tmp_path / "out"
    stopped = _convert(out, KINDS["similar"], "kept-1")
    assert stopped.returncode == 143, stopped.stderr
    [theirs] = tmp_path.glob(".out.layers-*")
    assert KeptLayers(theirs).indices()[:2] == [0, 1]
    other = _convert(out, [*KINDS["similar"], *change])  # (a later option wins over BASE's)
    assert other.returncode == 0, other.stderr
    text = " ".join(other.stdout.split())
    assert "continues an interrupted conversion" not in text and "kept from the interrupted run" not in other.stdout
    assert f"{theirs} holds layers of an interrupted conversion with other arguments" in text
    assert len(re.findall(r"layer \d+ converted", other.stdout)) == 5, other.stdout  # every layer made again
    record = json.loads((out / "uptrain_conversion.json").read_text())
    field = {"--calib-tokens": "tokens_requested", "--calib-text-unit": "text_unit"}[change[0]]
    assert str(record["calibration"][field]) == change[1], record["calibration"]
    assert sorted(tmp_path.iterdir()) == sorted([out, theirs]) and KeptLayers(theirs).indices()[:2] == [0, 1]


def test_kept_layers_are_whole_files_and_load_as_saved(tmp_path):
    kept = KeptLayers.beside(tmp_path / "out", "abc")
    assert kept.indices() == [] and kept.describe() == "" and not kept.folder.exists()
    tensors = {"q.weight": torch.randn(4, 3, dtype=torch.bfloat16), "norm:k_norm.weight": torch.ones(2),
               "student:o_proj.weight": torch.randn(3, 4)}
    kept.save(3, tensors, {"refine": {"error_after": 0.5}, "head_order": [1, 0]})
    (kept.folder / ".layer-00004.safetensors.tmp-123").write_bytes(b"half a layer")  # a write a stop cut short
    assert kept.indices() == [3] and kept.load(4) is None
    got, note = kept.load(3)
    assert got.keys() == tensors.keys() and all(torch.equal(got[k], v) and got[k].dtype == v.dtype
                                                for k, v in tensors.items())
    assert note == {"refine": {"error_after": 0.5}, "head_order": [1, 0]}
    assert kept.describe().startswith("1 finished layer kept in")
    kept.remove()
    assert not kept.folder.exists()


def test_a_kill_before_a_kept_layer_is_renamed_leaves_no_layer_under_its_name(uninterrupted, tmp_path):
    """SIGKILL (no handler runs) once layer 1 is written and synced under its temporary name, before
    the rename: only layer 0 is kept, and the rerun makes layer 1 again and equals an uninterrupted
    conversion. Red when a kept layer is written under its final name (it is then found as kept
    before it was whole)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "UPTRAIN_TEST_PAUSE_AT": "keeping-written-1:30"}
    cmd = [sys.executable, "-m", "uptrain.convert", str(EXAMPLE_MHA8), *BASE, *KINDS["similar"], "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    for line in proc.stderr:
        if line.strip() == "paused at keeping-written-1":
            proc.kill()
            break
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    (folder,) = tmp_path.glob(".out.layers-*")
    assert KeptLayers(folder).indices() == [0], sorted(p.name for p in folder.iterdir())
    finished = _convert(out, KINDS["similar"])
    assert finished.returncode == 0, finished.stderr
    assert "continues an interrupted conversion: layer 0 of 5" in " ".join(finished.stdout.split())
    _assert_same_output(out, uninterrupted["similar"])


def _source(tmp_path):
    """(folder, weights file) of a minimal source for `conversion_key`: a config and 10 bytes of weights."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}')
    weights = source / "model.safetensors"
    weights.write_bytes(b"x" * 10)
    return source, weights


def test_the_key_changes_with_every_input_of_the_layers(tmp_path):
    source, weights = _source(tmp_path)
    calib = tmp_path / "calib.txt"
    calib.write_text("text")
    settings = {"kv_heads": 2, "method": "fit", "refine": [400, 0.06, "original", 0]}
    key = conversion_key(source, [weights, weights], settings, calib)
    assert key == conversion_key(source, [weights], dict(settings), calib)  # the same inputs, the same key
    changed = [conversion_key(source, [weights], {**settings, "kv_heads": 1}, calib),
               conversion_key(source, [weights], {**settings, "refine": [401, 0.06, "original", 0]}, calib),
               conversion_key(source, [weights], settings, None)]
    (source / "config.json").write_text('{"model_type": "llama", "x": 1}')
    changed.append(conversion_key(source, [weights], settings, calib))
    weights.write_bytes(b"y" * 11)
    changed.append(conversion_key(source, [weights], settings, calib))
    calib.write_text("other text")
    changed.append(conversion_key(source, [weights], settings, calib))
    (source / "tokenizer.json").write_text("{}")  # every file of the source: the calibration reads the tokenizer
    changed.append(conversion_key(source, [weights], settings, calib))
    (source / "tokenizer.json").write_text('{"model": 1}')
    changed.append(conversion_key(source, [weights], settings, calib))
    assert len({key, *changed}) == 1 + len(changed)


def test_a_same_size_edit_of_the_tokenizer_changes_the_key(tmp_path):
    """The calibration reads the source's tokenizer: an edit of tokenizer.json that keeps its size (one
    token's text changed for another of the same length) and its modification time (a copy that keeps
    dates) gives another key: the source's files other than the weights are keyed by content. Red when
    they are keyed by size and time, or not at all (`test_the_key_changes_with_every_input_of_the_layers`
    edits change the size)."""
    source, weights = _source(tmp_path)
    tokenizer = source / "tokenizer.json"
    tokenizer.write_text('{"model": {"vocab": {"cat": 5, "dog": 6}}}')
    before = tokenizer.stat()
    key = conversion_key(source, [weights], {"kv_heads": 2}, None)
    tokenizer.write_text('{"model": {"vocab": {"cat": 5, "cow": 6}}}')
    os.utime(tokenizer, ns=(before.st_atime_ns, before.st_mtime_ns))  # the date kept
    assert tokenizer.stat().st_size == before.st_size
    assert conversion_key(source, [weights], {"kv_heads": 2}, None) != key


def test_the_key_changes_with_the_code(tmp_path):
    """Before: the key held `__version__` (0.1.0 for every checkout): layers kept by other code were
    taken as made. A copy of the package, one line of its fit changed, gives another key."""
    source = tmp_path / "src"
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}')
    (source / "model.safetensors").write_bytes(b"x" * 10)
    shutil.copytree(REPO / "uptrain", tmp_path / "pkg" / "uptrain", ignore=shutil.ignore_patterns("__pycache__"))
    script = ("import sys; from pathlib import Path; from uptrain.convert.io.kept_layers import conversion_key; "
              f"print(conversion_key(Path({str(source)!r}), [Path({str(source / 'model.safetensors')!r})], {{}}, None))")

    def key() -> str:
        env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkg")}
        return subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True,
                              check=True).stdout.strip()

    same = key()
    assert same == conversion_key(source, [source / "model.safetensors"], {}, None)  # the same code, the same key
    with open(tmp_path / "pkg" / "uptrain" / "convert" / "math" / "fit.py", "a") as f:
        f.write("\n# another fit\n")
    assert key() != same


def test_every_calibration_and_refinement_setting_is_in_the_key():
    """Each field of Calibration and RefineSettings, changed alone, changes the settings the key
    hashes, except those named as not changing a layer (a new field counts until it is named)."""
    import copy
    import dataclasses

    from uptrain.convert.layers.calibrate import Calibration
    from uptrain.convert.layers.refine_layer import RefineSettings
    from uptrain.convert.pipeline import NOT_LAYER_SETTINGS, layer_settings

    calib, refine = Calibration(path=TRAIN_TXT, tokens=1024), RefineSettings()
    base = layer_settings(2, "fit", "similar", 0, None, None, calib, refine)
    other = {int: lambda v: v + 1, float: lambda v: v * 2, str: lambda v: v + "x", type(None): lambda v: 123}
    checked = []
    for obj, name in [(calib, "calibration"), (refine, "refine")]:
        for f in dataclasses.fields(obj):
            if not f.compare or f.name.startswith("_") or f.name in NOT_LAYER_SETTINGS and name == "calibration":
                continue
            value = getattr(obj, f.name)
            changed = copy.copy(obj)  # (not replace(): the new values need not be valid, only other)
            setattr(changed, f.name, other[type(value)](value))
            pair = (changed, refine) if name == "calibration" else (calib, changed)
            assert layer_settings(2, "fit", "similar", 0, None, None, *pair) != base, f.name
            checked.append(f.name)
    assert {"tokens", "device", "text_unit", "steps", "lr", "inputs", "seed"} <= set(checked)
    for change in [(1, "fit", "similar", 0, None, None), (2, "mean", "similar", 0, None, None),
                   (2, "fit", "contiguous", 0, None, None), (2, "fit", "similar", 1, None, None),
                   (2, "fit", "similar", 0, "v2", None), (2, "fit", "similar", 0, None, torch.bfloat16)]:
        assert layer_settings(*change, calib, refine) != base, change


def test_a_damaged_kept_layer_is_made_again(uninterrupted, tmp_path):
    """Before: a kept layer that could not be read made every rerun fail with an internal error."""
    out = tmp_path / "out"
    stopped = _convert(out, KINDS["original"], "kept-1")
    assert stopped.returncode == 143, stopped.stderr
    folder = next(tmp_path.glob(".out.layers-*"))
    damaged = folder / "layer-00001.safetensors"
    damaged.write_bytes(damaged.read_bytes()[:1000])  # cut short, as a disk or a hand might leave it
    finished = _convert(out, KINDS["original"])
    assert finished.returncode == 0, finished.stderr
    assert len(re.findall(r"kept from the interrupted run", finished.stdout)) == 1, finished.stdout  # layer 0 only
    _assert_same_output(out, uninterrupted["original"])


@pytest.fixture
def small_disk(tmp_path):
    """A real file system of 4 MiB (tmpfs, as root) that the test can fill."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "none", str(folder)], capture_output=True).returncode:
        pytest.skip("no small file system can be mounted here (needs root): a full disk cannot be made")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def test_a_full_disk_while_a_layer_is_kept_says_so_and_the_rerun_continues(small_disk):
    """Before: "internal error: SafetensorError ... please report it", exit 1, naming no folder."""
    out = small_disk / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "UPTRAIN_TEST_PAUSE_AT": "keeping-1:5"}
    cmd = [sys.executable, "-m", "uptrain.convert", str(EXAMPLE_MHA8), *BASE, *KINDS["original"], "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    for line in proc.stderr:
        if line.strip() == "paused at keeping-1":  # layer 1 made, about to be kept: fill the disk now
            with open(small_disk / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
            break
    stdout, stderr = proc.communicate(timeout=120)
    folder = next(small_disk.glob(".out.layers-*"))
    assert proc.returncode == 2, stderr
    assert stderr.count("\n") == 1 and "No space left on device" in stderr and str(folder) in stderr, stderr
    assert KeptLayers(folder).indices() == [0] and not [p for p in folder.iterdir() if ".tmp-" in p.name]
    assert not out.exists() and not list(small_disk.glob(".out.partial-*"))
    (small_disk / "filler").unlink()
    finished = _convert(out, KINDS["original"])
    assert finished.returncode == 0, finished.stderr
    assert "continues an interrupted conversion: layer 0 of 5" in " ".join(finished.stdout.split())


def test_a_conversion_refused_after_layers_were_kept_names_them(tmp_path):
    """Before: an --out that appeared while the layers were made was refused in one line that did not
    say the finished layers were kept (a hidden folder of up to a whole model's attention weights)."""
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "UPTRAIN_TEST_PAUSE_AT": "kept-1:2"}
    cmd = [sys.executable, "-m", "uptrain.convert", str(EXAMPLE_MHA8), *BASE, *KINDS["similar"], "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    for line in proc.stderr:
        if line.strip() == "paused at kept-1":  # another run's output lands in --out meanwhile
            out.mkdir()
            (out / "theirs.txt").write_text("another run's output\n")
            break
    stdout, stderr = proc.communicate(timeout=120)
    folder = next(tmp_path.glob(".out.layers-*"))
    assert proc.returncode == 2 and stderr.count("\n") == 1, stderr
    assert "appeared while this run wrote it" in stderr and f"kept in {folder}" in stderr, stderr
    assert (out / "theirs.txt").read_text() == "another run's output\n"
    finished = _convert(out, [*KINDS["similar"], "--force"])  # the mended rerun takes the kept layers
    assert finished.returncode == 0, finished.stderr
    assert "continues an interrupted conversion" in " ".join(finished.stdout.split()), finished.stdout
