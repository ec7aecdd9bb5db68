"""The README's main job runs on what ships in the repository (no ../shared needed)."""

import json
import re
import shutil

import pytest
import torch

from conftest import EXAMPLE_MHA8, TRAIN_TXT, VALID_TXT, built_gqa4
from uptrain.data import DataSource, read_documents
from uptrain.demo import default_kv_heads, main
from uptrain.measure.eval import evaluate_paths


def test_demo_converts_uptrains_and_reports(tmp_path, capsys):
    # 10 items per task (the demo's default: 50): lm-eval's scoring of 3 models was half of this test's time
    assert main(["--out", str(tmp_path / "demo"), "--stories", "3", "--calib-tokens", "4096", "--refine-steps", "40",
                 "--task-limit", "10", "budget.tokens=16384", "optim.warmup_steps=2", "log.progress_bar=false"]) == 0
    out, _, tasks = capsys.readouterr().out.partition("lm-eval task scores")  # loss table, then task table
    losses = {name: float(loss) for name, loss in
              re.findall(r"\| (MHA source|GQA-2, converted|GQA-2, uptrained)[^|]*\| ([0-9.]+)", out)}
    assert set(losses) == {"MHA source", "GQA-2, converted", "GQA-2, uptrained"}
    assert losses["MHA source"] < losses["GQA-2, uptrained"] < losses["GQA-2, converted"]
    # fidelity to the source beside the loss: the source itself exactly 0 / 100%, the uptraining (distilled
    # from the source) brings the converted model closer to it
    fidelity = {name: (float(kl), float(top1)) for name, kl, top1 in re.findall(
        r"\| (MHA source|GQA-2, converted|GQA-2, uptrained)[^|]*\|[^|]+\|[^|]+\| ([0-9.]+) +\| ([0-9.]+)%", out)}
    assert fidelity["MHA source"] == (0.0, 100.0)
    assert 0 < fidelity["GQA-2, uptrained"][0] < fidelity["GQA-2, converted"][0]
    assert "KL(source || model)" in out and "warning:" not in out  # the source models its own kind of text
    assert "| 4x " in out and (tmp_path / "demo" / "uptrain" / "model" / "config.json").is_file()
    # the bundled lm-eval tasks, scored on all three models (accuracies in [0, 1] with stderrs)
    rows = re.findall(r"\| (MHA source|GQA-2, converted|GQA-2, uptrained)[^|]*\| ([0-9.]+) ± ([0-9.]+)", tasks)
    assert [r[0] for r in rows] == ["MHA source", "GQA-2, converted", "GQA-2, uptrained"]
    assert all(0.0 <= float(acc) <= 1.0 for _, acc, _ in rows)
    assert "stories_name/exact_match ± stderr" in tasks  # the generating task: greedy text, not log-likelihoods
    # the refinement's line per layer is uptrain.convert's, with the layers done and the time left
    assert re.search(r"\n   refine layer 4: held-out error [0-9.]+ -> [0-9.]+ .*\[5/5 layers, ~\d+ s left\]", out)


def test_stories_counts_whole_stories_not_lines(tmp_path, capsys):
    # Stories of two paragraphs each, one line per paragraph, a blank line between stories.
    stories = ["Tom had a red ball.\nHe threw it to his dog, and the dog ran fast to get it.",
               "Lily saw a big tree.\nShe sat under it and read a book about a little bird.",
               "The sun was hot.\nSam and Mia went to the lake to swim with their mom."]
    valid = tmp_path / "valid.txt"
    valid.write_text("\n\n".join(stories) + "\n")
    assert main(["--out", str(tmp_path / "demo"), "--skip-uptrain", "--valid", str(valid), "--stories", "2", "--refine-steps", "0",
                 "--tasks", "none"]) == 0
    out = capsys.readouterr().out
    assert "(2 stories," in out
    shown = float(re.search(r"\| MHA source[^|]*\| ([0-9.]+)", out).group(1))
    (whole,) = evaluate_paths([str(EXAMPLE_MHA8)], stories[:2], max_length=512, stride=256)
    assert shown == round(whole.loss, 3)  # the first two stories, each scored whole


