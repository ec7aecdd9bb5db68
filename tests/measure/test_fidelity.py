"""Fidelity to a source (issue 42): KL, top-1 and greedy agreement against hand computations on real
transformers models, exact 0 / 1 for a model against itself, the loss unchanged, the warnings, the CLI."""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from uptrain.data import DataSource, read_documents
from uptrain.errors import UsageError
from uptrain.measure.eval import (EvalResult, evaluate, evaluate_against, evaluate_paths, load_model, main,
                                  print_fidelity_warnings, tokenize_texts)
from uptrain.measure.fidelity import (GreedySettings, Reference, fidelity_warnings, greedy_continuation,
                                      greedy_prompts, greedy_scores, window_spans)

from conftest import EXAMPLE_MHA8, REPO, VALID_TXT as VALID

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # see conftest.py


def llama(seed: int, heads: int = 4, kv: int = 2, head_dim: int = 4, layers: int = 1, vocab: int = 64,
          dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """A random Llama whose logits are far from uniform (initializer_range 0.3), so argmaxes mean something."""
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=heads * head_dim, head_dim=head_dim, intermediate_size=16,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                      max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.3)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def perturbed(model: LlamaForCausalLM, scale: float, seed: int) -> LlamaForCausalLM:
    """A separate copy of `model` with every weight moved by `scale` x N(0, 1) (0: an identical copy)."""
    out = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * scale)
    return out


def documents(seed: int, lengths: tuple[int, ...], vocab: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]


def score(model, ref, docs, max_length=64, stride=32, settings=GreedySettings(4, 8, 8)):
    """(per-document sums, Fidelity) of `model` against `ref` through the code under test."""
    reference = Reference("ref", ref, None, greedy_prompts(docs, settings), settings)
    return reference.score(model, docs, max_length, stride)


@torch.no_grad()
def by_hand(model, ref, docs, max_length=None, stride=None) -> tuple[float, float, list[float], list[float], int]:
    """(mean KL(ref || model), top-1 agreement, per-document mean KLs, per-document summed loss
    differences, tokens) in float64 from transformers' logits: of each whole document when no window
    is given, else of each window of `window_spans` on the positions it scores."""
    kl_sum, agree, n_all, doc_kl, doc_diff = 0.0, 0, 0, [], []
    for ids in docs:
        spans = [(0, len(ids), 1)] if max_length is None else window_spans(len(ids), max_length, stride)
        if len(ids) < 2:
            spans = []
        # logits of the window [b, e) at positions f-1 .. e-2 predict the targets ids[f:e]
        pieces = [(model(ids[None, b:e]).logits[0, f - b - 1:e - b - 1],
                   ref(ids[None, b:e]).logits[0, f - b - 1:e - b - 1], ids[f:e]) for b, e, f in spans]
        kl_doc, diff, n_doc = 0.0, 0.0, 0
        for lm, lr, t in pieces:
            lm, lr = torch.log_softmax(lm.double(), -1), torch.log_softmax(lr.double(), -1)  # [n, vocab]
            kl_doc += (lr.exp() * (lr - lm)).sum().item()
            agree += int((lm.argmax(-1) == lr.argmax(-1)).sum())
            diff += (lr.gather(1, t[:, None]) - lm.gather(1, t[:, None])).sum().item()  # nll_model - nll_ref
            n_doc += len(t)
        if n_doc:
            doc_kl.append(kl_doc / n_doc)
            doc_diff.append(diff)
        kl_sum, n_all = kl_sum + kl_doc, n_all + n_doc
    return kl_sum / n_all, agree / n_all, doc_kl, doc_diff, n_all


