"""Bad input: a one-line error naming the problem and what would work, exit code 2, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from tiny import save
from uptrain.convert.__main__ import main


def fails(argv: list, capsys, *needles: str) -> str:
    """Run the CLI, expect exit 2 and one stderr line holding every needle."""
    capsys.readouterr()  # drop what setup printed
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)
    return err


def nothing_written(tmp_path: Path, *keep: str) -> None:
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep)


@pytest.mark.parametrize("kv,needles", [
    (0, ["must be positive", "valid --kv-heads: 1, 2, 4, 8"]),
    (-2, ["must be positive"]),
    (16, ["has 8 K/V heads", "cannot make 16", "1, 2, 4, 8"]),
    (3, ["3 does not divide the 8 K/V heads", "valid --kv-heads: 1, 2, 4, 8"]),
])
def test_bad_kv_heads(mha8, tmp_path, capsys, kv, needles):
    fails([mha8, "--kv-heads", kv, "--out", tmp_path / "out"], capsys, *needles)
    nothing_written(tmp_path)


def test_more_kv_heads_than_the_checkpoint_has(gqa4, tmp_path, capsys):
    fails([gqa4, "--kv-heads", 8, "--out", tmp_path / "out"], capsys, "has 4 K/V heads", "valid --kv-heads: 1, 2, 4")
    nothing_written(tmp_path)


def test_model_type_that_cannot_express_gqa(tmp_path, capsys):
    src = save(GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64)), tmp_path / "gpt2")
    fails([src, "--kv-heads", 1, "--out", tmp_path / "out"], capsys, "'gpt2' cannot be converted",
          "no setting for fewer K/V heads")
    nothing_written(tmp_path, "gpt2")


def test_unknown_model_type_lists_the_supported_ones(mha8, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(mha8, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"model_type": "falcon_mamba"}))
    fails([src, "--kv-heads", 4, "--out", tmp_path / "out"], capsys, "'falcon_mamba' is not supported",
          "llama", "qwen2")


def test_missing_config_and_missing_weights(mha8, tmp_path, capsys):
    no_cfg = tmp_path / "no_cfg"
    shutil.copytree(mha8, no_cfg)
    (no_cfg / "config.json").unlink()
    fails([no_cfg, "--kv-heads", 4, "--out", tmp_path / "o1"], capsys, "has no config.json")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(mha8, no_weights)
    (no_weights / "model.safetensors").unlink()
    fails([no_weights, "--kv-heads", 4, "--out", tmp_path / "o2"], capsys, "has no weights")
    fails([tmp_path / "nowhere", "--kv-heads", 4, "--out", tmp_path / "o3"], capsys, "does not exist")
    nothing_written(tmp_path, "no_cfg", "no_weights")


def test_weights_that_contradict_the_config(mha8, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(mha8, src)
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps(cfg | {"num_key_value_heads": 4}))
    fails([src, "--kv-heads", 2, "--out", tmp_path / "out"], capsys, "weights contradict config.json",
          "k_proj.weight has shape [64, 64]", "implies 32 rows")
    nothing_written(tmp_path, "src")


def test_output_inside_the_source_or_existing(mha8, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(mha8, src)
    fails([src, "--kv-heads", 4, "--out", src / "gqa"], capsys, "inside the source checkpoint")
    fails([src, "--kv-heads", 4, "--out", src], capsys, "inside the source checkpoint")
    fails([src, "--kv-heads", 4, "--out", tmp_path], capsys, "is inside output")
    (tmp_path / "taken").mkdir()
    fails([src, "--kv-heads", 4, "--out", tmp_path / "taken"], capsys, "already exists", "--force")
    assert sorted(p.name for p in src.iterdir()) == sorted(p.name for p in mha8.iterdir())
    nothing_written(tmp_path, "src", "taken")


def test_missing_out_and_bad_shard_size(mha8, tmp_path, capsys):
    fails([mha8, "--kv-heads", 4], capsys, "--out is required")
    fails([mha8, "--kv-heads", 4, "--out", tmp_path / "o", "--max-shard-size", "lots"], capsys, "cannot read size")
    nothing_written(tmp_path)


def test_exit_code_and_single_line_from_a_real_process(mha8, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "uptrain.convert", str(mha8), "--kv-heads", "3", "--out",
                           str(tmp_path / "out")], capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: ")


def test_an_unconvertible_type_is_named_before_missing_weights(tmp_path, capsys):
    """A folder with only a gpt2 config.json: the model type is the problem, not the download."""
    src = tmp_path / "gpt2"
    src.mkdir()
    GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64).to_json_file(src / "config.json")
    err = fails([src, "--kv-heads", 1, "--out", tmp_path / "out"], capsys, "'gpt2' cannot be converted")
    assert "download" not in err and "has no weights" not in err


def test_refusals_found_after_planning_print_no_plan(mha8, tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert main([str(mha8), "--kv-heads", "2", "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1, captured
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


BOOM = "from uptrain.convert.layers import layerwise\n" \
       "def boom(similarity, groups):\n" \
       "    raise ValueError('3 is not in list\\nsecond line')\n" \
       "layerwise.group_permutation = boom\n"


@pytest.fixture
def grouping_fault(monkeypatch):
    """The real process's fault (BOOM), in this process: the head grouping raises mid-conversion."""
    from uptrain.convert.layers import layerwise
    namespace: dict = {}
    exec(BOOM.replace("layerwise.group_permutation = boom", ""), namespace)
    monkeypatch.setattr(layerwise, "group_permutation", namespace["boom"])


def test_an_internal_error_is_one_line_exit_1_and_the_output_is_untouched(mha8, tmp_path, capsys, grouping_fault):
    """A fault inside our own code (the head grouping raising, as the old swap pass did) mid-conversion
    with --force over an existing output: one line that says it is ours, exit 1, the old output kept."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    capsys.readouterr()
    argv = [str(mha8), "--kv-heads", "2", "--grouping", "similar", "--out", str(tmp_path / "out"), "--force"]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "internal error: ValueError: 3 is not in list" in err and "please report" in err
    assert "UPTRAIN_DEBUG=1" in err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"
    nothing_written(tmp_path, "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["keep.txt"]


def test_an_internal_error_in_a_real_process_and_its_traceback_on_request(mha8, tmp_path, capsys, monkeypatch,
                                                                        grouping_fault):
    script = BOOM + "import sys\nfrom uptrain.convert.__main__ import main\nsys.exit(main(sys.argv[1:]))\n"
    args = [str(mha8), "--kv-heads", "2", "--grouping", "similar", "--out", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.count("\n") == 1 and "internal error: ValueError" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    nothing_written(tmp_path)
    # The traceback on request (UPTRAIN_DEBUG is read when the error is caught): in this process, the
    # same fault (grouping_fault patches only this process, not the one above); that a real process exits
    # with main's code is the run above's claim.
    monkeypatch.setenv("UPTRAIN_DEBUG", "1")
    capsys.readouterr()
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "in boom" in err, err
    assert err.strip().splitlines()[-1].startswith("uptrain.convert: internal error: ValueError")
    nothing_written(tmp_path)
