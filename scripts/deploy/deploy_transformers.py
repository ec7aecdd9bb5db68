"""Check a converted folder where users deploy it: transformers' static cache, torch.export, ONNX, vLLM's fields.

    python scripts/deploy/deploy_transformers.py MODEL [--prompt TEXT] [--new-tokens 16] [--max-cache-len 64]
        [--out DIR] [--no-onnx] [--compile] [--tolerance 1e-4] [--json PATH]

Every check runs the same greedy decode of `--new-tokens` tokens after the prompt, and compares
with transformers' own `generate` on its default (dynamic) cache, the reference:
- static cache: `generate(..., cache_implementation="static")`: same tokens, per-step logits
  within `--tolerance`, and the StaticCache's allocated K/V tensors are
  [batch, num_key_value_heads, max_cache_len, head_dim] (K/V heads, not query heads);
  `--compile` also times `torch.compile(model.forward)` with the static cache (minutes on a CPU).
- torch.export: transformers' `TorchExportableModuleForDecoderOnlyLM` (static cache held as
  buffers; the ExecuTorch recipe), exported once with a dynamic sequence length; prefill and each
  decode step of the exported program against eager logits, its cache buffers' shape.
- ONNX (needs `pip install -e '.[deploy]'`): `torch.onnx.export(dynamo=True)` of the forward with
  the past K/V as explicit inputs and outputs (stacked [layers, batch, kv_heads, past, head_dim]),
  run in onnxruntime: prefill and each decode step against eager logits, the graph's K/V input shape.
- vLLM's fields (vLLM itself is not run): config.json has what vLLM's loader reads, and every
  layer's q/k/v projection in the safetensors headers has the rows that config implies.
Exit 0 when every check passes, 1 when one fails (the table says which), 2 on bad input.
`--out DIR` keeps the exported files: model.pt2 (torch.export.save) and model.onnx.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "tools"))  # shown.py

import torch  # noqa: E402

# The exporters' own notices are not findings: torch.onnx logs each torchvision op it skips (no
# torchvision here) and warns about deprecated pytree specs and merged axis names. The table says
# what was checked; the warnings came before it and hid it.
import logging  # noqa: E402
import warnings  # noqa: E402

logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", category=FutureWarning, message=".*LeafSpec.*")
warnings.filterwarnings("ignore", category=UserWarning, message=".*axis name.*")

from uptrain.cli import format_table, write_json  # noqa: E402
from uptrain.convert.io.hfconfig import model_shape  # noqa: E402
from uptrain.convert.io.passthrough import read_header  # noqa: E402
from uptrain.errors import UsageError, exit_on_usage_error  # noqa: E402
from shown import shown  # noqa: E402  (scripts/tools/shown.py: paths as results/ names them)

# config.json fields vLLM's Llama-family loader reads (through transformers' AutoConfig)
VLLM_FIELDS = ("architectures", "model_type", "hidden_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "vocab_size", "max_position_embeddings", "rms_norm_eps")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")  # either is enough for AutoTokenizer
ONNX_EXTRA = "pip install -e '.[deploy]' (onnx, onnxruntime, onnxscript)"
DEFAULT_PROMPT = "Once upon a time, there was a little"
DEFAULT_MAX_CACHE_LEN = 64  # the exported program's static cache length


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over all elements, in float64."""
    return float((a.double() - b.double()).abs().max())


