"""Run configs: YAML + key=value overrides, validation, and bad configs failing before any work."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from accelerate.commands.config.config_args import load_config_from_file

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, MHA8, REPO, VALID_TXT, need_models, tiny_overrides
from uptrain.errors import UsageError
from uptrain.train.__main__ import main
from uptrain.train.config import load_config


def test_every_shipped_yaml_parses_and_validates(monkeypatch):
    monkeypatch.chdir(REPO)  # configs name paths relative to the repository root
    demo = load_config("configs/demo-cpu.yaml")  # reads the bundled examples/data
    assert demo.data.seq_len == 128 and demo.budget.total_tokens() == 400_000 and demo.data.val.files
    big = load_config("configs/llama2-7b-gqa8.yaml")
    assert big.expect_kv_heads == 8 and big.budget.total_tokens() == 100_000_000_000
    assert big.mixed_precision == "bf16" and big.resume == "latest"
    launchers = sorted((REPO / "configs" / "accelerate").glob("*.yaml"))
    assert [p.stem for p in launchers] == ["ddp", "deepspeed-zero3", "fsdp2"]
    for path in launchers:
        cluster = load_config_from_file(str(path))  # accelerate's own reader rejects unknown keys
        assert cluster.num_processes == 8, path
    for path in [*(REPO / "configs").glob("*.yaml"), *launchers]:
        header = path.read_text().splitlines()[:8]
        assert any("uptrain.train" in line for line in header), f"{path} header gives no command"


def test_overrides_reach_nested_fields_with_types(tmp_path):
    need_models()
    config = load_config(DEMO, tiny_overrides(tmp_path, **{"optim.lr": "1e-3", "budget.tokens": "1e6",
                                                           "data.repeat_data": "yes", "distill.teacher": MHA8,
                                                           "mixed_precision": "no"}))
    assert config.optim.lr == 1e-3 and config.budget.tokens == 1_000_000 and config.data.repeat_data is True
    assert config.mixed_precision == "no"  # not the YAML 1.1 boolean False
    assert config.data.val.files and config.distill.teacher == str(MHA8) and config.log.log_with == []
    fraction = load_config(DEMO, tiny_overrides(tmp_path, **{"budget.tokens": "null", "budget.fraction": 0.05,
                                                             "budget.pretrain_tokens": "2e6"}))
    assert fraction.budget.total_tokens() == 100_000


@pytest.mark.parametrize("override, message", [
    ("optim.lrr=1", "unknown config field 'optim.lrr'"),
    ("colour=blue", "unknown config field 'colour'"),
    ("batch.micro_batch=many", "'batch.micro_batch' must be int"),
    ("budget.fraction=0.5", "either budget.tokens or budget.fraction"),
    ("mixed_precision=fp8", "mixed_precision must be"),
    ("optim.lr", "is not key=value"),
    ("data.train.streaming=true data.val=null", "a streaming data.train needs a separate validation source"),
    ("data.val.streaming=true eval.max_batches=null", "a streaming data.val needs eval.max_batches"),
    ("data.shuffle_buffer=100", "applies only to a streaming data.train"),
])
def test_invalid_fields_are_usage_errors(tmp_path, override, message):
    need_models()
    with pytest.raises(UsageError, match=message.replace("(", r"\(")):
        load_config(DEMO, tiny_overrides(tmp_path) + override.split(" "))


def _teacher_with_other_vocab(tmp_path: Path) -> Path:
    """A copy of stories260K-mha8 whose tokenizer swaps the ids of two tokens."""
    teacher = tmp_path / "teacher"
    shutil.copytree(MHA8, teacher)
    spec = json.loads((teacher / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = [t for t in vocab if t.isalpha() and len(t) > 3][:2]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    return teacher


def _other_run(run_dir: Path) -> str:
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run_dir / "run.yaml").write_text("model: some/other/model\nseed: 7\n")
    return "already holds a run"


BAD = {
    "unknown field": (lambda tmp: ["optim.warmup=3"], "unknown config field 'optim.warmup'"),
    "missing data": (lambda tmp: ["data.train.files=[/nonexistent/train.txt]"], "data file not found"),
    "budget below one step": (lambda tmp: ["budget.tokens=511"], "below one optimizer step of 512 tokens"),
    "no validation tokens": (lambda tmp: ["eval.max_batches=0"], "validation must score tokens"),
    "warmup beyond the run": (lambda tmp: ["optim.warmup_steps=5"], "optim.warmup_steps=5 is more than the run's 4 optimizer steps"),
    "wsd decay and warmup beyond the run": (lambda tmp: ["optim.schedule=wsd", "optim.warmup_steps=3", "optim.decay_fraction=0.5"],
                                            "plus the wsd decay (2 steps, decay_fraction=0.5) is more than the run's 4"),
    "unknown schedule": (lambda tmp: ["optim.schedule=linear"], "optim.schedule must be cosine or wsd, got 'linear'"),
    "model missing": (lambda tmp: [f"model={tmp / 'nothing'}"], "nothing does not exist; check the path"),
    "model folder without config.json": (lambda tmp: [f"model={tmp}"], "is not a model folder (no config.json"),
    "save_dtype unknown": (lambda tmp: ["save_dtype=int8"], "save_dtype must be source, float32, bfloat16 or float16"),
    "kv heads": (lambda tmp: ["expect_kv_heads=2"], "has 4 key/value heads but expect_kv_heads=2"),
    "tokenizer mismatch": (lambda tmp: [f"distill.teacher={_teacher_with_other_vocab(tmp)}"],
                           "do not share a tokenizer (both 512 tokens, but 2 map to other ids"),
    "data below budget": (lambda tmp: ["budget.tokens=2e6"], "set data.repeat_data=true"),
    "other run": (lambda tmp: [] if _other_run(tmp / "run") else [], "already holds a run"),
    "seq_len beyond the model": (lambda tmp: ["data.seq_len=1024", "budget.tokens=1e5"], "data.seq_len=1024 is beyond the 512 positions"),
    "other run resumed": (lambda tmp: ["resume=latest"] if _other_run(tmp / "run") else [], "holds another run's state"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_config_fails_before_any_work(tmp_path, capsys, case):
    need_models()
    extra, message = BAD[case]
    run_dir = tmp_path / "run"
    args = tiny_overrides(run_dir) + extra(tmp_path)
    existed = run_dir.exists()
    assert main([str(DEMO), *args]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
    if not existed:
        assert not run_dir.exists(), "a failing config must not create the run folder"
    else:
        assert not (run_dir / "checkpoints").exists() and len((run_dir / "metrics.jsonl").read_text().splitlines()) == 1


def test_wandb_asked_for_but_not_installed_is_a_usage_error(tmp_path, capsys):
    need_models()
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed here: nothing to refuse")
    except ImportError:
        pass
    assert main([str(DEMO), *tiny_overrides(tmp_path / "run"), "log.log_with=[wandb]"]) == 2
    assert "wandb" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_repeat_data_allows_a_budget_beyond_the_data(tmp_path):
    need_models()
    small = tmp_path / "small.txt"
    small.write_text(VALID_TXT.read_text().split("\n\n")[0])
    args = tiny_overrides(tmp_path / "run", steps=2, **{"data.train.files": f"[{small}]", "eval.max_batches": 1})
    assert main([str(DEMO), *args]) == 2  # one story holds fewer than 16 blocks of 64 tokens
    assert main([str(DEMO), *args, "data.repeat_data=true"]) == 0


def test_paths_in_a_config_file_are_relative_to_it_and_overrides_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # anywhere but the repository
    demo = load_config(DEMO)
    assert demo.data.train.files == [str(REPO / "examples" / "data" / "tinystories-train-sample.txt")]
    assert demo.run_dir == str(REPO / "runs" / "demo-cpu") and demo.model == str(REPO / "runs" / "stories260K-gqa2")
    other = load_config(DEMO, ["run_dir=mine", "model=org/some-hub-model", f"data.val.files=[{VALID_TXT}]"])
    assert other.run_dir == "mine" and other.model == "org/some-hub-model"  # as typed: cwd-relative / Hub id
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "run.yaml").write_text(
        "model: meta-llama/Llama-2-7b-hf\nrun_dir: out\nbudget: {tokens: 1000}\n"
        f"data: {{train: {{files: [{VALID_TXT}]}}}}\n")
    mine = load_config(tmp_path / "cfg" / "run.yaml")
    assert mine.model == "meta-llama/Llama-2-7b-hf"  # a Hub id stays one
    assert mine.run_dir == str(tmp_path / "cfg" / "out")


def test_files_null_on_the_command_line_means_no_files():
    config = load_config(DEMO, ["data.train.files=null", "data.train.dataset=roneneldan/TinyStories"])
    assert config.data.train.files == [] and config.data.train.dataset == "roneneldan/TinyStories"


def test_the_plan_says_how_many_cpu_threads_run(tmp_path, capsys):
    need_models()
    assert main([str(DEMO), *tiny_overrides(tmp_path / "run", steps=2, **{"optim.warmup_steps": 1}), "threads=1"]) == 0
    assert "CPU threads per process: 1" in capsys.readouterr().out
    with pytest.raises(UsageError, match="threads must be at least 1"):
        load_config(DEMO, ["threads=0"])


def test_the_plans_paths_line_names_the_teacher():
    """Issue 22: the plan's `paths:` line named the model but not the teacher it distils from."""
    from uptrain.train.setup import paths_line

    assert f"teacher {MHA8}" in paths_line(load_config(DEMO, [f"distill.teacher={MHA8}"]))
    assert "teacher" not in paths_line(load_config(DEMO, ["distill.teacher=null"]))