def test_kl_and_top1_equal_a_hand_computation_on_whole_documents() -> None:
    ref = llama(0)
    docs = documents(1, (2, 9, 30, 47, 64), 64)
    for model in (perturbed(ref, 0.05, 2), perturbed(ref, 0.3, 3), llama(4)):
        _, fid = score(model, ref, docs, max_length=64, stride=32)  # every document fits one window
        kl, top1, doc_kl, doc_diff, n = by_hand(model, ref, docs)
        assert fid.tokens == n == 1 + 8 + 29 + 46 + 63
        assert abs(fid.kl_to_source - kl) < 1e-4 and fid.kl_to_source > 1e-3
        assert fid.top1_agreement == top1 and 0 < top1 < 1
        assert fid.kl_doc_std == pytest.approx(statistics.stdev(doc_kl), abs=1e-4)
        assert fid.kl_doc_max == pytest.approx(max(doc_kl), abs=1e-4)
        # the paired loss difference and its standard error clustered by document (weights n_d / N)
        d_mean = sum(doc_diff) / n
        sizes = [1, 8, 29, 46, 63]
        se = math.sqrt(5 / 4 * sum((w / n) ** 2 * (dd / w - d_mean) ** 2 for w, dd in zip(sizes, doc_diff)))
        assert fid.loss_vs_source == pytest.approx(d_mean, abs=1e-5)
        assert fid.loss_vs_source_se == pytest.approx(se, rel=1e-4)


# head counts of real models (32, 40, 64) at tiny widths, K/V counts that divide them
SHAPES = [(1, 1, 8), (2, 1, 4), (4, 4, 4), (8, 2, 2), (32, 8, 2), (40, 5, 2), (64, 16, 2), (64, 1, 2)]


@pytest.mark.parametrize("heads,kv,head_dim", SHAPES)
def test_bounds_and_exact_identity_over_random_models(heads: int, kv: int, head_dim: int) -> None:
    for seed in range(3):
        vocab = (32, 64, 100)[seed]
        ref = llama(seed, heads, kv, head_dim, layers=1 + seed % 2, vocab=vocab)
        docs = documents(seed, (3, 17, 40, 90), vocab)  # 90 > the window: several windows
        others = (perturbed(ref, 0.0, seed), perturbed(ref, 1e-3, seed), perturbed(ref, 0.2, seed),
                  llama(99, heads, kv, head_dim, vocab=vocab))
        for model in (ref, *others):
            _, fid = score(model, ref, docs, max_length=32, stride=12)
            assert fid.kl_to_source >= 0 and fid.kl_doc_std >= 0
            assert 0 <= fid.top1_agreement <= 1 and 0 <= fid.greedy_agreement <= 1
            assert 0 <= fid.greedy_prefix <= 8
            identical = model is ref or all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
            if identical:  # the same object, and a separate identical copy: exactly, not nearly
                assert (fid.kl_to_source, fid.top1_agreement, fid.greedy_agreement) == (0.0, 1.0, 1.0)
                assert (fid.loss_vs_source, fid.kl_doc_std, fid.greedy_prefix) == (0.0, 0.0, 8.0)
            else:
                assert fid.kl_to_source > 0


def test_windows_give_the_hand_computation_over_windowed_logits() -> None:
    ref = llama(5, heads=4, kv=1)
    docs = documents(6, (5, 40, 77, 150), 64)
    model = perturbed(ref, 0.2, 7)
    for max_length, stride in ((16, 5), (16, 8), (16, 15), (33, 32), (200, 100)):
        _, fid = score(model, ref, docs, max_length=max_length, stride=stride, settings=GreedySettings(4, 8, 8))
        kl, top1, _, _, n = by_hand(model, ref, docs, max_length, stride)
        assert fid.tokens == n == 4 + 39 + 76 + 149
        assert abs(fid.kl_to_source - kl) < 1e-4 and fid.top1_agreement == top1


def test_separately_loaded_copies_of_one_folder_are_exactly_identical(tmp_path: Path) -> None:
    llama(8, heads=8, kv=2).save_pretrained(tmp_path / "m")
    one, _ = load_model(str(tmp_path / "m"), with_tokenizer=False)
    two, _ = load_model(str(tmp_path / "m"), with_tokenizer=False)
    assert one is not two
    _, fid = score(one, two, documents(9, (20, 70), 64), max_length=32, stride=16)
    assert (fid.kl_to_source, fid.top1_agreement, fid.greedy_agreement, fid.loss_vs_source) == (0.0, 1.0, 1.0, 0.0)


