"""A resume belongs to its run: every identity field changed is refused in one line (exit 2), from
run.yaml and from the checkpoint's own record; a checkpoint of another run folder is refused; what
an elastic resume may change (grad_accum) is not part of the identity."""

from __future__ import annotations

import copy
import shutil

import pytest
import yaml

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, TRAIN_TXT, need_models, tiny_overrides
from uptrain.errors import UsageError
from uptrain.train.__main__ import main
from uptrain.train.config import field_defaults, load_config, to_dict
from uptrain.train.plan.folders import SECTIONS, config_identity, identity_changes, run_identity
from uptrain.train.plan.folders import check_checkpoint_identity, check_run_dir
from uptrain.train.state.run_state import checkpoint_state, complete_checkpoints

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# One change per identity section: each alone must make a resume refuse (a section missing from
# SECTIONS, or a comparison that ignores it, turns its case green -> this test red).
MUTATIONS = {
    "model": ["model=other/model"],
    "tokenizer": ["tokenizer=other/tokenizer"],
    "seed": ["seed=5"],
    "data": ["data.seq_len=32"],
    "budget": ["budget.tokens=8192"],
    "batch": ["batch.micro_batch=2"],
    "optim": ["optim.lr=5e-3"],
    "distill": ["distill.temperature=3.0"],
    "trainable": ["trainable=kv"],
    "trainable_stages": ["trainable_stages=[{trainable: kv, tokens: 512}]"],
    "shard": ["shard=fsdp2"],
    "mixed_precision": ["mixed_precision=bf16"],
}


def _config_dict(run_dir, extra=()) -> dict:
    return to_dict(load_config(DEMO, tiny_overrides(run_dir, steps=8) + list(extra)))


def test_the_mutations_cover_every_identity_section():
    assert set(MUTATIONS) == set(SECTIONS)


@pytest.mark.parametrize("section", list(MUTATIONS))
def test_each_identity_section_changed_on_resume_is_refused_naming_it(tmp_path, section):
    need_models()
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "run.yaml").write_text(yaml.safe_dump(_config_dict(run_dir)))
    changed = _config_dict(run_dir, MUTATIONS[section])
    with pytest.raises(UsageError, match=rf"holds another run's state \(differs in: {section}"):
        check_run_dir(run_dir, changed, "latest", False)
    # The checkpoint's own record says the same, without run.yaml.
    recorded, now = run_identity(_config_dict(run_dir), "no", "abc"), run_identity(changed, "no", "abc")
    if section == "mixed_precision":  # recorded as the effective precision, which the launcher may set
        now = run_identity(changed, "bf16", "abc")
    assert identity_changes(recorded, now) and identity_changes(recorded, now)[0].split(".")[0] == section


def test_grad_accum_is_not_identity_and_the_data_fingerprint_is(tmp_path):
    need_models()
    base = _config_dict(tmp_path)
    assert config_identity(base) == config_identity(_config_dict(tmp_path, ["batch.grad_accum=4"]))
    assert identity_changes(run_identity(base, "no", "abc"), run_identity(base, "no", "abd")) == ["data_fingerprint"]


def _field_paths(section: dict, prefix: str) -> list[tuple[str, ...]]:
    """Every field inside a section (nested dicts too), as key paths."""
    paths = []
    for name, value in section.items():
        paths.append((prefix, name))
        if isinstance(value, dict):
            paths += [(prefix, name, *rest[1:]) for rest in _field_paths(value, prefix)]
    return paths


def _drop(identity: dict, path: tuple[str, ...]) -> dict:
    out = copy.deepcopy(identity)
    inner = out
    for key in path[:-1]:
        inner = inner[key]
    del inner[path[-1]]
    return out


def test_a_field_added_after_the_run_started_resumes_at_its_default_and_is_named_otherwise(tmp_path):
    """A run launched by an older version has no record of a field added since (data.copy_repeats
    came after runs in flight): a resume compares it as its default, so an upgrade does not strand the
    run, while a new non-default value is still refused, naming the field."""
    need_models()
    base = _config_dict(tmp_path)
    identity = run_identity(base, "no", "abc")
    paths = [path for section in SECTIONS if isinstance(identity.get(section), dict)
             for path in _field_paths(identity[section], section)]
    assert ("data", "copy_repeats") in paths and len(paths) > 40
    defaults = config_identity(field_defaults())

    def at(tree, path):
        for key in path:
            tree = tree.get(key) if isinstance(tree, dict) else None
        return tree

    at_default = [path for path in paths if at(identity, path) == at(defaults, path)]
    assert ("data", "copy_repeats") in at_default and len(at_default) > 20
    for path in paths:  # a dropped field set away from its default is a change, named by its field
        expected = [] if path in at_default else [".".join(path[:2])]
        assert identity_changes(_drop(identity, path), identity) == expected, path
    older = _drop(identity, ("data", "copy_repeats"))
    repeated = run_identity(_config_dict(tmp_path, ["data.copy_repeats=0.5"]), "no", "abc")
    assert identity_changes(older, repeated) == ["data.copy_repeats"]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    stored = copy.deepcopy(base)
    del stored["data"]["copy_repeats"]
    (run_dir / "run.yaml").write_text(yaml.safe_dump(stored))
    assert check_run_dir(run_dir, base, "latest", False) is None  # nothing saved yet: starts from the beginning
    with pytest.raises(UsageError, match=r"differs in: data.copy_repeats \(checkpoint 0.0, now 0.5"):
        check_run_dir(run_dir, _config_dict(tmp_path, ["data.copy_repeats=0.5"]), "latest", False)


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """Run A (seed 0, grad_accum 2, 8 steps) stopped by a real SIGTERM after step 2, on a copy of the
    training text (so a test can change it)."""
    need_models()
    root = tmp_path_factory.mktemp("identity")
    text = root / "train.txt"
    shutil.copy(TRAIN_TXT, text)
    run_dir = root / "runA"
    args = tiny_overrides(run_dir, steps=8, **{"data.train.files": f"[{text}]", "threads": 1,
                                               "mixed_precision": "null"})  # the launcher's: see the bf16 test
    mp = pytest.MonkeyPatch()
    mp.setenv("UPTRAIN_TEST_SIGNAL_AT", "2:0:SIGTERM")
    try:
        assert main([str(DEMO), *args]) == 75
    finally:
        mp.undo()
    (checkpoint,) = complete_checkpoints(run_dir)
    return run_dir, checkpoint, args, text


