"""llama.cpp as a runtime: find it, convert a Hugging Face folder to GGUF, load it, read its KV cache.

Used by `uptrain.bench --runtime llama.cpp` and scripts/deploy/deploy_check.py. llama-cpp-python is an
optional dependency (it builds llama.cpp from source, minutes): without it every entry point
refuses in one line that says how to install it. The converter is llama.cpp's own
`convert_hf_to_gguf.py`, run as a separate process with this Python (it needs `sentencepiece` for
Llama vocabularies and puts its own `gguf-py` on sys.path).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from uptrain.errors import UsageError

INSTALL = ("pip install llama-cpp-python sentencepiece (builds llama.cpp from source, minutes), "
           "and get its converter: git clone https://github.com/ggml-org/llama.cpp, or use the "
           "vendor/llama.cpp folder of the llama-cpp-python sdist (pip download --no-binary :all: --no-deps "
           "llama-cpp-python)")
CONVERTER = "convert_hf_to_gguf.py"
# llama.cpp's src/llama-kv-cache.cpp, once per context:
# "llama_kv_cache: size =   40.00 MiB (  1024 cells,   5 layers,  1/1 seqs), K (f16):   20.00 MiB, V (f16): ..."
KV_LINE = re.compile(r"llama_kv_cache: size = +([\d.]+) MiB \( *(\d+) cells, +(\d+) layers.*?K \((\w+)\): +([\d.]+) MiB, "
                     r"V \((\w+)\): +([\d.]+) MiB")
MIB = 1024 * 1024


def require_llama_cpp():
    """The llama_cpp module, or a one-line UsageError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as e:
        raise UsageError(f"llama.cpp runs need llama-cpp-python, which is not importable ({e}): {INSTALL}") from None
    return llama_cpp


def find_converter(llama_cpp_dir: str | None) -> Path:
    """llama.cpp's convert_hf_to_gguf.py in `llama_cpp_dir` (or $LLAMA_CPP_DIR); one-line error if absent."""
    where = llama_cpp_dir or os.environ.get("LLAMA_CPP_DIR")
    if not where:
        raise UsageError(f"converting to GGUF needs llama.cpp's {CONVERTER}: pass --llama-cpp DIR "
                         f"(a llama.cpp checkout) or set LLAMA_CPP_DIR; {INSTALL}")
    path = Path(where).expanduser() / CONVERTER
    if not path.is_file():
        raise UsageError(f"{path} not found: --llama-cpp must name a llama.cpp checkout (the folder holding "
                         f"{CONVERTER}); {INSTALL}")
    return path


def convert_to_gguf(folder: Path, out_file: Path, converter: Path, outtype: str = "f32") -> Path:
    """Run llama.cpp's converter on a Hugging Face folder; return the GGUF file written.

    A failing converter is a one-line error carrying its last line (e.g. a missing Python package).
    """
    cmd = [sys.executable, str(converter), str(folder), "--outfile", str(out_file), "--outtype", outtype]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not out_file.is_file():
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UsageError(f"{CONVERTER} failed on {folder} (exit {done.returncode}): {last}")
    return out_file


@dataclass(frozen=True)
class KvCache:
    """The KV cache llama.cpp allocated, as its log line states it (MiB to two decimals)."""

    bytes: int
    cells: int
    layers: int
    k_type: str
    v_type: str


def parse_kv_line(log: str) -> KvCache | None:
    """The last `llama_kv_cache: size = ...` line of a llama.cpp log, or None."""
    found = KV_LINE.findall(log)
    if not found:
        return None
    total, cells, layers, k_type, _, v_type, _ = found[-1]
    return KvCache(round(float(total) * MIB), int(cells), int(layers), k_type, v_type)


KV_TYPES = ("f16", "f32", "q8_0")  # llama.cpp's KV cache types offered (f16 is its default)


GGML_BF16 = 30  # enum ggml_type's GGML_TYPE_BF16 (ggml/include/ggml.h): llama-cpp-python 0.3.36 exports no name for it


def load_llama(gguf: Path, n_ctx: int, threads: int, logits_all: bool = False, kv_type: str = "f16",
               flash_attn: bool = False, n_batch: int | None = None):
    """(llama_cpp.Llama, its load log, its KvCache) for a GGUF file with an `n_ctx`-token context
    whose K and V caches hold `kv_type` (f32, f16, bf16, q8_0, q4_0); `flash_attn`: llama.cpp's flash
    attention (a quantized V cache needs it); `n_batch`: tokens per decode (default min(n_ctx, 512)).
    A context llama.cpp refuses (a block type whose block does not divide the GGUF's head_dim) is a
    one-line UsageError naming its log's reason.

    The log (llama.cpp's, through llama-cpp-python's callback to sys.stderr) is captured, not
    shown: it is long, and its KV line is the number we want.
    """
    llama_cpp = require_llama_cpp()
    ggml_type = getattr(llama_cpp, f"GGML_TYPE_{kv_type.upper()}", GGML_BF16 if kv_type == "bf16" else None)
    batch = n_batch or min(n_ctx, 512)
    log = io.StringIO()
    try:
        with contextlib.redirect_stderr(log):
            llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=batch, n_ubatch=batch, n_threads=threads,
                                  n_threads_batch=threads, logits_all=logits_all, verbose=True, seed=0,
                                  type_k=ggml_type, type_v=ggml_type, flash_attn=flash_attn)
    except ValueError as err:
        why = [line for line in log.getvalue().splitlines() if "cache" in line and "type" in line][-1:] or [str(err)]
        raise UsageError(f"llama.cpp refused a {kv_type} K/V cache for {gguf}: {why[0].strip()}") from None
    text = log.getvalue()
    return llm, text, parse_kv_line(text)


def quiet() -> contextlib.AbstractContextManager:
    """Silence llama.cpp's per-call log lines while evaluating (they go through sys.stderr)."""
    return contextlib.redirect_stderr(io.StringIO())


def rss_bytes() -> int:
    """This process's resident memory now (Linux /proc), else its peak (getrusage)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def gguf_meta(llm) -> dict[str, str]:
    """The GGUF metadata llama.cpp read (`general.architecture`, `<arch>.attention.head_count_kv`, ...)."""
    return dict(llm.metadata)


def arch_value(meta: dict[str, str], key: str) -> int | None:
    """An integer `<arch>.<key>` of the GGUF metadata (e.g. key="attention.head_count_kv")."""
    arch = meta.get("general.architecture", "llama")
    value = meta.get(f"{arch}.{key}")
    return int(value) if value is not None else None
