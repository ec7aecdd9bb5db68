"""`--calib` measures the right thing: the attention input's moments, and they steer the fit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from conftest import EXAMPLE_MHA8, TRAIN_TXT
from tiny import random_model, save
from uptrain.convert import convert
from uptrain.convert.layers.calibrate import Calibration, read_calibration_texts


def documents(folder: Path, tokens: int) -> list[torch.Tensor]:
    """The calibration's token sequences, tokenized here: documents in order, the last one cut."""
    tokenizer = AutoTokenizer.from_pretrained(folder)
    out, used = [], 0
    for text in read_calibration_texts(TRAIN_TXT):
        ids = tokenizer(text)["input_ids"][: tokens - used]
        out.append(torch.tensor([ids]))
        used += len(ids)
        if used >= tokens:
            return out
    raise AssertionError("the calibration text is shorter than asked")


@torch.no_grad()
def test_moments_are_those_of_the_normed_layer_inputs(one_torch_thread):
    """Σ of layer i = mean of [x; 1][x; 1]ᵀ, x = input_layernorm(hidden state entering layer i),
    computed here from transformers' own output_hidden_states: not o_proj's input, the constant last."""
    tokens = 1200
    model = AutoModelForCausalLM.from_pretrained(EXAMPLE_MHA8, dtype=torch.float32).eval()
    seqs = documents(EXAMPLE_MHA8, tokens)
    assert all(s.shape[1] <= model.config.max_position_embeddings for s in seqs) and len(seqs) > 2
    hidden = [model(ids, output_hidden_states=True).hidden_states for ids in seqs]
    calibration = Calibration(TRAIN_TXT, tokens, layout="documents").bind(EXAMPLE_MHA8)  # one pass per document
    for i, layer in enumerate(model.model.layers):
        x = torch.cat([layer.input_layernorm(h[i])[0] for h in hidden]).double()
        x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
        torch.testing.assert_close(calibration.sigma(f"model.layers.{i}.self_attn."), x.T @ x / tokens,
                                   rtol=1e-6, atol=1e-8)
    assert calibration.record["tokens_used"] == tokens