# ---------------------------------------------------------------- vLLM's fields (files only)
def vllm_fields(folder: Path) -> dict[str, Any]:
    """What vLLM reads from `folder`, and every mismatch between config.json and the weights.

    vLLM sizes its fused qkv projection from config.json (heads x head_dim rows for Q,
    kv_heads x head_dim for each of K and V) and copies each checkpoint tensor into it, so a
    config whose K/V head count disagrees with the k_proj/v_proj rows cannot load.
    """
    cfg = json.loads((folder / "config.json").read_text())
    problems = [f"config.json lacks {f}" for f in VLLM_FIELDS if f not in cfg]
    heads, kv = cfg.get("num_attention_heads", 0), cfg.get("num_key_value_heads", 0)
    head_dim = cfg.get("head_dim") or (cfg.get("hidden_size", 0) // heads if heads else 0)
    if heads and kv and heads % kv:
        problems.append(f"{heads} query heads are not a multiple of {kv} K/V heads")
    want = {"q_proj": heads * head_dim, "k_proj": kv * head_dim, "v_proj": kv * head_dim}
    checked = 0
    for file in sorted(folder.glob("*.safetensors")):
        header, _ = read_header(file)
        for name, entry in header.items():
            proj = name.split(".")[-2] if name.endswith(".weight") else ""
            if ".self_attn." in name and proj in want:
                checked += 1
                if entry["shape"][0] != want[proj]:
                    problems.append(f"{name} has {entry['shape'][0]} rows; config.json implies {want[proj]}")
    if not checked:
        problems.append("no self_attn.{q,k,v}_proj weights found: fused-qkv layouts are not checked here")
    tokenizer = [f for f in TOKENIZER_FILES if (folder / f).is_file()]
    if not tokenizer:
        problems.append("no tokenizer.json or tokenizer.model: vLLM needs --tokenizer DIR")
    return {"architectures": cfg.get("architectures"), "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": head_dim, "dtype": cfg.get("dtype", cfg.get("torch_dtype")), "tokenizer_files": tokenizer,
            "projections_checked": checked, "problems": problems, "ok": not problems}


# ---------------------------------------------------------------- the reference and the static cache
def greedy(model, ids: torch.Tensor, new_tokens: int, **kwargs: Any):
    """generate()'s greedy decode: (all token ids [1, prompt + new], logits of each new step [new, vocab], output)."""
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences, torch.cat(out.logits, 0), out


def static_cache_check(model, ids: torch.Tensor, new_tokens: int, reference: tuple) -> dict[str, Any]:
    """generate with cache_implementation="static" against the dynamic-cache `reference` (tokens, logits)."""
    tokens, logits, out = greedy(model, ids, new_tokens, cache_implementation="static")
    shapes = sorted({tuple(layer.keys.shape) for layer in out.cache.layers}
                    | {tuple(layer.values.shape) for layer in out.cache.layers})
    cfg = model.config
    # generate sizes the cache itself (prompt + new tokens - 1: the last token is never written
    # back); what matters here is the head axis: K/V heads, and every layer alike
    written = ids.shape[1] + new_tokens - 1
    shape_ok = len(shapes) == 1 and shapes[0][:2] == (1, cfg.num_key_value_heads) \
        and shapes[0][3] == model_shape(cfg).head_dim and shapes[0][2] >= written
    kv_bytes = sum(t.numel() * t.element_size() for layer in out.cache.layers for t in (layer.keys, layer.values))
    return {"cache_class": type(out.cache).__name__, "tokens_equal": torch.equal(tokens, reference[0]),
            "max_abs_logit_diff": max_diff(logits, reference[1]), "kv_shapes": [list(s) for s in shapes],
            "expected_kv_shape": [1, cfg.num_key_value_heads, f">= {written}", model_shape(cfg).head_dim], "kv_bytes": kv_bytes,
            "shape_ok": shape_ok}


def compile_check(model, ids: torch.Tensor, new_tokens: int, reference: tuple) -> dict[str, Any]:
    """torch.compile(model.forward) with the static cache: same tokens, and how long the first call took."""
    eager_forward = model.forward
    model.forward = torch.compile(model.forward, fullgraph=True)
    try:
        start = time.perf_counter()
        tokens, logits, _ = greedy(model, ids, new_tokens, cache_implementation="static")
        first = time.perf_counter() - start
    finally:
        model.forward = eager_forward
    return {"tokens_equal": torch.equal(tokens, reference[0]), "max_abs_logit_diff": max_diff(logits, reference[1]),
            "first_call_s": round(first, 1)}


# ---------------------------------------------------------------- torch.export (ExecuTorch recipe)
def export_check(model, ids: torch.Tensor, new_tokens: int, max_cache_len: int, reference: tuple,
                 prefill: torch.Tensor, save: Path | None) -> dict[str, Any]:
    """Export with a static cache (dynamic sequence length), then prefill + greedy steps through the program."""
    from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

    model.generation_config.cache_implementation = "static"  # the recipe refuses other caches
    seq = torch.export.Dim("seq", min=1, max=max_cache_len - 1)
    start = time.perf_counter()
    with torch.no_grad():
        program = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=max_cache_len).export(
            input_ids=ids, cache_position=torch.arange(ids.shape[1]), strict=False,
            dynamic_shapes={"input_ids": {1: seq}, "cache_position": {0: seq}})
    seconds = time.perf_counter() - start
    model.generation_config.cache_implementation = None
    shapes = sorted({tuple(b.shape) for n, b in program.named_buffers() if "key_cache" in n or "value_cache" in n})
    run = program.module()
    with torch.no_grad():
        first = run(input_ids=ids, cache_position=torch.arange(ids.shape[1]))
        tokens, steps, pos = [int(first[0, -1].argmax())], [first[0, -1]], ids.shape[1]
        for _ in range(new_tokens - 1):
            out = run(input_ids=torch.tensor([[tokens[-1]]]), cache_position=torch.tensor([pos]))
            tokens.append(int(out[0, -1].argmax()))
            steps.append(out[0, -1])
            pos += 1
    if save is not None:
        torch.export.save(program, save)
    return {"export_s": round(seconds, 1), "prefill_max_abs_diff": max_diff(first[0], prefill[0]),
            "decode_max_abs_diff": max_diff(torch.stack(steps), reference[1]),
            "tokens_equal": tokens == reference[0][0, ids.shape[1]:].tolist(),
            "kv_buffer_shapes": [list(s) for s in shapes], "shape_ok": shapes == [(1, model.config.num_key_value_heads,
                                                                               max_cache_len, model_shape(model.config).head_dim)]}