def _last_error(capsys) -> str:
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_a_checkpoint_resumed_into_another_run_folder_is_refused(stopped_run, tmp_path, capsys):
    run_dir, checkpoint, args, _ = stopped_run
    other = tmp_path / "runB"
    argv = [a for a in args if not a.startswith("run_dir=")] + [f"run_dir={other}", f"resume={checkpoint}",
                                                                 "seed=5", "batch.grad_accum=1"]
    assert main([str(DEMO), *argv]) == 2
    line = _last_error(capsys)
    assert f"belongs to the run in {run_dir}" in line and f"run_dir={run_dir} resume=latest" in line, line
    assert not other.exists()


def test_a_changed_seed_is_refused_by_the_checkpoint_itself_without_run_yaml(stopped_run, tmp_path, capsys):
    run_dir, checkpoint, args, _ = stopped_run
    copy = tmp_path / "runA"
    shutil.copytree(run_dir, copy)
    (copy / "run.yaml").unlink()  # lost or replaced: the checkpoint still knows its run
    argv = [a for a in args if not a.startswith("run_dir=")] + [f"run_dir={copy}", "resume=latest", "seed=5"]
    assert main([str(DEMO), *argv]) == 2
    line = _last_error(capsys)
    assert "was written by a run with other settings: seed (checkpoint 0, now 5)" in line, line
    assert checkpoint_state(complete_checkpoints(copy)[-1])["identity"]["seed"] == 0


def test_a_changed_training_text_is_refused(stopped_run, tmp_path, capsys):
    # The same path, other content (a data file rewritten between the stop and the resume).
    run_dir, _, args, text = stopped_run
    copy = tmp_path / "runA"
    shutil.copytree(run_dir, copy)
    original = text.read_text()
    text.write_text(original + "\n\nOnce upon a time there was a new story in the file.\n")
    try:
        argv = [a for a in args if not a.startswith("run_dir=")] + [f"run_dir={copy}", "resume=latest"]
        assert main([str(DEMO), *argv]) == 2
    finally:
        text.write_text(original)
    line = _last_error(capsys)
    assert "data_fingerprint (the training text or the tokenizer changed" in line, line


def test_a_launcher_mixed_precision_changed_on_resume_is_refused(stopped_run, tmp_path, capsys, monkeypatch):
    # The config leaves mixed_precision to the launcher (null in run.yaml both times): the checkpoint
    # records the effective one ("no"), and a launch with bf16 is another trajectory.
    run_dir, _, args, _ = stopped_run
    copy = tmp_path / "runA"
    shutil.copytree(run_dir, copy)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    argv = [a for a in args if not a.startswith("run_dir=")] + [f"run_dir={copy}", "resume=latest"]
    assert main([str(DEMO), *argv]) == 2
    line = _last_error(capsys)
    assert "mixed_precision (checkpoint 'no', now 'bf16'" in line, line


def test_an_fsdp2_checkpoint_resumed_without_shard_is_one_line(tmp_path, capsys, monkeypatch):
    need_models()
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir, steps=6, **{"threads": 1, "batch.micro_batch": 2, "batch.grad_accum": 4})
    monkeypatch.setenv("UPTRAIN_TEST_SIGNAL_AT", "3:0:SIGTERM")
    assert main([str(DEMO), *args, "shard=fsdp2"]) == 75
    monkeypatch.delenv("UPTRAIN_TEST_SIGNAL_AT")
    (checkpoint,) = complete_checkpoints(run_dir)
    assert main([str(DEMO), *args, "resume=latest"]) == 2  # was: FileNotFoundError .../pytorch_model.bin
    line = _last_error(capsys)
    assert line.startswith("error: ") and "shard" in line and "Traceback" not in capsys.readouterr().err, line
    # The checkpoint's record alone says so too (a run folder whose run.yaml was replaced).
    state = checkpoint_state(checkpoint)
    now = run_identity({**state["identity"], "shard": None}, state["identity"]["mixed_precision"],
                       state["identity"]["data_fingerprint"])
    with pytest.raises(UsageError, match=r"shard \(checkpoint 'fsdp2', now None"):
        check_checkpoint_identity(checkpoint, state, now)