@torch.no_grad()
def recompute_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    """Greedy by hand: the whole sequence through the model at each step, one prompt, no cache."""
    seq = prompt.tolist()
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_continuation_equals_an_independent_loop_and_generate() -> None:
    for seed, (heads, kv) in enumerate(((4, 2), (8, 8), (32, 4))):
        model = llama(seed, heads, kv, head_dim=2, layers=2, dtype=torch.float64)  # no near-ties to flip
        prompts = documents(seed, (6, 6, 6), 64)
        ours = greedy_continuation(model, torch.stack(prompts), 12)  # [3, 12], batched with the KV cache
        assert ours.shape == (3, 12)
        for row, prompt in zip(ours, prompts):
            assert row.tolist() == recompute_greedy(model, prompt, 12)
        assert greedy_continuation(model, prompts[0], 12).tolist() == ours[0].tolist()  # [P] -> [n]
    # the real stories260K against transformers' own greedy search, settings given explicitly (no EOS stop)
    real, tok = load_model(str(EXAMPLE_MHA8))
    texts = read_documents(DataSource(files=[str(VALID)]))[:4]
    prompts = greedy_prompts(tokenize_texts(tok, texts), GreedySettings(4, 32, 32))  # [4, 32]
    cfg = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=32, min_new_tokens=0, eos_token_id=None,
                           pad_token_id=0, bos_token_id=1)
    with torch.no_grad():
        theirs = real.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), generation_config=cfg)
    assert torch.equal(greedy_continuation(real, prompts, 32), theirs[:, 32:])


def test_greedy_agreement_is_one_with_itself_and_below_one_against_another_model() -> None:
    ref = llama(10, layers=2, dtype=torch.float64)
    docs = documents(11, (20, 20, 30, 5, 12), 64)
    settings = GreedySettings(prompts=3, prompt_tokens=8, continuation_tokens=16)
    prompts = greedy_prompts(docs, settings)
    assert torch.equal(prompts, torch.stack([d[:8] for d in docs[:3]]))  # the 5-token document is too short
    for same in (ref, perturbed(ref, 0.0, 0)):
        _, fid = score(same, ref, docs, settings=settings)
        assert (fid.greedy_agreement, fid.greedy_prefix, fid.prompts) == (1.0, 16.0, 3)
    _, fid = score(llama(12, layers=2, dtype=torch.float64), ref, docs, settings=settings)
    assert fid.greedy_agreement < 0.5 and fid.greedy_prefix < 16
    # a nearby model, against continuations and prefixes counted by hand from the one-prompt loop
    near = perturbed(ref, 0.03, 13)
    _, fid = score(near, ref, docs, settings=settings)
    ours, theirs = ([recompute_greedy(m, p, 16) for p in prompts] for m in (near, ref))
    same = [[a == b for a, b in zip(x, y)] for x, y in zip(ours, theirs)]
    prefix = [next((k for k, eq in enumerate(row) if not eq), 16) for row in same]
    assert fid.greedy_agreement == sum(map(sum, same)) / 48 and fid.greedy_prefix == sum(prefix) / 3
    # a case where the common prefix is not every match (counting those would give agreement x 16)
    assert 0 < fid.greedy_agreement < 1 and fid.greedy_agreement * 16 != fid.greedy_prefix
    assert greedy_scores(torch.tensor([[1, 2, 3, 4], [1, 9, 3, 4]]), torch.tensor([[1, 2, 3, 4]] * 2)) == (7 / 8, 2.5)
    # its standard error is over the prompts, the independent units: per-prompt shares' spread / sqrt(B)
    shares = torch.tensor([sum(row) / 16 for row in same], dtype=torch.float64)
    assert fid.greedy_agreement_se == pytest.approx(float(shares.std()) / 3 ** 0.5, rel=1e-12)


def test_the_greedy_agreement_interval_covers_the_true_agreement_at_its_stated_rate() -> None:
    """± 1.96 standard errors over B prompts holds the expected agreement about 95% of the time, for
    continuations that agree up to a first difference and rarely after it (as greedy ones do); at
    16 prompts (the default) and 64."""
    from uptrain.measure.fidelity import greedy_agreement_se

    gen = torch.Generator().manual_seed(0)
    for prompts in (16, 64):
        covered, trials, C = 0, 2000, 32
        expected = 0.0
        # the truth, from a large sample of the same process: prefix ~ geometric(0.08), later 5% matches
        def sample(n: int) -> tuple[torch.Tensor, torch.Tensor]:
            first = torch.distributions.Geometric(torch.tensor(0.08)).sample((n,)).long()
            pos = torch.arange(C).expand(n, C)
            agree = (pos < first[:, None]) | (torch.rand(n, C, generator=gen) < 0.05)
            return agree.long(), torch.ones(n, C, dtype=torch.long)
        torch.manual_seed(1)
        ours, ref = sample(200_000)
        expected = greedy_scores(ours, ref)[0]
        for _ in range(trials):
            ours, ref = sample(prompts)
            mean, se = greedy_scores(ours, ref)[0], greedy_agreement_se(ours, ref)
            covered += abs(mean - expected) <= 1.96 * se
        assert 0.90 <= covered / trials <= 0.98, (prompts, covered / trials)


