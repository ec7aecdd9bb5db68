"""Does uptrain's KV-cache emulation (`--kv-cache`) land where llama.cpp itself lands? Loss, logits, KL.

    python scripts/deploy/kv_cache_parity.py MODEL --data FILE [--max-documents N]
        [--kv-cache f16,q8_0,q4_0] [--llama-cpp DIR] [--threads N] [--json OUT.json]

MODEL (a Hugging Face folder) is converted once to a GGUF with float32 weights (llama.cpp's
convert_hf_to_gguf.py from --llama-cpp DIR or $LLAMA_CPP_DIR) and loaded in llama-cpp-python once
per cache type, K and V stored in that ggml type, flash attention on (llama.cpp needs it for a
quantized V cache), except the f32 baseline: with flash attention on, llama.cpp casts an f32 K and V
to f16 before the attention (src/llama-graph.cpp, `build_attn_mha`), so the only exact cache in
llama.cpp is f32 with flash attention off (plain f32 matmuls, softmax in f32).
Every document is tokenized by the *transformers* tokenizer of MODEL, so that both runtimes see the
same ids, and scored in the windows of uptrain.eval (`window_spans`: max_length tokens, stride
max_length / 2 by default; a document no longer than the window is one window). llama.cpp's cache is
cleared before each window, the window's ids evaluated in one batch (all logits kept), and the
log-softmax taken at the scored positions; transformers scores the same window with
`scored_window(model, ids, span, kv)`, the one place uptrain.eval runs a window, its cache in the
emulated format. Each llama.cpp type is paired with its emulation: f32 <-> model (the two runtimes'
baseline difference with an exact cache), f16 <-> fp16, bf16 <-> bf16, q8_0 <-> q8_0, q4_0 <-> q4_0.

Reported per type: both losses (nats/token, the same tokens), their difference, the max |logit
difference| and the mean KL(llama.cpp || emulation) over the scored tokens, each runtime's loss
change against its own exact run (llama.cpp f32, the model as saved): what a user reads
`--kv-cache` for. The emulated loss is also recomputed by `uptrain.measure.eval.evaluate(...,
kv=...)` and must equal the window-by-window sum (so the numbers are uptrain.eval's).

Conversion: a tokenizer.json whose BPE pre-tokenizer llama.cpp's converter does not know (a
byte-level BPE trained here, like results/paper/reference-mha8's) stops the converter; such a
vocabulary is written as GPT-2's pre-tokenizer ("gpt-2", the byte-level regex the tokenizer was
trained with). llama.cpp never tokenizes here, so that label cannot change a number.
Needs llama-cpp-python; without it, or without the converter, one line and exit 2.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "tools"))  # shown.py

from uptrain.errors import UsageError  # noqa: E402
from uptrain.measure import gguf  # noqa: E402

# llama.cpp's cache type -> uptrain's format that emulates it (uptrain.measure.kv_cache.FORMATS)
EMULATED = {"f32": "model", "f16": "fp16", "bf16": "bf16", "q8_0": "q8_0", "q4_0": "q4_0"}
BASELINE = "f32"

# Run as `python -c SHIM CONVERTER ARGS...`: llama.cpp's converter, with an unknown BPE pre-tokenizer
# written as GPT-2's instead of stopping (see the module docstring; ids are never tokenized by llama.cpp).
SHIM = """
import os, runpy, sys
conv = sys.argv[1]; sys.argv = [conv] + sys.argv[2:]
here = os.path.dirname(os.path.abspath(conv))
sys.path[:0] = [here, os.path.join(here, "gguf-py")]
import conversion.base as base
known = base.TextModel.get_vocab_base_pre
def pre(self, tokenizer):
    try:
        return known(self, tokenizer)
    except NotImplementedError:
        print("kv_cache_parity: unknown BPE pre-tokenizer written as gpt-2", file=sys.stderr)
        return "gpt-2"
