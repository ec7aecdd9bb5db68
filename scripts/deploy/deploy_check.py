"""Check that a model folder runs in llama.cpp as it does in transformers (GGUF conversion, logits, KV cache).

    python scripts/deploy/deploy_check.py MODEL [MODEL ...] --llama-cpp DIR [--outtype f32] [--n-ctx 512]
        [--text examples/data/tinystories-valid-sample.txt] [--json OUT.json] [--md OUT.md]

For each model folder: convert it to GGUF with llama.cpp's convert_hf_to_gguf.py (from --llama-cpp
DIR: a llama.cpp checkout, or the vendor/llama.cpp folder of the llama-cpp-python sdist), load it
in llama_cpp.Llama (logits_all, a context of --n-ctx tokens) and report:
  * logits on the SAME token ids in both runtimes: max |diff| and argmax agreement over all positions;
  * perplexity from those ids in both;
  * from raw text: whether llama.cpp tokenizes as transformers does, and each runtime's perplexity
    from its own tokenization (a folder without tokenizer.json gets random ids and no text checks);
  * the GGUF's head_count_kv against config.json's num_key_value_heads;
  * the KV cache llama.cpp allocates (its log line) against 2 x layers x kv_heads x head_dim x
    bytes x cells.
Not part of the test suite: it needs llama-cpp-python (which builds llama.cpp, minutes). Without
it, or without the converter, it stops in one line (exit 2) saying how to install them.
Results: results/deploy-llama-cpp.md and .json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "tools"))  # shown.py

from uptrain.errors import UsageError  # noqa: E402
from uptrain.measure import gguf  # noqa: E402
from uptrain.threads import add_threads_arg, start_threads  # noqa: E402
from shown import shown  # noqa: E402  (scripts/tools/shown.py: paths as results/ names them)


def logit_agreement(a, b) -> dict:
    """max |a - b| and how many positions share the argmax; a, b: [T, vocab] float tensors."""
    return {"max_abs_diff": float((a - b).abs().max()), "positions": a.shape[0],
            "argmax_agree": int((a.argmax(-1) == b.argmax(-1)).sum())}


def perplexity(logits, ids) -> float:
    """exp(mean NLL) of ids[1:] under logits[:-1]; logits [T, vocab], ids [T]."""
    import torch

    nll = torch.nn.functional.cross_entropy(logits[:-1].double(), ids[1:], reduction="mean")
    return float(torch.exp(nll))


def hf_logits(model, ids: list[int]):
    """transformers' logits [T, vocab] (float32) for one sequence."""
    import torch

    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def llama_logits(llm, ids: list[int]):
    """llama.cpp's logits [T, vocab] for one sequence, from a fresh cache."""
    import torch

    llm.reset()
    with gguf.quiet():
        llm.eval(ids)
    return torch.from_numpy(llm.scores[: len(ids)].copy())