def test_default_kv_heads_is_a_quarter_that_divides_both_head_counts():
    for heads in (*range(1, 65), 32, 40, 64, 96, 128):
        for kv in (k for k in range(2, heads + 1) if heads % k == 0):
            got = default_kv_heads(heads, kv)
            ok = [n for n in range(1, max(1, kv // 4) + 1) if kv % n == 0 and heads % n == 0]
            assert got == max(ok), (heads, kv)
    assert (default_kv_heads(8, 8), default_kv_heads(32, 32), default_kv_heads(40, 40), default_kv_heads(32, 8)) == \
        (2, 8, 10, 2)


def test_own_model_and_text_convert_uptrain_and_report(tmp_path, capsys):
    # "your model": the real stories260K with its 4 K/V heads, in a folder of its own;
    # "your text": a copy of the training sample under another name
    model = tmp_path / "my-model"
    shutil.copytree(built_gqa4(), model)
    text = tmp_path / "my-text.txt"
    text.write_text(TRAIN_TXT.read_text())
    out = tmp_path / "demo"
    assert main(["--model", str(model), "--data", str(text), "--out", str(out), "--stories", "3",
                 "--calib-tokens", "2048", "--refine-steps", "20", "--tasks", "none", "budget.tokens=16384", "optim.warmup_steps=2",
                 "log.progress_bar=false"]) == 0
    printed = capsys.readouterr().out
    assert "recipe: peak lr 0.0003" in printed and "lr_sweep" in printed  # the lr it chose and how to choose better
    losses = {name: float(loss) for name, loss in
              re.findall(r"\| (GQA source \(4 K/V heads\)|GQA-1, converted|GQA-1, uptrained)[^|]*\| ([0-9.]+)",
                         printed)}
    assert len(losses) == 3, printed  # a quarter of 4 K/V heads: 1
    assert losses["GQA-1, uptrained"] < losses["GQA-1, converted"]
    assert "| 4x " in printed and f"{text}, its last tenth (3 documents" in printed
    # the last tenth of the documents is held out whole and never trained on
    docs = read_documents(DataSource(files=[str(text)]))
    train = [json.loads(line)["text"] for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    valid = [json.loads(line)["text"] for line in (out / "data" / "valid.jsonl").read_text().splitlines()]
    assert train + valid == docs and len(valid) == round(len(docs) / 10)
    assert (out / "my-model-gqa1" / "config.json").is_file() and (out / "uptrain" / "model" / "config.json").is_file()


def test_own_model_that_cannot_be_converted_is_refused_in_one_line(tmp_path, capsys):
    from transformers import GPT2Config
    from uptrain.convert.registry.architectures import family_for
    from uptrain.errors import UsageError

    model = tmp_path / "gpt2-tiny"
    GPT2Config(n_layer=1, n_embd=32, n_head=4, vocab_size=64).save_pretrained(model)
    with pytest.raises(UsageError) as registry:
        family_for(json.loads((model / "config.json").read_text()))
    assert main(["--model", str(model), "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {registry.value}\n"  # the registry's own message, one line
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("content", ["", "one story and nothing else\n"])
def test_own_text_that_cannot_be_used_is_refused_in_one_line(tmp_path, capsys, content):
    text = tmp_path / "mine.txt"
    text.write_text(content)
    assert main(["--data", str(text), "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "mine.txt" in err
    assert not (tmp_path / "demo" / "stories260K-gqa2").exists()


def _short_context_model(tmp_path):
    """The real stories260K (4 K/V heads) with a 128-position context, in a folder of its own."""
    model = tmp_path / "short-model"
    shutil.copytree(built_gqa4(), model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 128
    (model / "config.json").write_text(json.dumps(config))
    return model


def test_own_model_is_scored_within_its_context_as_uptrain_eval_scores_it(tmp_path, capsys):
    # A model with 128 positions: the demo scored it in 512-token windows (beyond its context, a
    # number uptrain.eval refuses to make); now in 128-token windows, equal to uptrain.eval's.
    from uptrain.measure.eval import main as eval_main

    model = _short_context_model(tmp_path)
    text = tmp_path / "mine.txt"
    text.write_text(TRAIN_TXT.read_text())
    out = tmp_path / "demo"
    assert main(["--model", str(model), "--data", str(text), "--out", str(out), "--stories", "3", "--skip-uptrain",
                 "--method", "mean", "--refine-steps", "0", "--calib-tokens", "0"]) == 0
    printed = capsys.readouterr().out
    assert "128-token windows, stride 64: the model's context" in printed, printed
    shown = {name: float(loss) for name, loss in
             re.findall(r"\| (GQA source \(4 K/V heads\)|GQA-1, converted)[^|]*\| ([0-9.]+)", printed)}
    valid = out / "data" / "valid.jsonl"
    stories = [json.loads(line)["text"] for line in valid.read_text().splitlines()][:3]
    subset = tmp_path / "valid3.jsonl"
    subset.write_text("".join(json.dumps({"text": t}) + "\n" for t in stories))
    assert eval_main([str(model), str(out / "short-model-gqa1"), "--data", str(subset),
                      "--json", str(tmp_path / "eval.json")]) == 0
    records = json.loads((tmp_path / "eval.json").read_text())
    assert records[0]["max_length"] == 128
    assert [round(r["loss"], 3) for r in records] == [shown["GQA source (4 K/V heads)"], shown["GQA-1, converted"]]
    # the bundled TinyStories tasks are not run on a model of the user's by default, and it says how to choose
    assert "lm-eval task scores" not in printed and "--tasks" in printed


def test_a_kv_count_the_model_cannot_take_is_refused_before_anything_is_printed(tmp_path, capsys):
    assert main(["--kv-heads", "3", "--out", str(tmp_path / "demo")]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.startswith("error: 3 does not divide the 8 K/V heads"), captured
    assert not (tmp_path / "demo").exists()


def test_out_replaces_an_earlier_demo_whole_and_refuses_another_folder(tmp_path, capsys):
    out = tmp_path / "demo"
    argv = ["--out", str(out), "--skip-uptrain", "--stories", "1", "--method", "mean", "--refine-steps", "0",
            "--calib-tokens", "0", "--tasks", "none"]
    assert main(argv) == 0
    (out / "left-from-before.txt").write_text("old")
    assert main(argv) == 0  # the same demo again: its finished steps kept (tests/test_demo_stop.py: continued)
    assert "holds this same demo's finished steps (convert" in capsys.readouterr().out
    assert main([*argv, "--kv-heads", "4"]) == 0  # another demo into the folder
    assert not (out / "left-from-before.txt").exists()  # replaced whole, not mixed
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main([*argv[2:], "--out", str(other)]) == 2
    assert "not make" in capsys.readouterr().err and (other / "notes.txt").read_text() == "mine"


def test_the_demo_converts_as_uptrain_convert_with_the_same_options(tmp_path, capsys):
    """One rule for which conversions read the calibration text: mean pooling with similar-head grouping
    is calibrated by the demo as by uptrain.convert (the demo once calibrated only fit and refine)."""
    from safetensors.torch import load_file

    from uptrain.convert.__main__ import main as convert_main

    assert main(["--out", str(tmp_path / "demo"), "--method", "mean", "--grouping", "similar", "--calib-tokens", "4096",
                 "--refine-steps", "0", "--skip-uptrain", "--tasks", "none", "--stories", "1"]) == 0
    assert "calibrated on 4,096 tokens" in capsys.readouterr().out
    assert convert_main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "mean", "--grouping", "similar", "--calib",
                         str(TRAIN_TXT), "--calib-tokens", "4096", "--out", str(tmp_path / "plain")]) == 0
    ours, plain = (load_file(next(f.glob("*.safetensors"))) for f in (tmp_path / "demo" / "stories260K-gqa2",
                                                                       tmp_path / "plain"))
    assert ours.keys() == plain.keys() and all(torch.equal(ours[k], plain[k]) for k in ours)
    choice = [json.loads((f / "uptrain_conversion.json").read_text())["grouping_choice"]
              for f in (tmp_path / "demo" / "stories260K-gqa2", tmp_path / "plain")]
    assert choice[0] == choice[1] and len(choice[0]) == 5  # each layer's grouping measured, as convert measures it


def _outside_model(tmp_path):
    """A model not in this repository: a Mistral (8 query heads over 4 K/V heads) made from the stories260K
    weights with 3% noise on every matrix, with the stories tokenizer: another family and other weights,
    which still writes (and models) stories of its own."""
    from transformers import AutoModelForCausalLM, MistralConfig

    llama = AutoModelForCausalLM.from_pretrained(built_gqa4(), dtype=torch.float32)
    c = llama.config
    cfg = MistralConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                      num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                      num_key_value_heads=c.num_key_value_heads, max_position_embeddings=c.max_position_embeddings,
                        rms_norm_eps=c.rms_norm_eps, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
                        head_dim=c.head_dim, sliding_window=None, rope_parameters=dict(c.rope_parameters))
    model = AutoModelForCausalLM.from_config(cfg)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        weights = llama.state_dict()
        for name, p in model.named_parameters():
            w = weights[name]
            p.copy_(w + 0.03 * w.std() * torch.randn(w.shape, generator=gen) if w.dim() == 2 else w)
    folder = tmp_path / "outside-mistral"
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EXAMPLE_MHA8 / name, folder / name)
    return folder


def test_teacher_samples_run_the_demo_end_to_end_with_no_training_text(tmp_path, capsys):
    model = _outside_model(tmp_path)
    out = tmp_path / "demo"
    assert main(["--model", str(model), "--teacher-samples", "6000", "--out", str(out), "--calib-tokens", "8192",
                 "--refine-steps", "20", "budget.tokens=8192", "optim.warmup_steps=2", "log.progress_bar=false"]) == 0
    printed = capsys.readouterr().out
    # said before sampling: the budget trains on the samples more than once
    assert "the uptraining's budget is 8,192 tokens: the 6,000 sample tokens are trained on about 1.4 times" in printed
    assert printed.index("trained on about 1.4 times") < printed.index("teacher samples: generating")
    assert re.search(r"teacher samples: generating 6,000 tokens, \d+ sequences at a time", printed), printed
    samples = [json.loads(line)["text"] for line in (out / "data" / "samples.jsonl").read_text().splitlines()]
    train = [json.loads(line)["text"] for line in (out / "data" / "train.jsonl").read_text().splitlines()]
    valid = [json.loads(line)["text"] for line in (out / "data" / "valid.jsonl").read_text().splitlines()]
    assert train + valid == samples and len(valid) == round(len(samples) / 10)  # the last tenth held out, whole
    rows = dict(re.findall(r"\| (GQA source \(4 K/V heads\)|GQA-1, converted|GQA-1, uptrained)[^|]*\| ([0-9.]+)",
                           printed))
    assert len(rows) == 3, printed  # a quarter of 4 K/V heads: 1
    kl = dict(re.findall(r"\| (GQA-1, converted|GQA-1, uptrained)[^|]*\|[^|]+\|[^|]+\| ([0-9.]+)", printed))
    assert float(kl["GQA-1, uptrained"]) < float(kl["GQA-1, converted"])  # distilled on the source's own text
    # the header asks for 8,192; the training part of the samples holds fewer: the real count and a warning
    assert "calibrated on up to 8,192 tokens of train.jsonl" in printed
    assert re.search(r"warning: calibrated on [0-9,]+ tokens, not the 8,192 asked", printed), printed
    assert re.search(r"\(\d+ documents", printed) and "stories" not in printed.split("Held-out loss")[1].split("\n")[0]
    assert not (tmp_path / ".demo.teacher-samples").exists()  # the kept batches are gone once the text is whole


def test_teacher_samples_and_data_together_are_refused_in_one_line(tmp_path, capsys):
    assert main(["--teacher-samples", "100", "--data", str(TRAIN_TXT), "--out", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--teacher-samples" in err[0] and "not both" in err[0], err
    assert not (tmp_path / "demo").exists()


@pytest.mark.parametrize("bad", ["valid", "override"])
def test_teacher_samples_wait_for_every_check_that_needs_no_sample(tmp_path, capsys, bad):
    """--valid (here empty) and the uptraining's overrides (here a mistyped key) are refused before the first
    sample is drawn and before --out is made (on a 7B model sampling takes hours)."""
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    out = tmp_path / "demo"
    extra = ["--valid", str(empty)] if bad == "valid" else ["optim.lrr=3e-4"]
    assert main(["--model", str(_outside_model(tmp_path)), "--teacher-samples", "6000", "--out", str(out), *extra]) == 2
    captured = capsys.readouterr()
    assert ("is empty" if bad == "valid" else "optim.lrr") in captured.err and len(captured.err.strip().splitlines()) == 1
    assert "teacher samples" not in captured.out and not out.exists() and not (tmp_path / ".demo.teacher-samples").exists()


def test_convert_and_the_sweep_warn_when_the_calibration_text_is_shorter_than_asked(tmp_path, capsys):
    from uptrain.convert.__main__ import main as convert_main
    from uptrain.sweep.run import main as sweep_main

    short = tmp_path / "short.txt"
    short.write_text(TRAIN_TXT.read_text()[:600])
    assert convert_main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(short),
                         "--calib-tokens", "4096", "--out", str(tmp_path / "kv2")]) == 0
    assert re.search(r"warning: calibrated on \d+ tokens, not the 4,096 asked", capsys.readouterr().err)
    valid = tmp_path / "valid.txt"
    valid.write_text(VALID_TXT.read_text().split("\n\n")[0])
    assert sweep_main([str(EXAMPLE_MHA8), "--data", str(valid), "--kv-heads", "2", "--method", "fit", "--calib",
                       str(short), "--calib-tokens", "4096", "--threads", "1", "--out", str(tmp_path / "sweep")]) == 0
    assert re.search(r"warning: calibrated on \d+ tokens, not the 4,096 asked", capsys.readouterr().out)


def test_a_source_that_copies_across_its_window_is_uptrained_in_blocks_of_it(tmp_path, capsys):
    """examples/copy-mha8 reads a passage again 191 tokens later almost for free: the demo's uptraining
    trains it in blocks of its 512-token window (2 a micro-batch x 2, the same tokens a step; half of them
    with a passage read again), where the config's 128-token blocks would never show it a repeat that
    far (results/copy-conversions.md);
    stories260K-mha8 barely copies and keeps the config's blocks. A user's data.seq_len decides alone."""
    from types import SimpleNamespace

    import yaml

    from uptrain.demo.steps import training_blocks

    copier = EXAMPLE_MHA8.parent / "copy-mha8"
    assert main(["--model", str(copier), "--out", str(tmp_path / "demo"), "--calib-tokens", "2048",
                 "--refine-steps", "10", "--tasks", "none", "--stories", "2", "--context-tail", "4096",
                 "budget.tokens=4096", "log.progress_bar=false"]) == 0
    out = capsys.readouterr().out
    # its uptraining's blocks are its window already: --context-tail adds no run and no row, and says so
    assert "== context tail: none; the uptraining's blocks were the model's whole window already (512" in out
    assert not (tmp_path / "demo" / "context").exists() and "tokens at 512" not in out
    # the config's 8 x 2 blocks of 128 a step as 2 x 2 of 512; on the CPU in one micro batch (4 x 1: one_micro_batch)
    micro, accum = (4, 1) if not torch.cuda.is_available() else (2, 2)
    assert re.search(rf"training blocks: 512 tokens, {micro} per micro-batch, 50% of them with a passage read again "
                     r"\(data.copy_repeats\): the source copies across its window .* 191 tokens later removes "
                     r"(8\d|9\d)% of its loss", out)
    run = yaml.safe_load((tmp_path / "demo" / "uptrain" / "run.yaml").read_text())
    assert (run["data"]["seq_len"], run["batch"]["micro_batch"], run["batch"]["grad_accum"],
            run["data"]["copy_repeats"]) == (512, micro, accum, 0.5)
    assert training_blocks(SimpleNamespace(overrides=[]), EXAMPLE_MHA8, TRAIN_TXT) == []
    assert re.search(r"training blocks: 128 tokens \(the config's\): .* removes \d% of its loss", capsys.readouterr().out)
    assert training_blocks(SimpleNamespace(overrides=["data.seq_len=256"]), copier, TRAIN_TXT) == []
    assert capsys.readouterr().out == ""  # the user's blocks: no probe, no line


def test_the_calibration_default_follows_the_training_text():
    """65,536 tokens (measured better than 16,384: results/quality-curve.md); with --teacher-samples N at
    most N/2, so the samples' training part holds them; as asked when asked."""
    from uptrain.demo.run import calib_tokens
    assert calib_tokens(None, None) == 65536
    assert calib_tokens(None, 3_600_000) == 65536
    assert calib_tokens(None, 6000) == 3000
    assert calib_tokens(4096, 3_600_000) == 4096 and calib_tokens(0, None) == 0


def test_the_context_tail_trains_the_uptrained_model_in_blocks_of_the_models_window(tmp_path, capsys):
    """--context-tail N: a second trainer run from the uptrained model, N tokens in blocks of the model's
    scoring window (512 for the bundled model, not the config's 128), as many tokens a step, TAIL_LR of
    the peak lr; its model is the table's last row. Refused in one line, before --out is made, where
    the window is no longer than the blocks or nothing is uptrained."""
    import yaml

    from uptrain.demo.steps import TAIL_LR
    from uptrain.train.model.cpu_attention import suits_this_machine

    out = tmp_path / "demo"
    assert main(["--out", str(out), "--stories", "2", "--calib-tokens", "1024", "--refine-steps", "5", "--tasks", "none",
                 "--context-tail", "4096", "budget.tokens=4096", "optim.lr=5e-4", "log.progress_bar=false"]) == 0
    printed = capsys.readouterr().out
    assert "== context tail: 4,096 tokens more in 512-token blocks (the model's window)" in printed
    main_run, tail = (yaml.safe_load((out / d / "run.yaml").read_text()) for d in ("uptrain", "context"))
    assert (main_run["data"]["seq_len"], tail["data"]["seq_len"]) == (128, 512)
    # both runs' attention by hand in bfloat16 where this machine suits it (a CPU run, bfloat16 products)
    assert main_run["bf16_attention"] is tail["bf16_attention"] is suits_this_machine()
    assert ("bf16_attention=true: this CPU multiplies bfloat16" in printed) is suits_this_machine()
    assert tail["batch"]["micro_batch"] * 512 == main_run["batch"]["micro_batch"] * 128  # the same tokens a micro step
    # on the CPU a step's blocks go in one micro batch (the config's 8 x 2 as 16 x 1), in both runs; not with CUDA
    on_cpu = not torch.cuda.is_available()
    assert [(r["batch"]["micro_batch"], r["batch"]["grad_accum"]) for r in (main_run, tail)] == (
        [(16, 1), (4, 1)] if on_cpu else [(8, 2), (2, 2)])
    assert ("batch.micro_batch=16 batch.grad_accum=1: on the CPU a step's blocks go in one micro batch" in printed) \
        is on_cpu
    assert tail["model"] == str(out / "uptrain" / "model") and tail["budget"]["tokens"] == 4096
    assert tail["optim"]["lr"] == pytest.approx(5e-4 * TAIL_LR) and tail["distill"] == main_run["distill"]
    # the uptraining's cosine stops where the tail starts (TAIL_LR of the peak); the tail decays as the config's
    assert (main_run["optim"]["min_lr_ratio"], tail["optim"]["min_lr_ratio"]) == (TAIL_LR, 0.1)
    assert "with --context-tail: the cosine stops at 0.4 x the peak lr" in printed
    rows = re.findall(r"\| (GQA-2, uptrained[^|]*|GQA-2, \+ 4,096 tokens at 512[^|]*)\| ([0-9.]+)", printed)
    assert [r[0].strip() for r in rows] == ["GQA-2, uptrained, distilled alpha_kd 1.0", "GQA-2, + 4,096 tokens at 512"]
    from safetensors.torch import load_file

    before, after = (load_file(out / d / "model" / "model.safetensors") for d in ("uptrain", "context"))
    assert any(not before[k].equal(after[k]) for k in before)  # trained further, from the uptrained weights
    for extra, said in ((["--skip-uptrain"], "--context-tail continues the uptraining"),
                        (["data.seq_len=512", "batch.micro_batch=2"], "no longer than the uptraining's blocks")):
        bad = tmp_path / "bad"
        assert main(["--out", str(bad), "--context-tail", "4096", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and said in err[0], err
        assert not bad.exists()


def test_the_context_tail_hands_off_the_learning_rate_unless_the_user_set_its_floor(tmp_path):
    """With --context-tail the uptraining's cosine stops at TAIL_LR of its peak and the tail runs from there
    to the config's floor; a user's optim.min_lr_ratio holds for both runs; a block frame at the window
    (no tail follows) keeps the config's floor; without --context-tail nothing changes."""
    from types import SimpleNamespace

    from uptrain.demo.steps import CONFIG, TAIL_LR, context_overrides, uptrain_overrides
    from uptrain.train.config import load_config

    def floors(tail, overrides, frame=()):
        args = SimpleNamespace(alpha_kd=None, overrides=overrides, context_tail=tail)
        main_run = uptrain_overrides(args, EXAMPLE_MHA8, EXAMPLE_MHA8, TRAIN_TXT, VALID_TXT, 1, tmp_path / "u", frame)
        first = load_config(CONFIG, main_run).optim
        second = load_config(CONFIG, context_overrides(args, main_run, 512)).optim if tail and not frame else None
        return first.min_lr_ratio, second and (second.lr / first.lr, second.min_lr_ratio)

    assert floors(4096, []) == (TAIL_LR, (pytest.approx(TAIL_LR), 0.1))
    assert floors(4096, ["optim.min_lr_ratio=0.25"]) == (0.25, (pytest.approx(TAIL_LR), 0.25))
    assert floors(4096, [], frame=["data.seq_len=512", "batch.micro_batch=2"])[0] == 0.1
    assert floors(None, []) == (0.1, None)


def test_the_demo_trains_with_the_attention_this_machine_suits_unless_told(monkeypatch, tmp_path):
    """The demo adds bf16_attention=true where `suits_this_machine` (a CPU run on a CPU that multiplies
    bfloat16) and nothing elsewhere; a user's bf16_attention, either way, is the one the run gets."""
    from types import SimpleNamespace

    import uptrain.train.model.cpu_attention as cpu_attention
    from uptrain.demo.steps import CONFIG, uptrain_overrides
    from uptrain.train.config import load_config

    def attention(suits: bool, overrides: list[str]) -> bool:
        monkeypatch.setattr(cpu_attention, "suits_this_machine", lambda: suits)
        args = SimpleNamespace(alpha_kd=None, overrides=overrides, context_tail=None)
        made = uptrain_overrides(args, EXAMPLE_MHA8, EXAMPLE_MHA8, TRAIN_TXT, VALID_TXT, 1, tmp_path / "u")
        return load_config(CONFIG, made).bf16_attention

    assert attention(True, []) is True and attention(False, []) is False
    assert attention(True, ["bf16_attention=false"]) is False and attention(False, ["bf16_attention=true"]) is True


def test_the_demo_puts_a_cpu_steps_blocks_in_one_micro_batch_unless_told(monkeypatch, tmp_path):
    """On a CPU run the demo trains the config's micro_batch x grad_accum blocks as one micro batch (the same
    step: tests/train/test_train.py checks the losses); with CUDA, or where the user set batch.micro_batch or
    batch.grad_accum, the config's and the user's batches hold."""
    from types import SimpleNamespace

    from uptrain.demo.steps import CONFIG, uptrain_overrides
    from uptrain.train.config import load_config

    def batches(cuda: bool, overrides: list[str]) -> tuple[int, int]:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        args = SimpleNamespace(alpha_kd=None, overrides=overrides, context_tail=None)
        batch = load_config(CONFIG, uptrain_overrides(args, EXAMPLE_MHA8, EXAMPLE_MHA8, TRAIN_TXT, VALID_TXT, 1,
                                                      tmp_path / "u")).batch
        return batch.micro_batch, batch.grad_accum

    config = load_config(CONFIG, []).batch
    assert (config.micro_batch, config.grad_accum) == (8, 2)
    assert batches(False, []) == (16, 1) and batches(True, []) == (8, 2)
    assert batches(False, ["batch.grad_accum=4"]) == (8, 4) and batches(False, ["batch.micro_batch=2"]) == (2, 2)