def test_the_loss_is_the_same_with_and_without_a_reference(tmp_path: Path, monkeypatch) -> None:
    ref = llama(13)
    docs = documents(14, (2, 33, 90), 64)
    settings = GreedySettings(2, 8, 8)
    reference = Reference("ref", ref, None, greedy_prompts(docs, settings), settings)
    for model in (ref, perturbed(ref, 0.1, 15)):
        plain = evaluate(model, docs, 32, 12)
        against = evaluate_against(model, reference, docs, 32, 12)
        assert (against.loss, against.tokens, against.documents) == (plain.loss, plain.tokens, plain.documents)
    # on the real text and model, through evaluate_paths: a path equal to the reference (written
    # differently) is the reference object; a copied folder is loaded anew; both exactly identical
    texts = read_documents(DataSource(files=[str(VALID)]))[:5]
    shutil.copytree(EXAMPLE_MHA8, tmp_path / "copy")
    paths = [str(EXAMPLE_MHA8), str(EXAMPLE_MHA8.parent / ".." / "examples" / EXAMPLE_MHA8.name),
             str(tmp_path / "copy")]
    plain = evaluate_paths(paths[:1], texts, 512, 256)
    loads = []
    monkeypatch.setattr("uptrain.measure.eval.load_model", lambda path, *a: loads.append(path) or load_model(path, *a))
    results = evaluate_paths(paths, texts, 512, 256, reference=str(EXAMPLE_MHA8))
    assert loads == [str(EXAMPLE_MHA8), str(tmp_path / "copy")]  # the reference once, reused for its own path
    for r in results:
        assert r.loss == plain[0].loss and r.source_loss == plain[0].loss
        assert (r.kl_to_source, r.top1_agreement, r.greedy_agreement, r.loss_vs_source) == (0.0, 1.0, 1.0, 0.0)
        assert (r.greedy_prompts, r.prompt_tokens, r.continuation_tokens) == (5, 32, 32)


def test_warnings_near_chance_and_beating_the_source(capsys: pytest.CaptureFixture[str]) -> None:
    chance = math.log(512)  # 6.238
    (near,) = fidelity_warnings(5.87, 512, [("kv2", 5.9, 0.03, 0.01)])  # the motivating case: 94% of chance
    assert "chance" in near and "5.870" in near and "fidelity (KL to the source)" in near
    assert fidelity_warnings(0.9 * chance + 1e-3, 512, []) and not fidelity_warnings(0.9 * chance - 1e-3, 512, [])
    assert fidelity_warnings(1.667, 512, [("kv2", 1.874, 0.207, 0.01), ("kv4", 1.667, 0.0, 0.0)]) == []
    (beats,) = fidelity_warnings(1.8, 512, [("kv2", 1.7, -0.1, 0.02), ("kv1", 1.79, -0.01, 0.02)])
    assert beats.startswith("warning: kv2 beats its source by 0.1000") and "5.0 standard errors" in beats
    assert "fidelity (KL to the source)" in beats
    assert fidelity_warnings(1.8, 512, [("kv2", 1.7, -0.1, None)]) == []  # one document: no noise estimate
    assert len(fidelity_warnings(6.0, 512, [("kv2", 5.7, -0.3, 0.05)])) == 2
    # the helper for the demo and the sweep: EvalResults in, warnings printed and returned
    rows = [EvalResult("src", 6.0, 403.4, 10, 2, source_loss=6.0, vocab_size=512, loss_vs_source=0.0,
                       loss_vs_source_se=0.0, kl_to_source=0.0),
            EvalResult("kv2", 5.7, 298.9, 10, 2, source_loss=6.0, vocab_size=512, loss_vs_source=-0.3,
                       loss_vs_source_se=0.05, kl_to_source=0.4)]
    assert len(print_fidelity_warnings(rows)) == 2 and capsys.readouterr().out.count("warning:") == 2
    assert print_fidelity_warnings([EvalResult("m", 1.0, 2.7, 3, 1)]) == []


