"""Perplexity: windows, a hand-computable case, and the MHA/GQA demo pair on real text."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from uptrain.errors import UsageError
from uptrain.data import DataSource, read_documents
from uptrain.measure.eval import evaluate, evaluate_paths, main, sequence_nll, window_spans

from conftest import EXAMPLE_MHA8, VALID_TXT as VALID, built_gqa4


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def tiny_llama(vocab: int = 97, seed: int = 0) -> LlamaForCausalLM:
    """A random float64 Llama small enough to score by hand-written reference code."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).double().eval()


def test_windows_score_every_token_once() -> None:
    for n in range(0, 40):
        for max_length in (2, 3, 7, 16):
            for stride in range(1, max_length):
                spans = window_spans(n, max_length, stride)
                scored = [t for _, end, first in spans for t in range(first, end)]
                assert scored == list(range(1, n))
                assert all(end - begin <= max_length and first > begin for begin, end, first in spans)


def test_windows_reject_bad_numbers() -> None:
    with pytest.raises(UsageError):
        window_spans(10, 8, 8)  # no overlap: the token at each window start would be skipped
    with pytest.raises(UsageError):
        window_spans(10, 1, 1)


def test_uniform_logits_give_ln_vocab() -> None:
    model = tiny_llama(vocab=97)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    docs = [torch.randint(0, 97, (n,)) for n in (5, 33, 70)]
    for max_length, stride in ((128, 64), (16, 5)):
        result = evaluate(model, docs, max_length, stride)
        assert result.tokens == 4 + 32 + 69
        assert abs(result.loss - math.log(97)) < 1e-12
        assert abs(result.perplexity - 97) < 1e-9


def test_one_window_equals_full_context_loss() -> None:
    model = tiny_llama()
    ids = torch.randint(0, 97, (1, 50))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], dim=-1)  # [49, vocab], float64
        reference = -logp.gather(1, ids[0, 1:, None]).mean().item()  # full context, 49 targets
    for max_length, stride in ((50, 25), (64, 1), (128, 100)):
        nll, n = sequence_nll(model, ids, max_length, stride)
        assert n == 49
        assert abs(nll / n - reference) < 1e-12
    # Shorter windows see less context: a different (but valid) number.
    nll, n = sequence_nll(model, ids, 8, 4)
    assert n == 49 and abs(nll / n - reference) > 1e-9


def test_mha8_and_gqa4_have_the_same_perplexity() -> None:
    texts = read_documents(DataSource(files=[str(VALID)]))
    mha, gqa = evaluate_paths([str(EXAMPLE_MHA8), str(built_gqa4())],
                              texts, max_length=512, stride=256)
    assert mha.tokens == gqa.tokens > 10_000
    assert abs(mha.perplexity - gqa.perplexity) < 1e-4
    assert 1.0 < mha.loss < 2.5  # a trained model on its own domain


def test_cli_json_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "eval.json"
    rc = main([str(built_gqa4()), "--data", str(VALID), "--max-documents", "2",
               "--max-length", "64", "--stride", "32", "--json", str(out)])
    assert rc == 0
    (row,) = json.loads(out.read_text())
    assert row["documents"] == 2 and row["max_length"] == 64 and row["perplexity"] > 1
    printed = capsys.readouterr().out
    assert "perplexity" in printed
    # what this loss is beside the trainer's val loss (they differ on the same text: both say why)
    assert "max_length 64, stride 32: each document scored on its own" in printed
    assert "the trainer's val loss packs documents end to end into seq_len blocks" in printed

    assert main([str(tmp_path / "missing-model"), "--data", str(VALID)]) == 2
    assert main([str(built_gqa4()), "--data", str(tmp_path / "missing.txt")]) == 2
    assert main([str(built_gqa4()), "--data", str(VALID), "--stride", "zero"]) == 2
    assert main([str(built_gqa4()), "--data", str(VALID), "--max-length", "1024"]) == 2  # ctx 512
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 4 and all(line.startswith("error: ") for line in err)


def test_text_unit_decides_what_a_document_is(tmp_path: Path) -> None:
    # Two stories of two paragraphs: paragraphs (default) give 2 documents, lines 4, the file 1.
    data = tmp_path / "stories.txt"
    data.write_text("Tom had a red ball.\nHe threw it far.\n\nLily saw a tree.\nShe sat under it.\n")
    documents = {}
    for unit in (None, "line", "paragraph", "file"):
        out = tmp_path / f"{unit}.json"
        flag = ["--text-unit", unit] if unit else []
        assert main([str(EXAMPLE_MHA8), "--data", str(data), *flag, "--json", str(out)]) == 0
        (row,) = json.loads(out.read_text())
        documents[unit] = row["documents"]
    assert documents == {None: 2, "line": 4, "paragraph": 2, "file": 1}
    assert main([str(EXAMPLE_MHA8), "--data", str(data), "--text-unit", "sentence"]) == 2  # names the choices