def test_without_threads_the_plan_says_what_it_chose_from_the_load(tmp_path, capsys, monkeypatch):
    need_models()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert main([str(DEMO), *tiny_overrides(tmp_path / "run", steps=2, **{"optim.warmup_steps": 1})]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("CPU threads per process:"))
    assert "load average" in line and "config: threads" in line, line


def test_bad_yaml_names_the_line(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\ndata:\n  train:\n    files: [a.txt]\n   seq_len: 64\n")  # line 5 mis-indented
    assert main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is not valid YAML: line 5, column 4:" in err, err


def test_training_a_model_that_was_not_converted_warns(tmp_path, capsys):
    # The MHA source itself (8 K/V heads for 8 query heads), given by mistake: trained, with a warning.
    need_models()
    args = tiny_overrides(tmp_path / "run", steps=1, **{"model": MHA8, "optim.warmup_steps": 0, "threads": 1})
    assert main([str(DEMO), *args]) == 0
    out = capsys.readouterr().out
    assert f"warning: model {MHA8} has as many K/V heads as query heads (8): it is not a GQA conversion" in out, out
    assert main([str(DEMO), *tiny_overrides(tmp_path / "run2", steps=1, **{"optim.warmup_steps": 0, "threads": 1})]) == 0
    assert "warning: model" not in capsys.readouterr().out  # a converted model (4 of 8): no warning


def test_help_points_to_a_heading_that_exists_and_holds_every_key_it_lists():
    import re
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "uptrain.train", "--help"], cwd=REPO, capture_output=True, text=True,
                          env={**__import__("os").environ, "COLUMNS": "1000"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = " ".join(proc.stdout.split())
    found = re.search(r"key table in (\S+) \((#+ [^)]+)\)", text)
    assert found, text
    doc, heading = REPO / found.group(1), found.group(2)
    assert doc.is_file(), doc
    lines = doc.read_text().splitlines()
    assert heading in lines, f"{doc} has no heading {heading!r}"
    level = len(heading.split()[0])  # the section: up to the next heading of this level or above
    section = lines[lines.index(heading) + 1:]
    end = next((i for i, line in enumerate(section) if re.match(rf"#{{1,{level}}} ", line)), len(section))
    table = "\n".join(line for line in section[:end] if line.startswith("|"))
    listed = re.search(r"config sections: ([\w, ]+); top-level keys: ([\w, ]+)\.", text)
    keys = [k.strip() for k in f"{listed.group(1)},{listed.group(2)}".split(",")]
    missing = [k for k in keys if not re.search(rf"`{k}[.`]|`{k}\.", table)]
    assert not missing, f"{heading} in {doc} does not name {missing}"
