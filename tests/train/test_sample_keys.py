"""The key of kept teacher samples (uptrain.train.model.teacher_samples._identity): by content, as kept
conversion layers are keyed. Another model at the same path, a same-size edit of its tokenizer, other
settings or other code make the samples again; the same model reuses them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from conftest import EXAMPLE_MHA8, perturbed_copy
from uptrain.data import TeacherSamples
from uptrain.train.model import teacher_samples
from uptrain.train.model.teacher_samples import teacher_text_file

TS = TeacherSamples(tokens=1000, max_new_tokens=64, batch=8, seed=5)  # 2 batches of 8 x 64


def _stop_in_second_batch(partial):
    """A progress line's writer that stops (as Ctrl-C) once batch 0 is kept, inside batch 1."""
    def write(line: str) -> None:
        if " of " in line and len(list((partial / "chunks").glob("chunk-*.json"))) == 1:
            raise KeyboardInterrupt
    return write


def test_kept_batches_are_made_again_for_another_model_at_the_same_path(tmp_path, monkeypatch):
    monkeypatch.setenv("UPTRAIN_PROGRESS_EVERY", "0")  # a progress line every step: the stop comes at once
    teacher, partial, out = tmp_path / "teacher", tmp_path / ".partial", tmp_path / "samples.jsonl"
    shutil.copytree(EXAMPLE_MHA8, teacher)
    other = perturbed_copy(EXAMPLE_MHA8, tmp_path / "other", seed=1)  # same shapes, same size, other weights
    cpu = torch.device("cpu")
    with pytest.raises(KeyboardInterrupt):
        teacher_text_file(teacher, TS, out, partial, cpu, _stop_in_second_batch(partial))
    first = (partial / "chunks" / "chunk-000000.json").read_text()

    shutil.copyfile(other / "model.safetensors", teacher / "model.safetensors")  # another model, same path
    lines: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        teacher_text_file(teacher, TS, out, partial, cpu, lambda line: (lines.append(line),
                                                                        _stop_in_second_batch(partial)(line)))
    assert "kept from a stopped run" not in lines[0], lines[0]  # the old model's batch is not taken
    again = (partial / "chunks" / "chunk-000000.json").read_text()
    assert again != first  # made again, by the model now there

    lines = []
    made = teacher_text_file(teacher, TS, out, partial, cpu, lines.append)  # the same model again: reused
    assert "1 batches kept from a stopped run" in lines[0], lines[0]
    assert made["batches_reused"] == 1 and not partial.exists()