def test_a_mistyped_model_folder_or_a_run_folder_gets_a_suggestion(tmp_path, capsys):
    """Issue 22: a typo names the near folder; a training run's folder points at its /model."""
    run = tmp_path / "runs" / "demo-cpu"
    (run / "checkpoints").mkdir(parents=True)
    shutil.copytree(built_gqa4(), run / "model")
    assert main([str(tmp_path / "runs" / "demo-cpv"), "--data", str(VALID)]) == 2
    assert main([str(run), "--data", str(VALID)]) == 2
    typo, whole_run = capsys.readouterr().err.strip().splitlines()
    assert f"did you mean {run}?" in typo
    assert f"did you mean {run / 'model'}" in whole_run and "final model" in whole_run


def test_data_errors_name_the_command_line_options(capsys, monkeypatch):
    """Issue 22: eval's errors named the trainer's config keys; compare's did not name --data/--dataset."""
    from uptrain.measure import compare

    gqa = str(built_gqa4())
    assert main([gqa]) == 2
    assert compare.main([str(EXAMPLE_MHA8), gqa]) == 2
    for line in capsys.readouterr().err.strip().splitlines():
        assert "--data" in line and "--dataset" in line, line
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)  # a Hub nobody answers
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    assert main([gqa, "--dataset", "org/data"]) == 2
    err = capsys.readouterr().err
    assert "--data FILE" in err and "data.train.files" not in err, err


@pytest.mark.parametrize("reference", [False, True])
def test_scoring_is_never_silent(reference, monkeypatch, capsys) -> None:
    """Issue 50: `uptrain.eval` was silent for the whole scoring of each model. With a line allowed
    at any moment (UPTRAIN_PROGRESS_EVERY=0), every window scored but the last of a model gives one,
    tokens growing to the total, with and without a reference. Red when the windows do not tick."""
    import re

    monkeypatch.setenv("UPTRAIN_PROGRESS_EVERY", "0")
    texts = read_documents(DataSource(files=[str(VALID)]))[:3]
    results = evaluate_paths([str(EXAMPLE_MHA8)], texts, max_length=64, stride=32,
                             reference=str(EXAMPLE_MHA8) if reference else None)
    lines = [line for line in capsys.readouterr().err.splitlines() if "tokens scored" in line]
    counts = [tuple(int(x.replace(",", "")) for x in re.search(r"([\d,]+) of ([\d,]+) tokens", line).groups())
              for line in lines]
    windows = sum(len(window_spans(n, 64, 32)) for n in (len(t) for t in _token_ids(texts)))
    assert len(counts) == windows - 1 > 10
    assert all(total == results[0].tokens for _, total in counts)
    assert [done for done, _ in counts] == sorted({done for done, _ in counts}) and counts[-1][0] < results[0].tokens
    assert all(line.startswith("  model 1/1: ") and line.endswith(" s left") for line in lines)


def test_scoring_progress_writes_a_line_per_interval_not_per_window(monkeypatch, capsys) -> None:
    """Issue 60: the progress clock was never reset, so once the first interval had passed every window
    wrote a line (91 lines instead of 10). A scoring of 31 windows on a clock that moves 1 s per window,
    a line allowed every 3 s: one line at 3, 6, ..., 30 s (the last window writes none), each 3 s
    after the one before. Red when `ScoringProgress` does not restart its clock at each line."""
    import re
    import types

    from uptrain.measure import eval as eval_module

    clock = iter(range(10**6))  # 0 at the start, then one second per window scored
    monkeypatch.setattr(eval_module, "time", types.SimpleNamespace(monotonic=lambda: float(next(clock))))
    monkeypatch.setenv("UPTRAIN_PROGRESS_EVERY", "3")
    model, ids = tiny_llama(), torch.randint(0, 97, (32 + 16 * 30,), generator=torch.Generator().manual_seed(0))
    assert len(window_spans(len(ids), 32, 16)) == 31  # 31 tokens scored in the first window, 16 in each other
    progress = eval_module.ScoringProgress("model 1/1", len(ids) - 1)
    result = evaluate(model, [ids], max_length=32, stride=16, tick=progress)
    assert result.tokens == len(ids) - 1 == progress.done
    lines = [line for line in capsys.readouterr().err.splitlines() if "tokens scored" in line]
    seconds = [int(re.search(r"scored in (\d+) s", line)[1]) for line in lines]
    assert seconds == list(range(3, 31, 3)), lines
    done = [int(re.search(r"([\d,]+) of", line)[1].replace(",", "")) for line in lines]
    assert done == [31 + 16 * (s - 1) for s in seconds], lines


def _token_ids(texts: list[str]) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(EXAMPLE_MHA8)
    return [tokenizer(t)["input_ids"] for t in texts]
