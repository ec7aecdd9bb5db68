"""scripts/deploy/deploy_transformers.py: a converted GQA folder in transformers' static cache, torch.export and ONNX.

docs/deploy.md's check block runs as typed (stories260K converted to 2 K/V heads, then the script):
each check ran the real runtime and compared with transformers' own greedy decode; here its JSON and
exported files are checked: within tolerance, and the shapes carry 2 K/V heads, not the 8 query heads.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts" / "deploy"))
sys.path.insert(0, str(REPO / "scripts" / "tools"))
import deploy_transformers as deploy  # noqa: E402
import readme_commands  # noqa: E402

PAGE = "docs/deploy.md"
HAS_ONNX = all(importlib.util.find_spec(name) for name in ("onnxruntime", "onnxscript"))  # the deploy extra
TOL = 1e-4  # float32, the script's default --tolerance; measured max |diff| is ~2e-5 (results/deploy-transformers.md)


@pytest.fixture(scope="module")
def documented(tmp_path_factory) -> tuple[Path, dict]:
    """(the run's folder, its runs/deploy.json): docs/deploy.md's check block, run as typed in a fresh
    folder holding what a clone gives it (the block is skipped by tests/test_readme.py's chain, so that
    its convert and its exports run once in the suite, here, where what they wrote is checked)."""
    (block,) = [b for b in readme_commands.command_blocks((REPO / PAGE).read_text(), skipped=True)
                if any("deploy_transformers.py" in c for c in b)]
    if not HAS_ONNX:  # what the page says to type without the deploy extra
        block = [f"{c} --no-onnx" if "deploy_transformers.py" in c else c for c in block]
    workdir = tmp_path_factory.mktemp("deploy-page")
    readme_commands.copy_repository_files(workdir)
    assert readme_commands.run_commands(workdir, Path(sys.executable), block, PAGE) == 0, block
    (json_arg,) = [c.split("--json ")[1].split()[0] for c in block if "--json " in c]
    return workdir, json.loads((workdir / json_arg).read_text())


@pytest.fixture(scope="module")
def kv2(documented) -> Path:
    """The page's converted folder: stories260K converted to 2 of its 8 K/V heads."""
    return documented[0] / "runs" / "deploy-kv2"


def test_the_page_converts_to_two_kv_heads_and_every_check_passes(documented) -> None:
    _, result = documented
    assert result["passed"] and result["tolerance"] == TOL
    assert set(result["checks"]) == {"vllm_fields", "static_cache", "torch_export", "onnx"}
    ran = {name: check for name, check in result["checks"].items() if "skipped" not in check}
    assert set(ran) == {"vllm_fields", "static_cache", "torch_export"} | ({"onnx"} if HAS_ONNX else set())
    assert all(check.get("ok", check.get("shape_ok")) for check in ran.values()), result


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


def test_static_cache_decodes_the_same_tokens_and_allocates_kv_heads(documented) -> None:
    _, out = documented
    result = out["checks"]["static_cache"]
    assert result["cache_class"] == "StaticCache"
    assert result["tokens_equal"] and result["max_abs_logit_diff"] <= TOL, result
    (shape,) = result["kv_shapes"]
    assert shape[0] == 1 and shape[1] == 2 and shape[3] == 8 and result["shape_ok"], shape
    assert shape[2] >= out["prompt_tokens"] + out["new_tokens"] - 1  # the prompt and the decoded tokens
    # 2 (K and V) x 5 layers x 2 heads x length x 8 dims x 4 bytes: a quarter of the MHA source's
    assert result["kv_bytes"] == 2 * 5 * 2 * shape[2] * 8 * 4


def test_exported_program_matches_eager_logits_with_a_kv_heads_cache(documented, kv2: Path) -> None:
    workdir, out = documented
    result = out["checks"]["torch_export"]
    assert result["tokens_equal"], result
    assert result["prefill_max_abs_diff"] <= TOL and result["decode_max_abs_diff"] <= TOL, result
    assert result["kv_buffer_shapes"] == [[1, 2, deploy.DEFAULT_MAX_CACHE_LEN, 8]]  # the page leaves the default
    # the saved program loads back and gives eager transformers' prefill logits
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(kv2, dtype=torch.float32).eval()
    ids, _ = deploy.prompt_ids(kv2, deploy.DEFAULT_PROMPT, model.config.vocab_size)
    program = torch.export.load(workdir / "runs" / "deploy-kv2-export" / "model.pt2")
    with torch.no_grad():
        again = program.module()(input_ids=ids, cache_position=torch.arange(ids.shape[1]))
        assert deploy.max_diff(again[0], model(ids).logits[0]) <= TOL


@pytest.mark.skipif(not HAS_ONNX, reason="the deploy extra is not installed: pip install -e '.[deploy]'")
def test_onnxruntime_matches_eager_logits_with_kv_heads_inputs(documented) -> None:
    workdir, out = documented
    result = out["checks"]["onnx"]
    assert result["tokens_equal"], result
    assert result["prefill_max_abs_diff"] <= TOL and result["decode_max_abs_diff"] <= TOL, result
    assert result["past_keys_input_shape"][:3] == ["5", "1", "2"] and result["past_keys_input_shape"][4] == "8"
    assert (workdir / "runs" / "deploy-kv2-export" / "model.onnx").stat().st_size > 0


def test_cli_refuses_a_folder_without_config_in_one_line(tmp_path: Path, capsys) -> None:
    assert deploy.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no config.json" in err[0]