def test_greedy_settings_fit_the_window() -> None:
    assert GreedySettings().within(64, explicit=True) == GreedySettings(16, 32, 32)
    assert GreedySettings().within(41, explicit=False) == GreedySettings(16, 21, 20)
    with pytest.raises(UsageError, match="exceed the window"):
        GreedySettings(4, 32, 32).within(48, explicit=True)
    ref = llama(17)
    _, fid = score(perturbed(ref, 0.1, 18), ref, documents(19, (5, 7), 64))  # no document has 8 tokens: no prompt
    assert (fid.prompts, fid.greedy_agreement, fid.greedy_prefix) == (0, None, None) and fid.kl_to_source > 0


@pytest.fixture(scope="module")
def kv2(tmp_path_factory) -> Path:
    """stories260K mean-pooled to 2 K/V heads (lossy: a model that differs from its source)."""
    from uptrain.convert import convert

    out = tmp_path_factory.mktemp("fidelity") / "kv2"
    convert(str(EXAMPLE_MHA8), out, 2)
    return out


def test_cli_reports_fidelity_beside_the_loss(kv2: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "uptrain.eval", str(EXAMPLE_MHA8), str(kv2), "--data", str(VALID),
                           "--max-documents", "4", "--reference", str(EXAMPLE_MHA8), "--json", "-"],
                          capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    src, conv = json.loads(proc.stdout)
    exact = (src["kl_to_source"], src["top1_agreement"], src["greedy_agreement"], src["loss_vs_source"])
    assert exact == (0.0, 1.0, 1.0, 0.0)
    assert conv["kl_to_source"] > 0.1 and 0 < conv["top1_agreement"] < 1 and 0 <= conv["greedy_agreement"] < 1
    assert conv["loss_vs_source"] == pytest.approx(conv["loss"] - src["loss"]) and conv["loss_vs_source_se"] > 0
    assert (conv["greedy_prompts"], conv["prompt_tokens"], conv["continuation_tokens"]) == (4, 32, 32)
    for key in ("greedy_prefix", "kl_doc_std", "kl_doc_max", "source_loss", "reference"):
        assert conv[key] is not None, key
    # no loss warning here; the converted model's copy top-1 far below the source's is warned (uptrain.measure.copy_probe)
    assert src["warnings"] == [] and conv["source_copy_top1"] - conv["copy_top1"] > 0.05
    assert [w for w in conv["warnings"] if "copy top-1" not in w] == [] and len(conv["warnings"]) == 1
    assert "KL to source" in proc.stderr and "greedy agr." in proc.stderr


def test_cli_refuses_a_reference_with_another_vocabulary(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "vocab1000"
    llama(16, vocab=1000).save_pretrained(other)
    for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"):
        shutil.copy(EXAMPLE_MHA8 / name, other / name)
    # the same vocabulary size, another tokenizer: two frequent tokens' ids swapped
    swapped = tmp_path / "swapped"
    shutil.copytree(EXAMPLE_MHA8, swapped)
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["▁the"], vocab["▁a"] = vocab["▁a"], vocab["▁the"]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    args = ["--data", str(VALID), "--max-documents", "2", "--reference", str(EXAMPLE_MHA8)]
    assert main([str(other), *args]) == 2
    assert main([str(swapped), *args]) == 2
    assert main([str(EXAMPLE_MHA8), "--data", str(VALID), "--prompt-tokens", "8"]) == 2  # no --reference
    assert main([str(EXAMPLE_MHA8), *args, "--max-length", "48", "--prompt-tokens", "32"]) == 2  # 32 + 32 > 48
    sizes, ids, no_ref, too_long = [x for x in capsys.readouterr().err.splitlines() if x.startswith("error: ")]
    assert str(other) in sizes and str(EXAMPLE_MHA8) in sizes and "vocab sizes 1000 and 512" in sizes
    assert "different ids on the first document" in ids and "--reference" in ids
    assert "--reference SOURCE" in no_ref and "exceed the window" in too_long
