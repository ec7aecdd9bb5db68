"""Training state on disk: checkpoints of tied models are written without noise; a resume names a
checkpoint of its own run folder, however either is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from train_helpers import DEMO, fresh_accelerate_state, need_models, tiny_overrides  # noqa: F401 (autouse)
from uptrain.train.__main__ import main
from uptrain.errors import UsageError
from uptrain.train.plan.folders import check_run_dir
from uptrain.train.state.run_state import STATE_FILE, complete_checkpoints


def test_checkpoints_of_a_tied_model_are_saved_without_the_shared_tensor_warning(tmp_path, capfd, caplog):
    need_models()  # stories260K ties lm_head to the embeddings
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, steps=2, **{"optim.warmup_steps": 1, "checkpoint.every": 1, "threads": 1})
    assert main([str(DEMO), *args]) == 0
    assert [p.name for p in complete_checkpoints(run_dir)] == ["checkpoint-00000001", "checkpoint-00000002"]
    captured = capfd.readouterr()
    logged = " ".join(r.getMessage() for r in caplog.records)  # pytest takes log records from stderr
    assert "Removed shared tensor" not in captured.err + captured.out + logged


def _checkpoint(run_dir: Path, step: int) -> Path:
    """A complete checkpoint folder as the owner check sees it (its completion mark)."""
    folder = run_dir / "checkpoints" / f"checkpoint-{step:08d}"
    folder.mkdir(parents=True)
    (folder / STATE_FILE).write_text(json.dumps({"step": step}))
    return folder


def test_a_checkpoint_of_this_run_is_accepted_however_its_folder_and_run_dir_are_written(tmp_path, monkeypatch):
    # The same two folders written every way a user may write them (relative to the working
    # directory, absolute, with ./ and .., through a symlink): a checkpoint of run_dir is always its
    # own, one of another run never is.
    monkeypatch.chdir(tmp_path)
    run_dir, other = tmp_path / "runs" / "x", tmp_path / "runs" / "y"
    mine, theirs = _checkpoint(run_dir, 2), _checkpoint(other, 2)
    (tmp_path / "link").symlink_to(tmp_path / "runs")
    run_dirs = [run_dir, Path("runs/x"), Path("./runs/x"), tmp_path / "runs" / "y" / ".." / "x", tmp_path / "link" / "x",
                Path("link/x")]
    forms = ["runs/x/checkpoints/checkpoint-00000002", str(mine), "./runs/x/checkpoints/checkpoint-00000002",
             "runs/y/../x/checkpoints/checkpoint-00000002", "link/x/checkpoints/checkpoint-00000002",
             str(tmp_path / "link" / "x" / "checkpoints" / "checkpoint-00000002")]
    for folder in run_dirs:
        for resume in forms:
            assert check_run_dir(folder, {}, resume, False) == Path(resume), (folder, resume)
        for resume in ("runs/y/checkpoints/checkpoint-00000002", str(theirs), "link/y/checkpoints/checkpoint-00000002"):
            with pytest.raises(UsageError, match="belongs to the run in"):
                check_run_dir(folder, {}, resume, False)