def check_model(folder: Path, converter: Path, outtype: str, n_ctx: int, text: str, threads: int, tmp: Path,
                kv_type: str = "f16") -> dict:
    """All checks of one model folder (see the module docstring); a JSON-able dict."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from uptrain.convert.io.hfconfig import model_shape
    from uptrain.measure.bench_llama import TYPE_BYTES, kv_formula, random_tokens

    out = gguf.convert_to_gguf(folder, tmp / f"{folder.name}.gguf", converter, outtype)
    config = AutoConfig.from_pretrained(folder)
    shape = model_shape(config)
    limit = config.max_position_embeddings
    n_ctx = min(n_ctx, limit)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    llm, _, kv = gguf.load_llama(out, n_ctx, threads, logits_all=True, kv_type=kv_type)
    meta = gguf.gguf_meta(llm)
    row: dict = {"model": shown(folder), "gguf": out.name, "outtype": outtype, "kv_type": kv_type, "gguf_bytes": out.stat().st_size,
                 "n_ctx": n_ctx, "config_kv_heads": shape.kv_heads,
                 "gguf_head_count_kv": gguf.arch_value(meta, "attention.head_count_kv"),
                 "gguf_tokenizer": meta.get("tokenizer.ggml.model")}
    has_tokenizer = (folder / "tokenizer.json").is_file()
    if has_tokenizer:
        tok = AutoTokenizer.from_pretrained(folder)
        hf_ids = tok(text)["input_ids"][:n_ctx]  # with <s>, as transformers adds it
        ll_ids = llm.tokenize(text.encode("utf-8"), add_bos=True)[:n_ctx]
        ids = hf_ids
    else:
        ids = [1] + random_tokens(n_ctx - 1, config.vocab_size)
    a, b = hf_logits(model, ids), llama_logits(llm, ids)
    t = torch.tensor(ids)
    row["same_ids"] = logit_agreement(a, b) | {"ppl_transformers": perplexity(a, t), "ppl_llama_cpp": perplexity(b, t)}
    if has_tokenizer:
        first = next((i for i, (x, y) in enumerate(zip(hf_ids, ll_ids)) if x != y), None)
        row["raw_text"] = {"tokens_transformers": len(hf_ids), "tokens_llama_cpp": len(ll_ids),
                           "identical": hf_ids == ll_ids, "first_difference": first,
                           "ppl_transformers": perplexity(a, t),
                           "ppl_llama_cpp": perplexity(llama_logits(llm, ll_ids), torch.tensor(ll_ids))}
    formula = kv_formula(shape.layers, shape.kv_heads, shape.head_dim, kv.k_type, kv.cells)
    row["kv_cache"] = {"llama_cpp_bytes": kv.bytes, "cells": kv.cells, "layers": kv.layers, "type": kv.k_type,
                       "formula_bytes": formula, "formula": f"2 x {shape.layers} layers x {shape.kv_heads} "
                       f"kv_heads x {shape.head_dim} head_dim x {TYPE_BYTES.get(kv.k_type, 2)} B x {kv.cells} cells",
                       "equal_within_log_rounding": abs(kv.bytes - formula) <= 0.005 * gguf.MIB + 1}
    with gguf.quiet():
        llm.close()
    return row


def markdown(rows: list[dict]) -> str:
    """One table of the checks, a row per model."""
    head = ("| model | GGUF; KV cache | head_count_kv (config) | logits max abs diff | argmax agree | ppl ids: transformers / llama.cpp "
            "| raw text: same tokens? | ppl raw text: transformers / llama.cpp | KV llama.cpp (formula) |\n"
            "|---|---|---|---|---|---|---|---|---|\n")
    lines = []
    for r in rows:
        s, kv, raw = r["same_ids"], r["kv_cache"], r.get("raw_text")
        raw_same = "n/a (random ids)" if raw is None else (
            f"{'yes' if raw['identical'] else 'NO'} ({raw['tokens_transformers']} / {raw['tokens_llama_cpp']} tokens)")
        raw_ppl = "n/a" if raw is None else f"{raw['ppl_transformers']:.4f} / {raw['ppl_llama_cpp']:.4f}"
        lines.append(f"| {r['model']} | {r['outtype']}, {r['gguf_bytes'] / gguf.MIB:.1f} MiB; KV {r['kv_type']} | {r['gguf_head_count_kv']} "
                     f"({r['config_kv_heads']}) | {s['max_abs_diff']:.2e} | {s['argmax_agree']}/{s['positions']} | "
                     f"{s['ppl_transformers']:.4f} / {s['ppl_llama_cpp']:.4f} | {raw_same} | {raw_ppl} | "
                     f"{kv['llama_cpp_bytes'] / gguf.MIB:.2f} MiB ({kv['formula_bytes'] / gguf.MIB:.2f} MiB: {kv['formula']}) |")
    return head + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", type=Path, help="Hugging Face model folders")
    parser.add_argument("--llama-cpp", metavar="DIR", help="llama.cpp checkout with convert_hf_to_gguf.py (or $LLAMA_CPP_DIR)")
    parser.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"], help="GGUF weight type")
    parser.add_argument("--kv-type", default="f16", choices=gguf.KV_TYPES,
                        help="llama.cpp's KV cache type (f16: its default; f32 for an exact comparison)")
    parser.add_argument("--n-ctx", type=int, default=512, help="context (tokens), capped at the model's limit")
    parser.add_argument("--text", type=Path, default=REPO / "examples" / "data" / "tinystories-valid-sample.txt")
    add_threads_arg(parser, "transformers and llama.cpp")
    parser.add_argument("--keep-gguf", type=Path, help="write the GGUF files here instead of a temporary folder")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--md", type=Path)
    args = parser.parse_args(argv)
    try:
        gguf.require_llama_cpp()
        converter = gguf.find_converter(args.llama_cpp)
        for m in args.models:
            if not (m / "config.json").is_file():
                raise UsageError(f"{m} is not a model folder (no config.json)")
        threads = start_threads(args.threads).threads
        text = args.text.read_text(encoding="utf-8")
        with tempfile.TemporaryDirectory(prefix="deploy-check-") as tmp:
            where = args.keep_gguf or Path(tmp)
            where.mkdir(parents=True, exist_ok=True)
            rows = [check_model(m, converter, args.outtype, args.n_ctx, text, threads, where, args.kv_type)
                    for m in args.models]
    except UsageError as e:
        print(f"deploy_check: {e}", file=sys.stderr)
        return 2
    for r in rows:
        r["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, {threads} thread{'s' * (threads > 1)}"
    table = markdown(rows)
    print(table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    if args.md:
        args.md.write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
