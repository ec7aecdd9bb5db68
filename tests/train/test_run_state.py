"""Training state on disk: checkpoints of tied models are written without noise."""

from __future__ import annotations

from train_helpers import DEMO, fresh_accelerate_state, need_models, tiny_overrides  # noqa: F401 (autouse)
from uptrain.train.__main__ import main
from uptrain.train.run_state import complete_checkpoints


def test_checkpoints_of_a_tied_model_are_saved_without_the_shared_tensor_warning(tmp_path, capfd, caplog):
    need_models()  # stories260K ties lm_head to the embeddings
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, steps=2, **{"optim.warmup_steps": 1, "checkpoint.every": 1, "threads": 1})
    assert main([str(DEMO), *args]) == 0
    assert [p.name for p in complete_checkpoints(run_dir)] == ["checkpoint-00000001", "checkpoint-00000002"]
    captured = capfd.readouterr()
    logged = " ".join(r.getMessage() for r in caplog.records)  # pytest takes log records from stderr
    assert "Removed shared tensor" not in captured.err + captured.out + logged
