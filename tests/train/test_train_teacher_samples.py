"""`data.train.teacher_samples`: uptraining on the teacher's own text (real stories260K MHA8 -> GQA2, CPU)."""

from __future__ import annotations

import json
import re
import math
import shutil

import pytest

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, MHA8, TRAIN_TXT, VALID_TXT, read_metrics, tiny_overrides, train_losses
from uptrain.convert import convert
from uptrain.measure.eval import evaluate, load_model, tokenize_texts
from uptrain.train import train
from uptrain.train.__main__ import main
from uptrain.train.config import load_config
from uptrain.train.state.run_state import complete_checkpoints

pytestmark = pytest.mark.usefixtures("one_torch_thread")
STEPS = 8


@pytest.fixture(scope="module")
def gqa2(tmp_path_factory):
    """stories260K MHA8 pooled to 2 K/V heads: lossy, so training has something to recover."""
    out = tmp_path_factory.mktemp("gqa2") / "stories260K-gqa2"
    convert(str(MHA8), out, 2)
    return out


def _samples_args(run_dir, model, **extra):
    return tiny_overrides(run_dir, steps=STEPS, **{
        "model": model, "distill.teacher": MHA8, "data.train.files": "null", "threads": 1,
        "data.train.teacher_samples": "{tokens: 6000, max_new_tokens: 128, batch: 64, temperature: 1.0, top_p: 0.95, seed: 0}",
        "data.repeat_data": "true", "checkpoint.every": 4, "checkpoint.keep": 2, **extra})


def _held_out_loss(path) -> float:
    model, tokenizer = load_model(str(path))
    texts = [t for t in VALID_TXT.read_text().split("\n\n") if t.strip()][:40]
    return evaluate(model, tokenize_texts(tokenizer, texts), 512, 256).loss


