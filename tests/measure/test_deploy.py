"""scripts/deploy_transformers.py: a converted GQA folder in transformers' static cache, torch.export and ONNX.

Each check runs the real runtime on stories260K converted to 2 K/V heads and compares with
transformers' own greedy decode; the shapes must carry 2 K/V heads, not the 8 query heads.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLE_MHA8, REPO

sys.path.insert(0, str(REPO / "scripts"))
import deploy_transformers as deploy  # noqa: E402

NEW = 8  # greedy tokens per check: enough to cover prefill and several cache writes
TOL = 1e-4  # float32; measured max |diff| is ~2e-5 (results/deploy-transformers.md)


@pytest.fixture(scope="module")
def kv2(tmp_path_factory) -> Path:
    from uptrain.convert import convert

    out = tmp_path_factory.mktemp("deploy") / "kv2"
    convert(str(EXAMPLE_MHA8), out, 2)
    return out


@pytest.fixture(scope="module")
def loaded(kv2: Path):
    """(model, prompt ids [1, n], prefill logits, greedy reference (tokens, step logits))."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(kv2, dtype=torch.float32).eval()
    ids, _ = deploy.prompt_ids(kv2, "Once upon a time, there was a little", model.config.vocab_size)
    with torch.no_grad():
        prefill = model(ids).logits
    return model, ids, prefill, deploy.greedy(model, ids, NEW)[:2]


def test_converted_config_declares_two_kv_heads_and_the_weights_agree(kv2: Path, tmp_path: Path) -> None:
    fields = deploy.vllm_fields(kv2)
    assert fields["ok"], fields["problems"]
    assert (fields["num_attention_heads"], fields["num_key_value_heads"], fields["head_dim"]) == (8, 2, 8)
    assert fields["projections_checked"] == 15  # q, k, v in each of the 5 layers
    # a config.json that names the query heads as K/V heads no longer matches the k/v rows
    bad = tmp_path / "bad"
    shutil.copytree(kv2, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["num_key_value_heads"] = 8
    (bad / "config.json").write_text(json.dumps(cfg))
    problems = deploy.vllm_fields(bad)["problems"]
    assert len(problems) == 10 and all("rows; config.json implies 64" in p for p in problems), problems


def test_static_cache_decodes_the_same_tokens_and_allocates_kv_heads(loaded) -> None:
    model, ids, _, reference = loaded
    result = deploy.static_cache_check(model, ids, NEW, reference)
    assert result["cache_class"] == "StaticCache"
    assert result["tokens_equal"] and result["max_abs_logit_diff"] <= TOL, result
    (shape,) = result["kv_shapes"]
    assert shape[1] == 2 and shape[3] == 8 and result["shape_ok"], shape
    # 2 (K and V) x 5 layers x 2 heads x length x 8 dims x 4 bytes: a quarter of the MHA source's
    assert result["kv_bytes"] == 2 * 5 * 2 * shape[2] * 8 * 4


def test_exported_program_matches_eager_logits_with_a_kv_heads_cache(loaded, tmp_path: Path) -> None:
    model, ids, prefill, reference = loaded
    result = deploy.export_check(model, ids, NEW, 32, reference, prefill, tmp_path / "model.pt2")
    assert result["tokens_equal"], result
    assert result["prefill_max_abs_diff"] <= TOL and result["decode_max_abs_diff"] <= TOL, result
    assert result["kv_buffer_shapes"] == [[1, 2, 32, 8]]
    # the saved program loads back and gives the same prefill logits
    program = torch.export.load(tmp_path / "model.pt2")
    with torch.no_grad():
        again = program.module()(input_ids=ids, cache_position=torch.arange(ids.shape[1]))
    assert deploy.max_diff(again[0], prefill[0]) <= TOL


def test_onnxruntime_matches_eager_logits_with_kv_heads_inputs(loaded, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime", reason="the deploy extra is not installed: pip install -e '.[deploy]'")
    pytest.importorskip("onnxscript", reason="the deploy extra is not installed: pip install -e '.[deploy]'")
    model, ids, prefill, reference = loaded
    result = deploy.onnx_check(model, ids, NEW, reference, prefill, tmp_path / "model.onnx")
    assert result["tokens_equal"], result
    assert result["prefill_max_abs_diff"] <= TOL and result["decode_max_abs_diff"] <= TOL, result
    assert result["past_keys_input_shape"][:3] == ["5", "1", "2"] and result["past_keys_input_shape"][4] == "8"


def test_cli_refuses_a_folder_without_config_in_one_line(tmp_path: Path, capsys) -> None:
    assert deploy.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no config.json" in err[0]