base.TextModel.get_vocab_base_pre = pre
runpy.run_path(conv, run_name="__main__")
"""


def convert_f32(folder: Path, out_file: Path, converter: Path) -> Path:
    """`folder` as a GGUF with float32 weights (llama.cpp's converter through SHIM); one-line error on failure."""
    cmd = [sys.executable, "-c", SHIM, str(converter), str(folder), "--outfile", str(out_file), "--outtype", "f32"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not out_file.is_file():
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UsageError(f"{gguf.CONVERTER} failed on {folder} (exit {done.returncode}): {last}")
    return out_file


def load_llama(path: Path, n_ctx: int, threads: int, kv_type: str, flash_attn: bool = True):
    """(llama_cpp.Llama, its KvCache line) with K and V cached as `kv_type`, all logits kept, and a
    batch as long as the context (a window is evaluated in one decode)."""
    llm, _, kv = gguf.load_llama(path, n_ctx, threads, logits_all=True, kv_type=kv_type, flash_attn=flash_attn,
                                 n_batch=n_ctx)
    if kv is None or (kv.k_type, kv.v_type) != (kv_type, kv_type):
        raise UsageError(f"llama.cpp did not allocate a {kv_type} K/V cache (its log: {kv})")
    return llm, kv


def llama_window(llm, ids: list[int]):
    """llama.cpp's logits [len(ids), vocab] (float32 tensor) of one window, from an empty cache."""
    import torch

    llm.reset()  # n_tokens = 0: eval() then removes every cached cell before decoding
    with gguf.quiet():
        llm.eval(ids)
    return torch.from_numpy(llm.scores[: len(ids)].copy())


@dataclass
class Pair:
    """Running sums of one llama.cpp cache type and its emulation over the scored tokens."""

    llama_type: str
    emulated: str
    llama_nll: list[float] = field(default_factory=list)  # per scored token (nats)
    emulated_nll: list[float] = field(default_factory=list)
    kl_sum: float = 0.0  # sum over tokens of KL(llama.cpp || emulation)
    kl_unemulated_sum: float = 0.0  # sum over tokens of KL(llama.cpp || the model as saved, no emulation)
    max_abs_logit_diff: float = 0.0
    argmax_agree: int = 0

    def add(self, ll_logits, emu_logits, plain_logits, targets) -> None:
        """One window's scored logits [n, vocab] (llama.cpp, emulation, the model with no emulation), targets [n]."""
        import torch.nn.functional as F

        ll = F.log_softmax(ll_logits.double(), -1)
        emu = F.log_softmax(emu_logits.double(), -1)
        plain = F.log_softmax(plain_logits.double(), -1)
        self.llama_nll += (-ll.gather(-1, targets[:, None])[:, 0]).tolist()
        self.emulated_nll += (-emu.gather(-1, targets[:, None])[:, 0]).tolist()
        self.kl_sum += float((ll.exp() * (ll - emu)).sum())
        self.kl_unemulated_sum += float((ll.exp() * (ll - plain)).sum())
        self.max_abs_logit_diff = max(self.max_abs_logit_diff, float((ll_logits - emu_logits).abs().max()))
        self.argmax_agree += int((ll_logits.argmax(-1) == emu_logits.argmax(-1)).sum())


def mean_se(values: list[float]) -> tuple[float, float]:
    """(mean, standard error of the mean) of per-token values."""
    n = len(values)
    m = sum(values) / n
    var = sum((v - m) ** 2 for v in values) / max(n - 1, 1)
    return m, math.sqrt(var / n)


def score_all(model, docs, spans_of, llms: dict, pairs: dict[str, Pair], formats: dict) -> None:
    """Every window of every document through every llama.cpp context and its emulation.

    docs: LongTensors [seq]; spans_of(n) -> window_spans; llms / formats: llama type -> Llama / KVFormat.
    """
    import torch

    from uptrain.measure.fidelity import scored_window

    for ids in docs:
        for begin, end, first in spans_of(ids.numel()):
            window = ids[begin:end].tolist()
            rows = slice(first - begin - 1, end - begin - 1)  # window position i predicts token i + 1
            with torch.no_grad():
                emu = {t: scored_window(model, ids, (begin, end, first), formats[t]) for t in pairs}  # [n, vocab], [n]
            plain = emu[BASELINE][0]  # formats[BASELINE] is None: the model as saved
            for t, pair in pairs.items():
                pair.add(llama_window(llms[t], window)[rows], emu[t][0].float(), plain.float(), emu[t][1])


def row_of(pair: Pair, base: Pair, evaluated: float) -> dict:
    """The reported numbers of one cache type (`base`: the f32 <-> model pair, the same tokens)."""
    n = len(pair.llama_nll)
    ll, ll_se = mean_se(pair.llama_nll)
    emu, _ = mean_se(pair.emulated_nll)
    diff, diff_se = mean_se([a - b for a, b in zip(pair.emulated_nll, pair.llama_nll)])
    ll_change, ll_change_se = mean_se([a - b for a, b in zip(pair.llama_nll, base.llama_nll)])
    emu_change, emu_change_se = mean_se([a - b for a, b in zip(pair.emulated_nll, base.emulated_nll)])
    miss, miss_se = mean_se([(a - b) - (c - d) for a, b, c, d in
                             zip(pair.emulated_nll, base.emulated_nll, pair.llama_nll, base.llama_nll)])
    return {"llama_cpp_type": pair.llama_type, "flash_attn": pair.llama_type != BASELINE, "emulated": pair.emulated,
            "tokens": n,
            "llama_cpp_loss": ll, "llama_cpp_loss_se": ll_se, "emulated_loss": emu,
            "emulated_loss_by_evaluate": evaluated, "difference": diff, "difference_se": diff_se,
            "baseline_difference_f32": mean_se([a - b for a, b in zip(base.emulated_nll, base.llama_nll)])[0],
            "max_abs_logit_diff": pair.max_abs_logit_diff, "kl_llama_cpp_to_emulated": pair.kl_sum / n,
            "kl_llama_cpp_to_unemulated": pair.kl_unemulated_sum / n,
            "argmax_agree": pair.argmax_agree / n,
            "llama_cpp_change_vs_f32": ll_change, "llama_cpp_change_se": ll_change_se,
            "emulated_change_vs_model": emu_change, "emulated_change_se": emu_change_se,
            "change_error": miss, "change_error_se": miss_se}


def run_parity(model_dir: Path, texts: list[str], llama_types: list[str], max_length: int, stride: int,
               converter: Path, threads: int, work: Path) -> list[dict]:
    """The parity rows (f32 first) of MODEL over `texts` for each llama.cpp type (see the module docstring)."""
    import torch

    from uptrain.measure.eval import evaluate, tokenize_texts
    from uptrain.measure.fidelity import window_spans
    from uptrain.measure.kv_cache import active, check_paths, kv_format
    from uptrain.measure.models import load_model

    types = [BASELINE, *(t for t in llama_types if t != BASELINE)]
    formats = {t: active(kv_format(EMULATED[t])) for t in types}
    for fmt in formats.values():
        if fmt is not None:
            check_paths(fmt, [model_dir])  # llama.cpp refuses a block its head_dim is no multiple of
    model, tokenizer = load_model(str(model_dir), "auto", "cpu")
    if model.dtype != torch.float32:
        raise UsageError(f"{model_dir} is saved in {model.dtype}: the parity compares float32 weights in both runtimes")
    docs = list(tokenize_texts(tokenizer, texts))
    path = convert_f32(model_dir, work / f"{model_dir.name}-f32.gguf", converter)
    llms = {t: load_llama(path, max_length, threads, t, flash_attn=t != BASELINE)[0] for t in types}
    pairs = {t: Pair(t, EMULATED[t]) for t in types}
    try:
        score_all(model, docs, lambda n: window_spans(n, max_length, stride), llms, pairs, formats)
    finally:
        with gguf.quiet():
            for llm in llms.values():
                llm.close()
    evaluated = {t: evaluate(model, docs, max_length, stride, kv=formats[t]).loss for t in types}
    rows = [row_of(pairs[t], pairs[BASELINE], evaluated[t]) for t in types]
    for r in rows:  # the same tokens, the same windows, the same forward: the same number, to rounding
        if abs(r["emulated_loss"] - r["emulated_loss_by_evaluate"]) > 1e-6:
            raise RuntimeError(f"window sum {r['emulated_loss']} != evaluate {r['emulated_loss_by_evaluate']}")
    return rows


def markdown(rows: list[dict]) -> str:
    """The parity table, a row per llama.cpp cache type (f32 first: the runtimes' baseline)."""
    head = ("| llama.cpp cache (uptrain emulation) | loss llama.cpp | loss emulated | difference (SE) "
            "| max abs logit diff | KL(llama.cpp ‖ emulated) | KL(llama.cpp ‖ model, no emulation) | argmax agree "
            "| loss change llama.cpp vs f32 | loss change emulated vs model | change error (SE) |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|\n")
    lines = [f"| {r['llama_cpp_type']}{'' if r['flash_attn'] else ', no FA'} ({r['emulated']}) | "
             f"{r['llama_cpp_loss']:.6f} | {r['emulated_loss']:.6f} | "
             f"{r['difference']:+.2e} ({r['difference_se']:.1e}) | {r['max_abs_logit_diff']:.2e} | "
             f"{r['kl_llama_cpp_to_emulated']:.2e} | {r['kl_llama_cpp_to_unemulated']:.2e} | {r['argmax_agree']:.4f} | "
             f"{r['llama_cpp_change_vs_f32']:+.2e} | {r['emulated_change_vs_model']:+.2e} | "
             f"{r['change_error']:+.2e} ({r['change_error_se']:.1e}) |"
             for r in rows]
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    from uptrain.measure.eval import add_data_args, read_cli_documents, window_args
    from uptrain.threads import add_threads_arg, start_threads
    from shown import shown, shown_command

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="a Hugging Face model folder (float32 weights)")
    add_data_args(parser)
    parser.add_argument("--kv-cache", default="f16,q8_0,q4_0", help="llama.cpp cache types, a comma list of "
                        f"{', '.join(t for t in EMULATED if t != BASELINE)} (f32 is always run: the baseline)")
    parser.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp checkout with convert_hf_to_gguf.py "
                        "(or $LLAMA_CPP_DIR)")
    add_threads_arg(parser, "transformers and llama.cpp")
    parser.add_argument("--json", type=Path, help="write the rows and the settings here")
    args = parser.parse_args(argv)
    began = time.monotonic()
    try:
        gguf.require_llama_cpp()
        converter = gguf.find_converter(args.llama_cpp)
        types = [t.strip() for t in args.kv_cache.split(",") if t.strip()]
        bad = [t for t in types if t not in EMULATED]
        if bad or not types:
            raise UsageError(f"--kv-cache takes llama.cpp cache types of {', '.join(EMULATED)}, got {args.kv_cache!r}")
        max_length, stride = window_args(args, [str(args.model)])
        threads = start_threads(args.threads).threads
        texts = read_cli_documents(args)
        with tempfile.TemporaryDirectory(prefix="kv-parity-") as tmp:
            rows = run_parity(args.model, texts, types, max_length, stride, converter, threads, Path(tmp))
    except UsageError as e:
        print(f"kv_cache_parity: {e}", file=sys.stderr)
        return 2
    import llama_cpp

    table = markdown(rows)
    print(table)
    if args.json:
        record = {"command": "python scripts/deploy/kv_cache_parity.py " + shown_command(argv or sys.argv[1:]),
                  "model": shown(args.model), "data": [shown(d) for d in args.data or []],
                  "documents": len(texts), "max_length": max_length, "stride": stride, "threads": threads,
                  "llama_cpp_python": llama_cpp.__version__, "flash_attn": "on, except the f32 baseline",
                  "gguf_weights": "f32", "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
                  "seconds": round(time.monotonic() - began, 1),
                  "rows": rows}
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
