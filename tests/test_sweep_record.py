"""A sweep keeps only what is provably the same (`uptrain.sweep.record`): content fingerprints,
not paths; only folders it wrote; the KV figures of this run's --batch."""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import EXAMPLE_MHA8, VALID_TXT, perturbed_copy
from uptrain.sweep.run import main
from uptrain.sweep.record import MARK, folder_fingerprint

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ARGS = ["--data", str(VALID_TXT), "--stories", "2", "--threads", "1", "--kv-heads", "4"]


def _points(out) -> dict[str, dict]:
    return {p["label"]: p for p in json.loads((out / "sweep.json").read_text())["points"]}


def test_a_rerun_with_another_checkpoint_at_the_same_path_redoes_every_number(tmp_path, capsys):
    """The record holds the checkpoint's content fingerprint: the same path with other weights is
    another checkpoint (converted and scored again, the line says so); the same weights at another
    path are the same checkpoint (kept)."""
    model, out = tmp_path / "model", tmp_path / "sweep"
    shutil.copytree(EXAMPLE_MHA8, model)
    assert main([str(model), *ARGS, "--out", str(out)]) == 0
    first = _points(out)
    shutil.rmtree(model)
    perturbed_copy(EXAMPLE_MHA8, model, seed=3, scale=1.0)
    capsys.readouterr()
    assert main([str(model), *ARGS, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "kept from the earlier run" not in printed
    assert "source: done again, the earlier run's differs: checkpoint " in printed
    assert "mean kv4: done again, the earlier run's differs: checkpoint " in printed
    again = _points(out)
    assert again["source"]["loss"] != first["source"]["loss"] and again["mean kv4"]["loss"] != first["mean kv4"]["loss"]
    moved = tmp_path / "moved"
    shutil.copytree(model, moved)
    assert main([str(moved), *ARGS, "--out", str(out)]) == 0
    assert "mean kv4: kept from the earlier run" in capsys.readouterr().out
    assert _points(out)["mean kv4"]["loss"] == again["mean kv4"]["loss"]


def test_a_held_out_text_edited_in_place_is_scored_again(tmp_path, capsys):
    """The record holds the held-out text's content fingerprint: the same file edited in place (its
    first story dropped) is scored again (the conversion, which does not read it, is kept), the line
    says why; unedited, the numbers are kept. Red with the text's fingerprint left out of the record."""
    data, out = tmp_path / "held-out.txt", tmp_path / "sweep"
    shutil.copyfile(VALID_TXT, data)
    args = [a if a != str(VALID_TXT) else str(data) for a in ARGS]
    assert main([str(EXAMPLE_MHA8), *args, "--out", str(out)]) == 0
    first = _points(out)
    assert main([str(EXAMPLE_MHA8), *args, "--out", str(out)]) == 0
    assert "mean kv4: kept from the earlier run" in capsys.readouterr().out
    data.write_text(data.read_text().split("\n\n", 1)[1])
    assert main([str(EXAMPLE_MHA8), *args, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "source: done again, the earlier run's differs: data_sha256 " in printed, printed
    assert "mean kv4: kept from the earlier run" in printed and "; scored again: data_sha256 " in printed, printed
    assert _points(out)["mean kv4"]["loss"] != first["mean kv4"]["loss"]


def test_the_fingerprint_is_the_content_and_a_changed_file_is_read_again(tmp_path):
    digests: dict = {}
    copy = shutil.copytree(EXAMPLE_MHA8, tmp_path / "copy")
    assert folder_fingerprint(EXAMPLE_MHA8, digests) == folder_fingerprint(copy, {})
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of one weight, same size
    weights.write_bytes(bytes(data))
    assert folder_fingerprint(copy, digests) != folder_fingerprint(EXAMPLE_MHA8, digests)


def test_a_folder_the_sweep_did_not_write_is_refused_and_kept(tmp_path, capsys):
    out = tmp_path / "sweep"
    (out / "kv4").mkdir(parents=True)
    (out / "kv4" / "IMPORTANT.txt").write_text("mine")
    assert main([str(EXAMPLE_MHA8), *ARGS, "--out", str(out)]) == 2  # a folder no sweep made: refused whole
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not a sweep's folder" in err, err
    assert [p.name for p in (out / "kv4").iterdir()] == ["IMPORTANT.txt"] and not (out / "sweep.json").exists()
    # a folder of the sweep's own (its mark) is replaced when its record no longer matches
    shutil.rmtree(out / "kv4")
    assert main([str(EXAMPLE_MHA8), *ARGS, "--out", str(out)]) == 0
    assert (out / "kv4" / MARK).is_file()
    (out / "kv4" / MARK).write_text("another sweep\n")  # in the sweep's own folder, a count's folder it did not write
    assert main([str(EXAMPLE_MHA8), *ARGS, "--out", str(out)]) == 2
    assert "kv4 exists and was not written by this sweep" in capsys.readouterr().err
    assert (out / "kv4" / MARK).read_text() == "another sweep\n"


def test_a_record_of_another_kind_is_refused(tmp_path, capsys):
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text(json.dumps({"points": []}))
    assert main([str(EXAMPLE_MHA8), *ARGS, "--out", str(out)]) == 2
    assert "is not a record this version of uptrain.sweep wrote" in capsys.readouterr().err


def test_a_rerun_with_another_batch_shows_the_kv_of_that_batch_for_every_row(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert main([str(EXAMPLE_MHA8), *ARGS, "--out", str(out)]) == 0
    capsys.readouterr()
    assert main([str(EXAMPLE_MHA8), *ARGS, "--batch", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "mean kv4: kept from the earlier run" in printed
    points = _points(out)
    for p in points.values():  # float32: 2 x 5 layers x kv x 8 head dims x 4 bytes per token, x 512 x 8
        assert p["kv_bytes_at_context"] == 2 * 5 * p["kv_heads"] * 8 * 4 * 512 * 8 and p["settings"]["batch"] == 8
    assert "KV at 512 tokens x 8" in printed and "10.0 MiB" in printed and "5.0 MiB" in printed


def test_the_record_holds_the_code_not_only_the_version(tmp_path):
    """A sweep's numbers depend on the code that made them: the record's "uptrain" is the package's
    code fingerprint (which tests/convert/test_convert_resume.py shows changes with one line)."""
    import uptrain
    from uptrain.sweep.record import SweepFolder

    prints = SweepFolder(tmp_path / "sweep").fingerprints(EXAMPLE_MHA8, VALID_TXT, None)
    assert prints["uptrain"] == uptrain.code_fingerprint() != uptrain.__version__
