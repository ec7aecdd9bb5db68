"""uptrain's KV-cache emulation (`--kv-cache q8_0 / q4_0`) against llama.cpp itself, on a trained model.

scripts/deploy/kv_cache_parity.py on results/paper/reference-mha8 (head_dim 32: llama.cpp takes
q8_0 / q4_0 caches for it) and 4 held-out Shakespeare documents (2,911 scored tokens, the first 4 of
the reference's validation split, runs/paper-split/val40.jsonl). Needs llama-cpp-python and
llama.cpp's converter ($LLAMA_CPP_DIR, as uptrain.measure.gguf finds it); skipped without them (the
CI machine has neither). Measured numbers: results/kv-cache-parity.md.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from conftest import REPO

MODEL = REPO / "results" / "paper" / "reference-mha8"
DOCUMENTS = 4

# Tolerances, from the measurement (results/kv-cache-parity.md; on these 4 documents / on 40):
# - loss, emulated vs llama.cpp: measured |diff| 1.1e-6 / 2.0e-5 (q8_0) and 3.3e-4 / 2.9e-6 (q4_0),
#   standard error of the paired difference 2.0e-4 at q4_0 on 4 documents; 1e-3 nats is ~3x the
#   largest and ~5 SE. What is left is llama.cpp rounding Q to q8_0 inside its CPU flash attention
#   (ggml-cpu/ops.cpp), which the emulation leaves out.
LOSS_TOL = 1e-3
# - the loss change against each runtime's own exact cache (llama.cpp f32 without flash attention,
#   the model as saved): q4_0 +4.36e-3 (llama.cpp) vs +4.03e-3 (emulated), error 7.5% on 4 documents
#   (0.06% on 40); q8_0's change is within noise (|change| < 2e-5 in both). Asserted: the emulated
#   change within 25% of llama.cpp's at q4_0, and within LOSS_TOL of it for both.
CHANGE_REL_TOL = 0.25
# - the logits: the emulation must explain most of llama.cpp's quantized-cache shift, i.e.
#   KL(llama.cpp q || emulated q) well below KL(llama.cpp q || the model, no emulation). Measured
#   ratio 0.37 (q8_0: Q's q8_0 rounding is the rest) and 0.021 (q4_0) on 4 documents, 0.41 / 0.023
#   on 40. Asserted: below 0.6 (q8_0) and 0.1 (q4_0).
KL_RATIO_TOL = {"q8_0": 0.6, "q4_0": 0.1}


def _parity_module():
    """scripts/deploy/kv_cache_parity.py as a module (it is a script, not a package member)."""
    path = REPO / "scripts" / "deploy" / "kv_cache_parity.py"
    spec = importlib.util.spec_from_file_location("kv_cache_parity", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("kv_cache_parity", module)
    spec.loader.exec_module(module)
    return module


def _held_out(n: int) -> list[str]:
    """The first `n` held-out Shakespeare documents of the reference model's split (scripts/paper/prepare.py)."""
    sys.path.insert(0, str(REPO / "scripts" / "paper"))
    from prepare import CORPORA, corpus_path, documents, read_corpus

    docs = documents(read_corpus(corpus_path(REPO / "examples" / "data" / "paper", CORPORA[0])))
    cut = int(len(docs) * (1 - 0.05))  # split_corpora's val_share 0.05, as scripts/studies/fidelity_study.py
    return docs[cut:cut + n]


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, dict]:
    """The parity rows by llama.cpp cache type (f32 baseline, q8_0, q4_0), computed once."""
    if importlib.util.find_spec("llama_cpp") is None:
        pytest.skip("needs llama-cpp-python (pip install llama-cpp-python; builds llama.cpp, minutes)")
    from uptrain.errors import UsageError
    from uptrain.measure import gguf

    try:
        converter = gguf.find_converter(None)
    except UsageError:
        pytest.skip("needs llama.cpp's convert_hf_to_gguf.py: set LLAMA_CPP_DIR to a llama.cpp checkout")
    if not MODEL.is_dir():
        pytest.skip(f"{MODEL} is not in this checkout")
    parity = _parity_module()
    found = parity.run_parity(MODEL, _held_out(DOCUMENTS), ["q8_0", "q4_0"], 256, 128, converter, 1,
                              tmp_path_factory.mktemp("kv-parity"))
    return {r["llama_cpp_type"]: r for r in found}


def test_the_two_runtimes_agree_with_an_exact_cache(rows) -> None:
    base = rows["f32"]
    assert base["tokens"] > 2500
    assert abs(base["difference"]) < 1e-6 and base["max_abs_logit_diff"] < 1e-3  # measured 3e-9, 3.6e-5


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_emulated_loss_equals_llama_cpps(rows, kind: str) -> None:
    r = rows[kind]
    assert abs(r["emulated_loss"] - r["llama_cpp_loss"]) < LOSS_TOL, r


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_emulation_predicts_llama_cpps_loss_change(rows, kind: str) -> None:
    r = rows[kind]
    ll, emu = r["llama_cpp_change_vs_f32"], r["emulated_change_vs_model"]
    assert abs(emu - ll) < LOSS_TOL, r
    if kind == "q4_0":  # a change well above the noise: the prediction is relative too
        assert ll > 1e-3 and abs(emu - ll) < CHANGE_REL_TOL * ll, r


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_emulation_explains_llama_cpps_logit_shift(rows, kind: str) -> None:
    r = rows[kind]
    assert r["kl_llama_cpp_to_emulated"] < KL_RATIO_TOL[kind] * r["kl_llama_cpp_to_unemulated"], r