def planted_model(folder: Path, rank: int = 6) -> Path:
    """A 1-layer MHA Llama (8 heads) whose token embeddings span only `rank` of its 64 dimensions,
    so its attention inputs have a planted low-rank covariance that Σ = I knows nothing about."""
    cfg = AutoConfig.for_model("llama", hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=8,
                               num_hidden_layers=1, intermediate_size=32, vocab_size=512,
                               max_position_embeddings=512, tie_word_embeddings=False)
    model = random_model(cfg, seed=3)
    gen = torch.Generator().manual_seed(4)
    basis, _ = torch.linalg.qr(torch.randn(64, rank, generator=gen))
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.randn(512, rank, generator=gen) @ basis.T)
        model.model.layers[0].input_layernorm.weight.fill_(1.0)
    save(model, folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(EXAMPLE_MHA8 / f, folder / f)
    return folder


@torch.no_grad()
def attention_error(original: Path, converted: Path, seqs: list[torch.Tensor]) -> float:
    """Mean squared difference of the attention outputs (layer 0) of two models on `seqs`."""
    outs = []
    for folder in (original, converted):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        got = []
        hook = model.model.layers[0].self_attn.register_forward_hook(lambda _m, _a, out: got.append(out[0]))
        for ids in seqs:
            model(ids)
        hook.remove()
        outs.append(torch.cat([g[0] for g in got]))
    return (outs[0] - outs[1]).pow(2).mean().item() / outs[0].pow(2).mean().item()


def test_calibration_steers_the_fit_to_the_planted_inputs(tmp_path, one_torch_thread):
    """With the planted covariance, `fit` calibrated on the text keeps the attention output on that
    text far better than `fit` with Σ = I (8 -> 2 K/V heads)."""
    src = planted_model(tmp_path / "src")
    convert(str(src), tmp_path / "fit", 2, "fit")
    convert(str(src), tmp_path / "calib", 2, "fit", calibration=Calibration(TRAIN_TXT, 2000))
    seqs = documents(src, 2000)
    plain, calibrated = attention_error(src, tmp_path / "fit", seqs), attention_error(src, tmp_path / "calib", seqs)
    print(f"relative attention-output error: fit {plain:.4f}, fit + calib {calibrated:.4f}")
    assert calibrated < plain / 4, (plain, calibrated)


def test_one_calibration_serves_several_conversions(one_torch_thread):
    """A Calibration asked for a layer it has handed out (a second conversion, as the method
    bake-off does) runs the model again and gives the same moments."""
    calibration = Calibration(TRAIN_TXT, 600).bind(EXAMPLE_MHA8)
    first = [calibration.sigma(f"model.layers.{i}.self_attn.") for i in range(2)]
    again = [calibration.sigma(f"model.layers.{i}.self_attn.") for i in range(2)]
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_txt_read_as_one_document_of_many_lines_is_warned_about(tmp_path):
    """Before: a .txt with one document per line and no blank lines was calibrated on as one long
    document, silently."""
    from uptrain.convert.layers.calibrate import ONE_DOCUMENT_LINES, Calibration

    stories = [s.replace("\n", " ") for s in TRAIN_TXT.read_text().split("\n\n")[:60]]
    per_line, paragraphs, few = tmp_path / "per-line.txt", tmp_path / "paragraphs.txt", tmp_path / "few.txt"
    per_line.write_text("\n".join(stories))
    paragraphs.write_text("\n\n".join(stories))
    few.write_text("\n".join(stories[:ONE_DOCUMENT_LINES - 1]))
    warned = Calibration(path=per_line, tokens=1024).record.get("warning", "")
    assert "read as ONE document of 60 lines" in warned and "--calib-text-unit line" in warned
    for path, unit in [(per_line, "line"), (paragraphs, "paragraph"), (few, "paragraph")]:
        assert "warning" not in Calibration(path=path, tokens=1024, text_unit=unit).record, (path, unit)


@pytest.mark.parametrize("model_type", ["llama", "phi", "gemma2", "cohere", "qwen3"])
def test_the_source_loss_on_the_calibration_text_is_the_models_own(model_type, tmp_path, one_torch_thread):
    """The stream's last step scores the calibration text with the source's own head (final norm,
    output projection: tied in llama/cohere, with a bias in phi; gemma2's logit soft-cap and scaled
    embeddings; cohere's logit scale) over the last layer's outputs: the loss transformers gives
    for the whole model on the same sequences."""
    from families import GQA_TYPES, tiny_config

    extra = dict(GQA_TYPES.get(model_type, {}), num_key_value_heads=8, vocab_size=512)
    model = random_model(tiny_config(model_type, extra), seed=1)
    with torch.no_grad():  # logits of a few units, so the loss is not ln(vocab) whatever the head does
        model.get_output_embeddings().weight.mul_(20.0)
    src = save(model, tmp_path / "src")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(EXAMPLE_MHA8 / f, src / f)
    calibration = Calibration(TRAIN_TXT, 1024)
    convert(str(src), tmp_path / "fit", 2, "fit", calibration=calibration)
    sequences = calibration.windows()[0]
    total = count = 0.0
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logits = model(ids).logits[0].float()
            total += torch.nn.functional.cross_entropy(logits[:-1], ids[0, 1:], reduction="sum").item()
            count += len(seq) - 1
    record = calibration.record
    assert record["source_loss_tokens"] == count, record
    assert record["source_loss"] == pytest.approx(total / count, rel=1e-4, abs=1e-4), (record, total / count)


def test_calibration_text_the_source_barely_models_is_warned_about(tmp_path):
    """Before: calibration text the source models near chance (random characters here) passed
    silently. The warning names the loss, chance and --calib-text-unit; real stories give none."""
    import random
    import subprocess
    import sys

    from conftest import REPO

    noise = tmp_path / "noise.txt"
    rng = random.Random(0)
    noise.write_text("\n\n".join("".join(rng.choice("qxzjkvw0123456789#@") for _ in range(400)) for _ in range(8)))
    said = {}
    for name, text in (("noise", noise), ("stories", TRAIN_TXT)):
        done = subprocess.run([sys.executable, "-m", "uptrain.convert", str(EXAMPLE_MHA8), "--kv-heads", "2",
                               "--method", "fit", "--calib", str(text), "--calib-tokens", "2048", "--threads", "1",
                               "--out", str(tmp_path / name)], capture_output=True, text=True, cwd=REPO,
                              env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
        assert done.returncode == 0, done.stderr[-2000:]
        said[name] = done.stderr
    assert "warning: the source's loss on the calibration text is" in said["noise"], said["noise"][-1500:]
    assert "of chance (ln 512 = 6.238" in said["noise"] and "--calib-text-unit" in said["noise"]
    assert "the source's loss on the calibration text" not in said["stories"]


def test_the_source_loss_is_skipped_where_its_head_would_not_fit(tmp_path, monkeypatch, one_torch_thread):
    """A head whose float32 weight and logits exceed a quarter of the memory available (Llama-3-70B's:
    4.2 GiB) is not read: the record says why, the conversion is as before, no warning."""
    import uptrain.convert.layers.layer_stream as stream

    monkeypatch.setattr(stream, "available_memory", lambda: 4 * 2**20)  # 1 MiB for a 2.2 MiB head + logits
    calibration = Calibration(TRAIN_TXT, 1024, layout="documents")  # whole stories: the longest logits
    convert(str(EXAMPLE_MHA8), tmp_path / "fit", 2, "fit", calibration=calibration)
    assert "source_loss" not in calibration.record
    assert "exceed a quarter of the memory available" in calibration.record["source_loss_not_measured"]
    monkeypatch.undo()
    again = Calibration(TRAIN_TXT, 1024)
    convert(str(EXAMPLE_MHA8), tmp_path / "fit2", 2, "fit", calibration=again)
    assert 1.0 < again.record["source_loss"] < 2.5 and "source_loss_not_measured" not in again.record
