"""Several K/V counts at once (`uptrain.convert.several`): each folder is what `convert` writes for
its count, from one calibration pass and one read of each source tensor for all counts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import EXAMPLE_MHA8, TRAIN_TXT
from uptrain.convert import convert
from uptrain.convert.io.source import SourceCheckpoint
from uptrain.convert.layers.calibrate import Calibration
from uptrain.convert.layers.refine_layer import RefineSettings
from uptrain.convert.several import convert_counts
from uptrain.errors import UsageError

COUNTS = (4, 2, 1)


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.fixture
def counted_reads(monkeypatch):
    """Every tensor read from a source checkpoint, by name (the real read, counted)."""
    reads: dict[str, int] = {}
    real = SourceCheckpoint.read

    def read(self, info):
        reads[info.name] = reads.get(info.name, 0) + 1
        return real(self, info)
    monkeypatch.setattr(SourceCheckpoint, "read", read)
    return reads


@pytest.mark.parametrize("inputs", ["original", "converted"])
def test_each_folder_equals_its_own_conversion_from_one_read_and_one_calibration(inputs, tmp_path, counted_reads,
                                                                                 one_torch_thread):
    refine = RefineSettings(steps=8, inputs=inputs)
    single: dict[int, dict[str, int]] = {}
    for n in COUNTS:
        counted_reads.clear()
        calibration = Calibration(TRAIN_TXT, 1200)
        convert(str(EXAMPLE_MHA8), tmp_path / f"alone{n}", n, "fit", calibration=calibration, refine=refine)
        assert calibration.record["passes"] == 1
        single[n] = dict(counted_reads)
    counted_reads.clear()
    calibration = Calibration(TRAIN_TXT, 1200)
    plans = convert_counts(str(EXAMPLE_MHA8), {n: tmp_path / f"kv{n}" for n in COUNTS}, "fit",
                           calibration=calibration, refine=refine)
    assert calibration.record["passes"] == 1 and calibration.record["layers_run"] == 5
    # the whole sweep reads each tensor as often as ONE conversion does (the built tensors once,
    # each original layer once for the stream), not once per count
    assert counted_reads == single[COUNTS[0]] and max(counted_reads.values()) <= 2, counted_reads
    for n in COUNTS:
        mine, theirs = tensors(tmp_path / f"kv{n}"), tensors(tmp_path / f"alone{n}")
        assert mine.keys() == theirs.keys()
        for key in mine:
            torch.testing.assert_close(mine[key], theirs[key], rtol=1e-6, atol=1e-7, msg=f"kv{n} {key}")
        assert [x["layer"] for x in plans[n].refinement["layers"]] == list(range(5))
        assert any("converted together with K/V counts 4, 2, 1" in note for note in plans[n].notes)


def test_one_count_failing_stops_all_and_leaves_no_folder(tmp_path, one_torch_thread):
    """A count that cannot be written (its folder exists) stops the others before they wait on the
    stream forever; no folder is half written, the error is the one-line usage error."""
    (tmp_path / "kv2").mkdir()
    (tmp_path / "kv2" / "mine.txt").write_text("a user's file")
    with pytest.raises(UsageError, match="kv2"):
        convert_counts(str(EXAMPLE_MHA8), {n: tmp_path / f"kv{n}" for n in COUNTS}, "fit",
                       calibration=Calibration(TRAIN_TXT, 600), refine=RefineSettings(steps=2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv2"]
    assert [p.name for p in (tmp_path / "kv2").iterdir()] == ["mine.txt"]


@pytest.mark.parametrize("blocker", ["file", "folder"])
def test_an_output_blocked_after_planning_leaves_no_count_written(tmp_path, blocker, one_torch_thread):
    """All or none: the kv2 path taken (by a file, or by a folder without force) after every count was
    planned and checked: the conversion fails with one line and no count's folder appears."""
    outs = {n: tmp_path / f"kv{n}" for n in COUNTS}

    def block(plans):
        if blocker == "file":
            outs[2].write_text("a user's file")
        else:
            outs[2].mkdir()

    with pytest.raises(UsageError, match="kv2 .*appeared during the conversion|kv2 is a file"):
        convert_counts(str(EXAMPLE_MHA8), outs, "mean", on_planned=block)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kv2"]  # the blocker only: no folder, no leftover


KILLER = """
import sys
from pathlib import Path
from uptrain.convert.layers.calibrate import Calibration
from uptrain.convert.layers.refine_layer import RefineSettings
from uptrain.convert.several import convert_counts
out = Path(sys.argv[1])
convert_counts(sys.argv[2], {n: out / f"kv{n}" for n in (4, 2, 1)}, "fit", calibration=Calibration(sys.argv[3], 600),
               refine=RefineSettings(steps=30))
"""


def test_a_kill_at_any_moment_leaves_all_counts_or_none(tmp_path):
    """SIGKILL at moments across the conversion (from the first hidden folder on): every count's
    folder is there, whole, or none is (the hidden partial folders are not outputs)."""
    import random
    import subprocess
    import sys
    import time

    from conftest import REPO

    moments = [0.0, *sorted(random.Random(7).uniform(0.05, 2.5) for _ in range(3))]
    for i, delay in enumerate(moments):
        out = tmp_path / f"run{i}"
        out.mkdir()
        proc = subprocess.Popen([sys.executable, "-c", KILLER, str(out), str(EXAMPLE_MHA8), str(TRAIN_TXT)], cwd=REPO)
        while proc.poll() is None and not any(out.iterdir()):
            time.sleep(0.01)
        time.sleep(delay)
        proc.kill()
        proc.wait(timeout=60)
        present = sorted(p.name for p in out.iterdir() if not p.name.startswith("."))
        assert present in ([], ["kv1", "kv2", "kv4"]), (delay, present)
        for name in present:
            assert (out / name / "uptrain_conversion.json").is_file(), (delay, name)


def test_each_count_reports_its_layers_to_progress(tmp_path, one_torch_thread):
    """`progress` hears (count, line) for each layer of each count (prepare's per-layer line, the
    layers done and time left): 5 layers of stories260K for every count, the refinement's line in them."""
    lines: list[tuple[int, str]] = []
    convert_counts(str(EXAMPLE_MHA8), {n: tmp_path / f"kv{n}" for n in COUNTS}, "fit",
                   calibration=Calibration(TRAIN_TXT, 600), refine=RefineSettings(steps=2),
                   progress=lambda count, line: lines.append((count, line)))
    assert sorted({n for n, _ in lines}) == sorted(COUNTS)
    for n in COUNTS:
        mine = [line for count, line in lines if count == n]
        assert [f"[{k}/5 layers" in line for k, line in enumerate(mine, 1)] == [True] * 5, mine
        assert all("refine layer" in line for line in mine), mine