def test_a_same_size_edit_of_the_tokenizer_and_other_settings_or_code_change_the_key(tmp_path, monkeypatch):
    import uptrain

    teacher = tmp_path / "teacher"
    shutil.copytree(EXAMPLE_MHA8, teacher)
    digests: dict = {}
    base = teacher_samples._identity(teacher, AutoTokenizer.from_pretrained(teacher), TS, digests)
    assert teacher_samples._identity(teacher, AutoTokenizer.from_pretrained(teacher), TS, digests) == base
    assert teacher_samples._identity(teacher, AutoTokenizer.from_pretrained(EXAMPLE_MHA8), TS, {}) == base

    # Two tokens' ids swapped in tokenizer.json: the same size, a different tokenizer. Keyed with the
    # digests of the first key (as a rerun reads them), and again with the old modification time put back.
    path = teacher / "tokenizer.json"
    text, stat = path.read_text(encoding="utf-8"), path.stat()
    edited = text.replace('"a": 412,', '"@": 412,').replace('"b": 430,', '"a": 430,').replace('"@": 412,', '"b": 412,')
    assert edited != text and len(edited.encode()) == len(text.encode())
    path.write_text(edited, encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    assert teacher_samples._identity(teacher, tokenizer, TS, dict(digests))["teacher"] != base["teacher"]
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # a copy that kept the old time: the tokenizer tells
    edited_key = teacher_samples._identity(teacher, tokenizer, TS, dict(digests))
    assert edited_key != base and edited_key["tokenizer"] != base["tokenizer"]

    path.write_text(text, encoding="utf-8")
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    assert teacher_samples._identity(teacher, tokenizer, TS, {}) == base  # content, not path or time
    other = TeacherSamples(**{**TS.__dict__, "seed": 6})
    assert teacher_samples._identity(teacher, tokenizer, other, {}) != base
    assert base["code"][0] == uptrain.code_fingerprint(*teacher_samples.SAMPLER_MODULES)


def test_the_samples_code_key_changes_with_the_sampler_and_not_with_the_rest_of_uptrain(tmp_path):
    """An edit to the code that makes the samples makes them again; an edit elsewhere (an upgrade between
    two launches of a run whose config gained a field) keeps them: a 7B teacher's samples take hours."""
    import uptrain

    copy = tmp_path / "uptrain"
    shutil.copytree(Path(uptrain.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    key = uptrain.code_fingerprint(*teacher_samples.SAMPLER_MODULES, root=copy)
    assert key == uptrain.code_fingerprint(*teacher_samples.SAMPLER_MODULES)
    whole = uptrain.code_fingerprint(root=copy)
    with open(copy / "train" / "config.py", "a") as f:
        f.write("\n# an edit outside the sampler\n")
    assert uptrain.code_fingerprint(*teacher_samples.SAMPLER_MODULES, root=copy) == key
    assert uptrain.code_fingerprint(root=copy) != whole  # kept layers and sweep points still see every edit
    for module in teacher_samples.SAMPLER_MODULES:
        with open(copy / module, "a") as f:
            f.write("\n# an edit inside the sampler\n")
        changed = uptrain.code_fingerprint(*teacher_samples.SAMPLER_MODULES, root=copy)
        assert changed != key, module
        key = changed


def test_the_sampler_modules_hold_every_uptrain_import_that_shapes_the_samples():
    """A refactor that moves sampling code into a new module must name it in SAMPLER_MODULES: every uptrain
    module the three import is either one of them or one that cannot change a sample's text."""
    import ast

    import uptrain

    root = Path(uptrain.__file__).parent
    neutral = {"uptrain.errors", "uptrain.convert.progress", "uptrain.fingerprint", "uptrain.train.config",
               "uptrain.data", "uptrain.convert.io.hfconfig"}
    # errors, progress lines, file digests, the config and settings types (in the key); the model's shape, which
    # sizes an auto batch only (as free GPU memory does: a continued generation keeps its first batch's rows)
    named = {"uptrain." + m.removesuffix(".py").replace("/", ".") for m in teacher_samples.SAMPLER_MODULES}
    for module in teacher_samples.SAMPLER_MODULES:
        tree = ast.parse((root / module).read_text())
        imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and (n.module or "").startswith("uptrain")}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names if a.name.startswith("uptrain")}
        assert imported - {"uptrain"} <= neutral | named, (module, imported - neutral - named)


def test_the_prompts_file_is_keyed_by_its_text(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    tokenizer = AutoTokenizer.from_pretrained(EXAMPLE_MHA8)
    ts = TeacherSamples(tokens=100, prompts=str(prompts))
    base = teacher_samples._identity(EXAMPLE_MHA8, tokenizer, ts, {})
    prompts.write_text("Once upon a dime\n")  # same size
    assert teacher_samples._identity(EXAMPLE_MHA8, tokenizer, ts, {}) != base
    json.dumps(base)  # kept in meta.json as it is


def test_the_trainers_samples_are_made_again_for_another_model_at_the_same_path(tmp_path):
    # ensure_teacher_samples (the trainer's path): the samples written for one teacher are reused for it and
    # made again when another model is put at its path.
    from types import SimpleNamespace

    from uptrain.train.model.teacher_samples import ensure_teacher_samples

    teacher, run_dir = tmp_path / "teacher", tmp_path / "run"
    shutil.copytree(EXAMPLE_MHA8, teacher)
    other = perturbed_copy(EXAMPLE_MHA8, tmp_path / "other", seed=1)
    ts = TeacherSamples(tokens=200, max_new_tokens=32, batch=4, seed=0)
    config = SimpleNamespace(run_dir=str(run_dir), data=SimpleNamespace(train=SimpleNamespace(teacher_samples=ts)))
    accelerator = SimpleNamespace(is_main_process=True, mixed_precision="no", device=torch.device("cpu"),
                                  wait_for_everyone=lambda: None)
    tokenizer = AutoTokenizer.from_pretrained(teacher)
    samples = run_dir / "teacher_samples" / "samples.jsonl"

    def line() -> str:
        return ensure_teacher_samples(config, tokenizer, accelerator, teacher)[1]
    assert "generated into" in line()
    first = samples.read_text()
    assert "reused from" in line()
    shutil.copyfile(other / "model.safetensors", teacher / "model.safetensors")
    assert "generated into" in line() and samples.read_text() != first
    assert "reused from" in line()