def test_teacher_samples_train_resume_and_compare_with_file_data(tmp_path, gqa2, capsys):
    run_dir = tmp_path / "samples"
    args = _samples_args(run_dir, gqa2)
    train(load_config(DEMO, args))
    out = capsys.readouterr().out
    samples = run_dir / "teacher_samples" / "samples.jsonl"
    meta = json.loads((run_dir / "teacher_samples" / "meta.json").read_text())
    assert meta["tokens"] >= 6000 and meta["documents"] == len(samples.read_text().splitlines()) > 10
    assert all(json.loads(line)["text"].strip() for line in samples.read_text().splitlines())
    assert "teacher samples:" in out and "generated into" in out and "samples/s" in out and "tokens/s" in out
    assert str(samples) in out  # the plan's train data is the samples file
    reference = train_losses(run_dir)
    assert sorted(reference) == list(range(1, STEPS + 1))
    assert all("kd_loss" in r for r in read_metrics(run_dir) if "loss" in r)  # distilled from the same teacher

    # Interrupted after the checkpoint of step 4: the resumed run reuses the written samples
    # (not regenerated: same bytes, same file) and reproduces the uninterrupted losses.
    before = samples.read_bytes(), samples.stat().st_mtime_ns
    shutil.rmtree(run_dir / "model")
    (run_dir / "finished.json").unlink()
    shutil.rmtree(complete_checkpoints(run_dir)[-1])
    train(load_config(DEMO, args + ["resume=latest"]))
    assert "reused from" in capsys.readouterr().out
    assert (samples.read_bytes(), samples.stat().st_mtime_ns) == before
    resumed = train_losses(run_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        assert resumed[step] == pytest.approx(reference[step], abs=1e-6), step

    # The same budget on the TinyStories file data, for comparison on held-out real text.
    file_dir = tmp_path / "files"
    train(load_config(DEMO, tiny_overrides(file_dir, steps=STEPS, **{
        "model": gqa2, "distill.teacher": MHA8, "threads": 1, "data.train.files": f"[{TRAIN_TXT}]"})))
    losses = {name: _held_out_loss(path) for name, path in [
        ("teacher MHA8", MHA8), ("converted GQA2 (start)", gqa2),
        ("uptrained on teacher samples", run_dir / "model"), ("uptrained on file data", file_dir / "model")]}
    with capsys.disabled():
        print(f"\nheld-out loss on {VALID_TXT.name} (40 stories), {STEPS} steps x 512 tokens:")
        for name, loss in losses.items():
            print(f"  {name:32s} {loss:.4f}")
    assert all(math.isfinite(v) for v in losses.values())
    assert losses["uptrained on teacher samples"] < losses["converted GQA2 (start)"]


@pytest.mark.parametrize("extra, message", [
    ({"distill.teacher": "null"}, "data.train.teacher_samples needs distill.teacher"),
    ({"data.train.teacher_samples": "{tokens: 0}"}, "tokens and max_new_tokens must be at least 1"),
    ({"data.train.teacher_samples": "{tokens: 100, top_p: 0}"}, "top_p in (0, 1]"),
    ({"data.train.files": f"[{TRAIN_TXT}]"}, "teacher_samples is a data source of its own"),
    ({"data.train.teacher_samples": "{tokens: 100, prompts: /nonexistent/prompts.txt}"}, "prompts file not found"),
])
def test_bad_teacher_samples_refused_before_any_work(tmp_path, gqa2, capsys, extra, message):
    run_dir = tmp_path / "run"
    assert main([str(DEMO), *_samples_args(run_dir, gqa2, **extra)]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and message in last, last
    assert not run_dir.exists()


def test_teacher_with_another_tokenizer_refused_before_generating(tmp_path, gqa2, capsys):
    from test_train_config import _teacher_with_other_vocab
    run_dir = tmp_path / "run"
    args = _samples_args(run_dir, gqa2, **{"distill.teacher": _teacher_with_other_vocab(tmp_path)})
    assert main([str(DEMO), *args]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: ") and "do not share a tokenizer" in last, last
    assert not run_dir.exists()


def test_generation_is_seeded_and_starts_from_the_prompts(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from uptrain.data import TeacherSamples
    from uptrain.train.model.teacher_samples import generate_documents

    model, tok = AutoModelForCausalLM.from_pretrained(MHA8).eval(), AutoTokenizer.from_pretrained(MHA8)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\nTom had a red ball\n")
    cpu = torch.device("cpu")

    def sample(seed, path=prompts):
        ts = TeacherSamples(tokens=200, max_new_tokens=32, batch=8, seed=seed, prompts=str(path) if path else None)
        return generate_documents(model, tok, ts, cpu)

    texts, n = sample(0)
    assert n >= 200 and texts
    assert all(t.startswith(("Once upon a time", "Tom had a red ball")) for t in texts), texts
    assert {t[:4] for t in texts} == {"Once", "Tom "}  # both prompts drawn
    assert sample(0) == (texts, n)  # seeded: the same documents again
    assert sample(1)[0] != texts
    assert sample(0, None)[0] != texts  # from BOS: no prompt


def test_a_sample_is_split_into_documents_at_bos():
    # llama2.c models such as stories260K separate documents by BOS and never emit EOS: one
    # sampled row of 400 tokens holds the end of one story and the start of the next. Each must
    # become its own document (the packer joins documents with EOS), not one text spanning both.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from uptrain.data.source import TeacherSamples
    from uptrain.train.model.teacher_samples import generate_documents

    model, tok = AutoModelForCausalLM.from_pretrained(MHA8).eval(), AutoTokenizer.from_pretrained(MHA8)
    split = 0
    for seed in range(6):
        ts = TeacherSamples(tokens=1, max_new_tokens=400, batch=1, seed=seed)  # tokens=1: exactly one row
        texts, n = generate_documents(model, tok, ts, torch.device("cpu"))
        assert n == 400 and texts, (seed, texts)
        split += len(texts) >= 2
        for text in texts[1:]:  # the documents after a BOS start a story
            assert text.startswith(("Once", "One day")), (seed, text[:60])
    assert split >= 3, split  # most 400-token rows hold two stories (a story is ~200-300 tokens)


def test_split_at_bos_keeps_every_token_and_starts_each_document_at_bos():
    import random
    from uptrain.train.model.teacher_samples import split_at_bos

    rng = random.Random(0)
    bos = 1
    cases = [[], [bos], [bos, bos], [5, 6], [bos, 5, bos, 6, 7, bos]]
    cases += [[rng.choice([bos, 2, 3, 4, 5]) for _ in range(rng.randrange(0, 40))] for _ in range(300)]
    for tokens in cases:
        docs = split_at_bos(tokens, bos)
        assert [t for d in docs for t in d] == tokens  # nothing lost, order kept
        assert all(d for d in docs) and all(bos not in d[1:] for d in docs)  # no BOS inside a document
        assert all(d[0] == bos for d in docs[1:])  # every document after the first starts at a BOS
        assert len(docs) == tokens[1:].count(bos) + (1 if tokens else 0)


def test_samples_stay_within_the_teachers_context(tmp_path):
    # A teacher with 128 positions asked for 256 new tokens a document: each prompt + sample fits in
    # its 128 positions (before: 256 new tokens, past what it was trained on, with only a warning).
    import json as _json
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from uptrain.data import TeacherSamples
    from uptrain.train.model.teacher_samples import ChunkStore, generate_documents

    teacher = tmp_path / "short-teacher"
    shutil.copytree(MHA8, teacher)
    config = _json.loads((teacher / "config.json").read_text())
    config["max_position_embeddings"] = 128
    (teacher / "config.json").write_text(_json.dumps(config))
    model, tok = AutoModelForCausalLM.from_pretrained(teacher).eval(), AutoTokenizer.from_pretrained(teacher)
    chunks = ChunkStore(tmp_path / "chunks")
    generate_documents(model, tok, TeacherSamples(tokens=3000, max_new_tokens=256, batch=8), torch.device("cpu"), chunks)
    rows = [row for i in range(chunks.count()) for row in chunks.read(i)]
    assert rows and max(r["new_tokens"] for r in rows) <= 127  # + the BOS prompt: 128 positions


def test_samples_below_the_budget_are_refused_before_generating(tmp_path, gqa2, capsys):
    run_dir = tmp_path / "run"
    args = _samples_args(run_dir, gqa2, **{"data.repeat_data": "false",
                                           "data.train.teacher_samples": "{tokens: 1000, batch: 8}"})
    assert main([str(DEMO), *args]) == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "teacher_samples.tokens 1,000 is below the budget of 4,096 tokens" in last and "repeat_data" in last, last
    assert not (run_dir / ".partial-teacher_samples").exists() and not (run_dir / "teacher_samples").exists()


def test_the_shipped_teacher_samples_config_trains_without_any_text(tmp_path, gqa2):
    # configs/teacher-samples.yaml as its header says, on a budget a test can afford.
    from conftest import REPO
    run_dir = tmp_path / "run"
    config = load_config(REPO / "configs" / "teacher-samples.yaml", [
        f"model={gqa2}", f"run_dir={run_dir}", "budget.tokens=2048", "data.train.teacher_samples.tokens=3500",
        "data.train.teacher_samples.batch=16", "data.val_fraction=0.2", "data.seq_len=64", "batch.micro_batch=4", "batch.grad_accum=1",
        "optim.warmup_steps=1", "eval.every=0", "eval.max_batches=2", "log.progress_bar=false", "threads=1"])
    assert config.data.train.files == [] and config.distill.teacher.endswith("stories260K-mha8")
    result = train(config)
    assert math.isfinite(result["val_loss"]) and (run_dir / "model" / "config.json").is_file()
    assert (run_dir / "held_out.jsonl").is_file()  # validation on held-out samples, written for uptrain.eval


@pytest.mark.parametrize("kept", [0, 1, 2])
def test_a_stopped_generation_keeps_its_batches_and_the_rerun_equals_an_uninterrupted_one(tmp_path, monkeypatch,
                                                                                           kept):
    # uptrain.demo --teacher-samples: a stop (here KeyboardInterrupt, as Ctrl-C raises it) inside the first,
    # a middle or the last of 3 batches keeps the batches before it; the rerun says so, makes the rest, and
    # writes the same text as a run never stopped. Progress lines come while a batch is made
    # (UPTRAIN_PROGRESS_EVERY=0: every step).
    import torch
    from uptrain.data import TeacherSamples
    from uptrain.train.model.teacher_samples import teacher_text_file

    monkeypatch.setenv("UPTRAIN_PROGRESS_EVERY", "0")
    ts = TeacherSamples(tokens=1500, max_new_tokens=64, batch=8, seed=5)  # 3 batches of 8 x 64
    whole = tmp_path / "whole.jsonl"
    lines: list[str] = []
    teacher_text_file(MHA8, ts, whole, tmp_path / ".whole-partial", torch.device("cpu"), lines.append)
    made = [int(m.group(1).replace(",", "")) for m in map(re.compile(r"teacher samples: ([\d,]+) of").match, lines) if m]
    assert len(made) >= 64 * 2 and made == sorted(made) and made[-1] >= 1500, lines[:3]  # a line per step, rising

    partial, out = tmp_path / ".partial", tmp_path / "samples.jsonl"

    def stop_in_batch(line: str) -> None:  # (a progress line: generation is inside batch number `kept`)
        if line.startswith("teacher samples: ") and " of " in line and \
                len(list((partial / "chunks").glob("chunk-*.json"))) == kept:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        teacher_text_file(MHA8, ts, out, partial, torch.device("cpu"), stop_in_batch)
    assert not out.exists() and len(list((partial / "chunks").glob("chunk-*.json"))) == kept
    again: list[str] = []
    teacher_text_file(MHA8, ts, out, partial, torch.device("cpu"), again.append)
    assert (f"{kept} batches kept from a stopped run" in again[0]) == (kept > 0), again[0]
    assert out.read_text() == whole.read_text() and not partial.exists()


def _short_teacher(positions: int):
    """A tiny llama of `positions` positions (random weights) over stories260K's vocabulary, with its tokenizer."""
    from transformers import AutoTokenizer
    from families import tiny_config
    from tiny import random_model

    model = random_model(tiny_config("llama", {"vocab_size": 512, "max_position_embeddings": positions}), seed=3)
    model.set_attn_implementation("sdpa")
    return model, AutoTokenizer.from_pretrained(MHA8)


LONG_PROMPT = "Once upon a time there was a little girl named Lily who loved to play in the park with her dog"  # 30 ids


def test_a_prompt_counts_against_the_teachers_positions(tmp_path, monkeypatch):
    # A 64-position teacher asked for 63 new tokens after a 30-token prompt: 34 new (64 positions, not 93);
    # the sampler itself refuses more, and a prompt that fills the positions is refused before generating.
    import torch
    from uptrain.data import TeacherSamples
    from uptrain.errors import UsageError
    from uptrain.train.model import teacher_samples
    from uptrain.train.model.sampling import sample_continuations

    model, tok = _short_teacher(64)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(f"{LONG_PROMPT}\nTom had a red ball\n")
    calls = []

    def recorded(model, rows, new, *args, **kwargs):
        calls.append((max(len(r) for r in rows), new))
        return sample_continuations(model, rows, new, *args, **kwargs)
    monkeypatch.setattr(teacher_samples, "sample_continuations", recorded)
    ts = TeacherSamples(tokens=300, max_new_tokens=63, batch=1, seed=0, prompts=str(prompts))  # a prompt a batch
    texts, n = teacher_samples.generate_documents(model, tok, ts, torch.device("cpu"))
    assert texts and n >= 300 and all(width + new <= 64 for width, new in calls), calls
    assert (30, 34) in calls and (9, 55) in calls, calls  # the batches with the long prompt, and without

    with pytest.raises(UsageError, match=r"30 tokens \+ 63 new tokens needs 93 positions; the model has 64"):
        sample_continuations(model, [tok(LONG_PROMPT)["input_ids"]], 63, None, 0, 1.0, 1.0, seed=0)
    prompts.write_text(" ".join([LONG_PROMPT] * 3) + "\n")  # 88 tokens
    with pytest.raises(UsageError, match="a prompt of 88 tokens leaves no room in the teacher's 64 positions"):
        teacher_samples.generate_documents(model, tok, ts, torch.device("cpu"))


def test_a_tokenizer_with_a_bos_and_no_eos_samples_documents_to_their_longest(tmp_path):
    # Its eos_token removed from tokenizer_config.json: nothing ends a row but max_new_tokens (and the
    # documents inside a row are split at each BOS). With prompts of two lengths the left padding needs an
    # id, too. (Before: TypeError from the sampler, exit 1.)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from uptrain.data import TeacherSamples
    from uptrain.train.model.teacher_samples import ChunkStore, generate_documents

    teacher = tmp_path / "no-eos"
    shutil.copytree(MHA8, teacher)
    config = json.loads((teacher / "tokenizer_config.json").read_text())
    (teacher / "tokenizer_config.json").write_text(json.dumps({**config, "eos_token": None}))
    model, tok = AutoModelForCausalLM.from_pretrained(teacher).eval(), AutoTokenizer.from_pretrained(teacher)
    assert tok.eos_token_id is None and tok.bos_token_id == 1
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nTom had a red ball\n")
    for path in (None, prompts):
        chunks = ChunkStore(tmp_path / f"chunks-{path is None}")
        ts = TeacherSamples(tokens=128, max_new_tokens=32, batch=4, seed=0, prompts=str(path) if path else None)
        texts, n = generate_documents(model, tok, ts, torch.device("cpu"), chunks)
        rows = [row for i in range(chunks.count()) for row in chunks.read(i)]
        assert n == 128 and texts and [row["new_tokens"] for row in rows] == [32] * 4, rows
        if path:
            assert all(t.startswith(("Once upon a time", "Tom had a red ball")) for t in texts[:1]), texts


def test_the_last_batch_is_sized_to_the_tokens_left_and_a_continued_run_equals_an_uninterrupted_one(tmp_path,
                                                                                                 monkeypatch):
    # 600 tokens in batches of 8 rows x 64: the second batch needs 88 tokens, so 2 rows (128), not 8 (512): 640
    # sampled, within one document of 600 (before: 1,024). A run stopped inside that batch continues to the same text.
    import torch
    from uptrain.data import TeacherSamples
    from uptrain.train.model.teacher_samples import teacher_text_file

    monkeypatch.setenv("UPTRAIN_PROGRESS_EVERY", "0")
    ts = TeacherSamples(tokens=600, max_new_tokens=64, batch=8, seed=5)
    whole, partial, out = tmp_path / "whole.jsonl", tmp_path / ".partial", tmp_path / "samples.jsonl"
    made = teacher_text_file(MHA8, ts, whole, tmp_path / ".whole-partial", torch.device("cpu"), lambda line: None)
    assert made["tokens_made"] == 640 and 600 <= made["tokens"] < 600 + 64, made

    def stop_in_second(line: str) -> None:
        if " of " in line and len(list((partial / "chunks").glob("chunk-*.json"))) == 1:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        teacher_text_file(MHA8, ts, out, partial, torch.device("cpu"), stop_in_second)
    again = teacher_text_file(MHA8, ts, out, partial, torch.device("cpu"), lambda line: None)
    assert out.read_text() == whole.read_text() and again["tokens"] == made["tokens"]


def test_a_continued_generation_rates_only_the_tokens_made_now(tmp_path, monkeypatch):
    # 2 of 3 batches kept from a stopped run: the rerun makes 512 tokens. Its returned rate and every progress
    # line's rate count those alone (a clock that ticks 1 s a reading), its progress those and the kept ones.
    import functools
    import itertools
    import torch
    from uptrain.data import TeacherSamples
    from uptrain.train.model import teacher_samples
    from uptrain.train.model.teacher_samples import teacher_text_file

    monkeypatch.setenv("UPTRAIN_PROGRESS_EVERY", "0")
    ts = TeacherSamples(tokens=1500, max_new_tokens=64, batch=8, seed=5)  # 3 batches of 8 x 64
    partial, out = tmp_path / ".partial", tmp_path / "samples.jsonl"

    def stop_in_third(line: str) -> None:
        if " of " in line and len(list((partial / "chunks").glob("chunk-*.json"))) == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        teacher_text_file(MHA8, ts, out, partial, torch.device("cpu"), stop_in_third)
    kept = sum(row["new_tokens"] for i in range(2) for row in json.loads(
        (partial / "chunks" / f"chunk-{i:06d}.json").read_text())["rows"])
    ticks = itertools.count()
    monkeypatch.setattr(teacher_samples, "timed_progress",
                        functools.partial(teacher_samples.timed_progress, clock=lambda: float(next(ticks))))
    lines: list[str] = []
    made = teacher_text_file(MHA8, ts, out, partial, torch.device("cpu"), lines.append)
    assert made["batches_reused"] == 2 and made["tokens_made"] == made["tokens"] - kept == 512, made
    assert made["tokens_per_s"] == pytest.approx(512 / made["seconds"])  # before: all 1,536 tokens over these seconds
    progress = [re.match(r"teacher samples: ([\d,]+) of 1,500 tokens \(\d+%\), ([\d,]+) tokens/s", line)
                for line in lines[1:]]
    assert len(progress) == 64 and all(progress), lines[:3]
    for j, m in enumerate(progress, start=1):  # the clock read at creation (0), its last line (1), then each step
        so_far = int(m.group(1).replace(",", ""))
        assert so_far == min(kept + 8 * j, 1500)
        assert m.group(2) == f"{8 * j / (1 + j):,.0f}", (j, m.group(0))  # not (kept + 8 j) / (1 + j)