# ---------------------------------------------------------------- ONNX (onnxruntime)
class WithPast(torch.nn.Module):
    """forward(input_ids [1, seq], past_keys, past_values [layers, 1, kv_heads, past, head_dim])
    -> logits [1, seq, vocab], present_keys, present_values [layers, 1, kv_heads, past + seq, head_dim]."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids, past_keys, past_values):
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        for i in range(past_keys.shape[0]):
            cache.update(past_keys[i], past_values[i], i)
        out = self.model(input_ids=input_ids, cache=cache, use_cache=True)
        return (out.logits, torch.stack([layer.keys for layer in out.cache.layers]),
                torch.stack([layer.values for layer in out.cache.layers]))


def onnx_check(model, ids: torch.Tensor, new_tokens: int, reference: tuple, prefill: torch.Tensor,
               path: Path) -> dict[str, Any]:
    """Export WithPast(model) with dynamo to `path`, run prefill + greedy steps in onnxruntime."""
    import onnxruntime

    cfg = model.config
    wrapped = WithPast(model).eval()
    empty = torch.zeros(cfg.num_hidden_layers, 1, cfg.num_key_value_heads, 0, model_shape(cfg).head_dim)
    split = max(1, ids.shape[1] // 2)  # a non-empty past in the example, so export does not fix it at 0
    with torch.no_grad():
        _, keys, values = wrapped(ids[:, :split], empty, empty)
    seq, past = torch.export.Dim("seq", min=1, max=1024), torch.export.Dim("past", min=0, max=1024)
    start = time.perf_counter()
    torch.onnx.export(wrapped, (ids[:, split:], keys, values), str(path), dynamo=True, verbose=False,
                      input_names=["input_ids", "past_keys", "past_values"],
                      output_names=["logits", "present_keys", "present_values"],
                      dynamic_shapes={"input_ids": {1: seq}, "past_keys": {3: past}, "past_values": {3: past}})
    seconds = time.perf_counter() - start
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    key_input = next(i.shape for i in session.get_inputs() if i.name == "past_keys")
    logits, keys, values = session.run(None, {"input_ids": ids.numpy(), "past_keys": empty.numpy(),
                                              "past_values": empty.numpy()})
    first = torch.from_numpy(logits)
    tokens, steps = [int(first[0, -1].argmax())], [first[0, -1]]
    for _ in range(new_tokens - 1):
        logits, keys, values = session.run(None, {"input_ids": torch.tensor([[tokens[-1]]]).numpy(),
                                                  "past_keys": keys, "past_values": values})
        tokens.append(int(logits[0, -1].argmax()))
        steps.append(torch.from_numpy(logits[0, -1]))
    return {"export_s": round(seconds, 1), "prefill_max_abs_diff": max_diff(first[0], prefill[0]),
            "decode_max_abs_diff": max_diff(torch.stack(steps), reference[1]),
            "tokens_equal": tokens == reference[0][0, ids.shape[1]:].tolist(),
            "past_keys_input_shape": [str(d) for d in key_input],
            "shape_ok": key_input[2] == cfg.num_key_value_heads and key_input[4] == model_shape(cfg).head_dim,
            "file_bytes": path.stat().st_size}


# ---------------------------------------------------------------- CLI
def passed(result: dict[str, Any], tolerance: float) -> bool:
    """A check passes when its tokens equal the reference's, its logits are within `tolerance`
    and its K/V shapes carry the K/V head count."""
    diffs = [v for k, v in result.items() if k.endswith("_diff")]
    return (result.get("ok", True) and result.get("tokens_equal", True) and result.get("shape_ok", True)
            and all(d <= tolerance for d in diffs))


def prompt_ids(folder: Path, prompt: str, vocab: int) -> tuple[torch.Tensor, str]:
    """The prompt's token ids [1, n] from the folder's tokenizer; seeded random ids where it has none."""
    if any((folder / f).is_file() for f in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt").input_ids, "tokenizer"
    return torch.randint(3, vocab, (1, 12), generator=torch.Generator().manual_seed(0)), "random ids (no tokenizer)"


def summary(results: dict[str, dict[str, Any]], tolerance: float) -> str:
    """One row per check: verdict, tokens, max abs diff and the K/V shape it saw."""
    rows = []
    for name, r in results.items():
        if "skipped" in r:
            rows.append([name, "skipped", "", "", r["skipped"]])
            continue
        diffs = {k: v for k, v in r.items() if k.endswith("_diff")}
        shape = next((json.dumps(r[k]) for k in ("kv_shapes", "kv_buffer_shapes", "past_keys_input_shape", "problems")
                      if r.get(k)), "")
        if not shape and "projections_checked" in r:
            shape = f"{r['projections_checked']} q/k/v projections match config.json"
        rows.append([name, "pass" if passed(r, tolerance) else "FAIL", r.get("tokens_equal", ""),
                     " ".join(f"{k.replace('_max_abs_diff', '').replace('max_abs_', '')}={v:.2e}"
                              for k, v in diffs.items()),
                     shape])
    return format_table(["check", "verdict", "tokens equal", "max abs diff", "K/V shape / problems"], rows)


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python scripts/deploy/deploy_transformers.py", description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path, help="a converted model folder (config.json + safetensors)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--max-cache-len", type=int, default=DEFAULT_MAX_CACHE_LEN,
                   help="the exported program's static cache length")
    p.add_argument("--tolerance", type=float, default=1e-4, help="largest max |logit diff| that passes (float32)")
    p.add_argument("--out", type=Path, help="keep model.pt2 and model.onnx here")
    p.add_argument("--no-onnx", action="store_true", help="skip the ONNX check (it needs the deploy extra)")
    p.add_argument("--compile", action="store_true", help="also torch.compile the static-cache decode (slow on CPU)")
    p.add_argument("--json", help="write the results here ('-' for stdout)")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        raise UsageError(f"{args.model}: no config.json there; pass a converted model folder "
                         "(python -m uptrain.convert CKPT --kv-heads N --out DIR)")
    if args.new_tokens < 1 or args.tolerance <= 0:
        raise UsageError("--new-tokens must be >= 1 and --tolerance > 0")
    if not args.no_onnx:
        try:
            import onnxruntime  # noqa: F401
            import onnxscript  # noqa: F401
        except ImportError:
            raise UsageError(f"the ONNX check needs the deploy extra: {ONNX_EXTRA}; or pass --no-onnx") from None
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    ids, source = prompt_ids(args.model, args.prompt, model.config.vocab_size)
    if ids.shape[1] + args.new_tokens >= args.max_cache_len:
        raise UsageError(f"prompt ({ids.shape[1]} tokens) + --new-tokens {args.new_tokens} must be below "
                         f"--max-cache-len {args.max_cache_len}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        prefill = model(ids).logits
    reference = greedy(model, ids, args.new_tokens)[:2]
    results: dict[str, dict[str, Any]] = {"vllm_fields": vllm_fields(args.model)}
    results["static_cache"] = static_cache_check(model, ids, args.new_tokens, reference)
    if args.compile:
        results["static_cache_compiled"] = compile_check(model, ids, args.new_tokens, reference)
    results["torch_export"] = export_check(model, ids, args.new_tokens, args.max_cache_len, reference, prefill,
                                           args.out / "model.pt2" if args.out else None)
    if args.no_onnx:
        results["onnx"] = {"skipped": "--no-onnx"}
    else:
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            path = args.out / "model.onnx" if args.out else Path(tmp) / "model.onnx"
            results["onnx"] = onnx_check(model, ids, args.new_tokens, reference, prefill, path)
    cfg = model.config
    print(f"{args.model}: {cfg.num_attention_heads} query heads, {cfg.num_key_value_heads} K/V heads; prompt "
          f"{ids.shape[1]} tokens ({source}), {args.new_tokens} greedy tokens; float32; tolerance {args.tolerance:g}")
    print(summary(results, args.tolerance))
    ok = all(passed(r, args.tolerance) for r in results.values() if "skipped" not in r)
    if args.json:
        write_json({"model": shown(args.model), "prompt_tokens": ids.shape[1], "prompt_source": source,
                    "new_tokens": args.new_tokens, "tolerance": args.tolerance, "torch": torch.__version__,
                    "transformers": __import__("transformers").__version__, "passed": ok, "checks": results}, args.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
