"""Measure the fit's start where it refused before issue 43 (partial rotary, key norms, clip_qkv) against
mean pooling, family by family, on random-weight models; prints the tables of results/function-aware-starts.md.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 .venv/bin/python scripts/studies/fit_starts.py --work SCRATCH/fit-starts

Each case is a transformers model of the family (8 heads, 8 K/V heads, head_dim 8 (Gemma 3: 16), 4
layers, vocabulary 512 with stories260K's tokenizer), random weights (`tests/tiny.py`'s recipe: the
class's init plus N(0, 0.05²) on every parameter, seed 0), in two variants: `plain`, and `sharp` (q/k
weights x4, so attention is peaked and keys matter; behind shared or per-head key norms each head's key
rows also scaled by a log-normal(0, 0.7) factor, which the norm hides from the model, as real heads
differ in key length). Each is converted to 2 K/V heads by the CLI, `--method mean` and `--method fit
--calib examples/data/tinystories-train-sample.txt` (32,768 tokens, the default). Measured on the held-out
text (examples/data/tinystories-valid-sample.txt): each attention module's relative output error
||y' - y||² / ||y||² on the source's attention inputs of the first 8,192 tokens (256-token windows,
`refine.relative_error`), for mean, fit, and fit with mean-pooled keys (q/k projections and norms taken
from the mean conversion: what the keys' start adds); and the held-out loss (`uptrain.measure.eval`,
512-token windows, stride 256, first 8 stories) of source, mean and fit.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "tools"))  # shown.py

from shown import shown  # noqa: E402

MHA8 = REPO / "examples" / "stories260K-mha8"
TRAIN = REPO / "examples" / "data" / "tinystories-train-sample.txt"
VALID = REPO / "examples" / "data" / "tinystories-valid-sample.txt"
SMALL = dict(hidden_size=64, head_dim=8, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4,
             intermediate_size=32, vocab_size=512, max_position_embeddings=512, pad_token_id=0, bos_token_id=1,
             eos_token_id=2)
# case -> (model type, config extra, key norm kind)
CASES = {
    "phi (partial rotary 0.5)": ("phi", dict(partial_rotary_factor=0.5), None),
    "phi qk_layernorm": ("phi", dict(partial_rotary_factor=0.5, qk_layernorm=True), "shared"),
    "stablelm (partial rotary 0.25)": ("stablelm", dict(partial_rotary_factor=0.25, use_qkv_bias=True), None),
    "stablelm qk_layernorm": ("stablelm", dict(partial_rotary_factor=0.25, use_qkv_bias=True, qk_layernorm=True),
                              "per_head"),
    "cohere use_qk_norm": ("cohere", dict(use_qk_norm=True), "per_head"),
    "olmo2": ("olmo2", {}, "whole"),
    "qwen3": ("qwen3", {}, "shared"),
    "gemma3_text": ("gemma3_text", dict(head_dim=16, sliding_window=4), "shared"),
    "olmo clip_qkv 8": ("olmo", dict(clip_qkv=8.0), None),
}


def build(case: str, sharp: bool, folder: Path) -> Path:
    """The case's random-weight MHA model saved with stories260K's tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, extra, norm = CASES[case]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SMALL, **extra})).eval()
    gen, scales = torch.Generator().manual_seed(0), {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.05)
            if sharp and (".q_proj." in name or ".k_proj." in name):
                p.mul_(4.0)
            if sharp and ".k_proj." in name and norm in ("shared", "per_head"):
                layer = name.split(".k_proj.")[0]
                if layer not in scales:
                    scales[layer] = torch.empty(8).log_normal_(0, 0.7, generator=gen).repeat_interleave(p.shape[0] // 8)
                p.mul_(scales[layer].view(-1, *[1] * (p.dim() - 1)))
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(MHA8 / f, folder / f)
    return folder


def convert_cli(src: Path, out: Path, method: str) -> list[str]:
    """Run `python -m uptrain.convert` (the command a user types); returns it as the record shows it."""
    argv = [str(src), "--kv-heads", "2", "--method", method, "--out", str(out), "--force"]
    if method == "fit":
        argv += ["--calib", str(TRAIN)]
    subprocess.run([sys.executable, "-m", "uptrain.convert", *argv], check=True, capture_output=True, cwd=REPO)
    return ["python -m uptrain.convert"] + [shown(a) if "/" in a else a for a in argv]


def errors(source, converted, sequences) -> list[float]:
    """Each attention module's relative output error on the source's attention inputs of `sequences`."""
    from uptrain.convert.math.refine import attention_modules, call_with, capture, relative_error

    rec = capture(source, sequences)
    return [relative_error(m, call_with(rec[i].kwargs), rec[i].inputs, rec[i].outputs, range(len(rec[i].inputs)))
            for i, m in enumerate(attention_modules(converted))]


def with_mean_keys(fitted, mean):
    """`fitted` with every query/key parameter of its attention (projections, norms) taken from `mean`."""
    from uptrain.convert.math.refine import attention_modules

    for a, b in zip(attention_modules(fitted), attention_modules(mean)):
        theirs = dict(b.named_parameters())
        with torch.no_grad():
            for name, p in a.named_parameters():
                if name.split(".")[0].startswith(("q_", "k_")):
                    p.copy_(theirs[name])
    return fitted


def measure(case: str, sharp: bool, work: Path, sequences, texts) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from uptrain.measure.eval import evaluate, tokenize_texts

    folder = work / (re.sub(r"[^a-z0-9]+", "-", case.lower()).strip("-") + ("-sharp" if sharp else "-plain"))
    src = build(case, sharp, folder / "src")
    commands = [convert_cli(src, folder / m, m) for m in ("mean", "fit")]
    load = lambda p: AutoModelForCausalLM.from_pretrained(p).eval()  # noqa: E731
    original, mean, fit = load(src), load(folder / "mean"), load(folder / "fit")
    tokenized = list(tokenize_texts(AutoTokenizer.from_pretrained(src), texts))
    with torch.no_grad():
        loss = {k: evaluate(m, tokenized, 512, 256).loss for k, m in (("source", original), ("mean", mean),
                                                                       ("fit", fit))}
        loss |= {f"kl {k}": kl_to(original, m, sequences) for k, m in (("mean", mean), ("fit", fit))}
    return {"mean": errors(original, mean, sequences), "fit": errors(original, fit, sequences),
            "keys": errors(original, with_mean_keys(load(folder / "fit"), mean), sequences), "loss": loss,
            "commands": commands}


def kl_to(source, model, sequences) -> float:
    """Mean KL(source || model) of the next-token distributions over the tokens of `sequences`
    (nats/token): on random weights the loss alone does not say which model is closer to the source
    (a flatter model can score below its source), this does."""
    total = count = 0
    for ids in sequences:
        p = source(ids[None]).logits.float().log_softmax(-1)
        q = model(ids[None]).logits.float().log_softmax(-1)
        total += (p.exp() * (p - q)).sum().item()
        count += ids.numel()
    return total / count


def main() -> None:
    from transformers import AutoTokenizer

    from uptrain.convert.layers.calibrate import calibration_sequences, read_calibration_texts

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, required=True, help="scratch folder for the models")
    parser.add_argument("--only", nargs="*", default=None, help="case names (default: all)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    texts = read_calibration_texts(VALID)
    ids, _, _, _ = calibration_sequences(texts, AutoTokenizer.from_pretrained(MHA8), 8192, 256)
    sequences = [torch.tensor(s) for s in ids if len(s) > 1]
    fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
    print("| case | variant | mean | fit | fit, mean keys | loss source / mean / fit | KL to source: mean / fit |\n"
          "|---|---|---|---|---|---|---|")
    for case in args.only or CASES:
        for sharp in (False, True):
            r = measure(case, sharp, args.work, sequences, texts[:8])
            print(f"| {case} | {'sharp' if sharp else 'plain'} | {fmt(r['mean'])} | {fmt(r['fit'])} | {fmt(r['keys'])} | "
                  f"{r['loss']['source']:.4f} / {r['loss']['mean']:.4f} / {r['loss']['fit']:.4f} | "
                  f"{r['loss']['kl mean']:.4f} / {r['loss']['kl fit']:.4f} |", flush=True)
    print("\ncommands (the last case; the others alike):", *(" ".join(c) for c in r["commands"]), sep="\n  ")


if __name__ == "__main__":
    main()
