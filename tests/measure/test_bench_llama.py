"""`uptrain.bench --runtime llama.cpp` without llama.cpp: one line, exit 2; the KV-line parser.

llama-cpp-python is optional (it builds llama.cpp, minutes) and absent from the test environment;
these tests pass with it installed too. The measurements themselves need it and are run by hand
(results/deploy-llama-cpp.md).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

from conftest import EXAMPLE_MHA8, REPO
from uptrain.measure.bench_llama import TYPE_BYTES, kv_formula
from uptrain.measure.gguf import MIB, parse_kv_line

HAVE_LLAMA_CPP = importlib.util.find_spec("llama_cpp") is not None


def run_bench(args: list[str], hide_llama_cpp: bool) -> subprocess.CompletedProcess:
    # sys.modules[name] = None is how Python marks a module unimportable: the import raises ImportError,
    # exactly what a machine without llama-cpp-python does
    hide = "sys.modules['llama_cpp'] = None; " if hide_llama_cpp else ""
    code = f"import sys; {hide}from uptrain.measure.bench import main; sys.exit(main({args!r}))"
    env = {k: v for k, v in os.environ.items() if k != "LLAMA_CPP_DIR"} | {"PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)


def test_without_llama_cpp_the_bench_refuses_in_one_line_saying_how_to_install() -> None:
    done = run_bench([str(EXAMPLE_MHA8), "--runtime", "llama.cpp"], hide_llama_cpp=True)
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1 and "pip install llama-cpp-python" in err and "not importable" in err



def test_settings_llama_cpp_would_not_honour_are_refused_in_one_line() -> None:
    done = run_bench([str(EXAMPLE_MHA8), "--runtime", "llama.cpp", "--batch", "8", "--dtype", "bfloat16"],
                     hide_llama_cpp=True)
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1 and "--batch, --dtype apply to --runtime transformers only" in err

@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="needs llama-cpp-python (without it the refusal is the missing package, tested above)")
def test_a_folder_without_a_converter_is_refused_in_one_line() -> None:
    done = run_bench([str(EXAMPLE_MHA8), "--runtime", "llama.cpp"], hide_llama_cpp=False)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "--llama-cpp DIR" in done.stderr and "convert_hf_to_gguf.py" in done.stderr


def test_kv_line_is_read_from_llama_cpps_log() -> None:
    # the format string of llama.cpp's src/llama-kv-cache.cpp, filled as it prints for stories260K
    log = ("llama_context: n_ctx = 512\n"
           "llama_kv_cache:        CPU KV buffer size =     0.62 MiB\n"
           "llama_kv_cache: size =    0.62 MiB (   512 cells,   5 layers,  1/1 seqs), K (f16):    0.31 MiB, V (f16):    0.31 MiB\n")
    kv = parse_kv_line(log)
    assert (kv.cells, kv.layers, kv.k_type, kv.v_type) == (512, 5, "f16", "f16")
    assert abs(kv.bytes - kv_formula(5, 8, 8, "f16", 512)) <= 0.005 * MIB + 1  # %7.2f MiB in the log
    assert parse_kv_line("llama_context: n_ctx = 512\n") is None


def test_fp8_is_refused_for_llama_cpp_in_one_line() -> None:
    # vLLM's format: refused before llama.cpp is even looked for, so also on a machine without it
    done = run_bench([str(EXAMPLE_MHA8), "--runtime", "llama.cpp", "--kv-cache", "fp8"], hide_llama_cpp=True)
    assert done.returncode == 2, done.stderr
    err = done.stderr.strip()
    assert len(err.splitlines()) == 1 and "fp8 is vLLM's cache format" in err and "q8_0" in err


@pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="needs llama-cpp-python (measures llama.cpp's own cache)")
@pytest.mark.parametrize("name, kv_type, per_token", [("q8_0", "q8_0", 2176), ("q4_0", "q4_0", 1152)])
def test_the_cache_llama_cpp_allocates_in_q8_0_and_q4_0_equals_the_formula(tmp_path, name, kv_type, per_token) -> None:
    import json

    from uptrain.errors import UsageError
    from uptrain.measure import gguf

    try:
        converter = gguf.find_converter(None)
    except UsageError:
        pytest.skip("needs llama.cpp's convert_hf_to_gguf.py: set LLAMA_CPP_DIR")
    sys.path.insert(0, str(REPO / "scripts" / "deploy"))
    from kv_cache_parity import convert_f32  # reference-mha8's byte-level BPE needs its pre-tokenizer named

    model = convert_f32(REPO / "results" / "paper" / "reference-mha8", tmp_path / "ref.gguf", converter)
    fast = ["--context", "16", "--new-tokens", "2", "--warmup", "0", "--repeats", "1", "--threads", "1"]
    done = run_bench([str(model), "--runtime", "llama.cpp", *fast, "--kv-cache", name,
                      "--json", str(tmp_path / "b.json")], hide_llama_cpp=False)
    assert done.returncode == 0, done.stderr
    (row,) = json.loads((tmp_path / "b.json").read_text())
    assert (row["kv_cache"], row["kv_type"], row["flash_attn"]) == (name, kv_type, True)
    assert row["kv_bytes_per_token"] == per_token == 2 * 4 * 8 * 32 * TYPE_BYTES[kv_type]  # 34 or 18 B per 32
    assert row["kv_formula_bytes"] == per_token * row["kv_cells"]
    assert abs(row["kv_allocated_bytes"] - row["kv_formula_bytes"]) <= 0.005 * MIB + 1  # %7.2f MiB in the log
