"""The fit's start behind a key norm on TRAINED weights (issue 50): small models of every registry family
with a key norm (Qwen3 and Phi qk_layernorm: a shared q/k norm; StableLM and Cohere: per head; OLMo-2:
over the whole projection) trained here, converted to 2 K/V heads by mean pooling, by the fit as it
was (from another checkout: --before; the code before the per-layer choice, or before the whole-model
check) and by the fit as it is (the better of fit and mean pooling per layer by the calibration error,
then the whole model checked against mean pooling's: `layers/whole_check.py`).

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python scripts/studies/key_norm_trained.py --work SCRATCH/key-norm \
        --before OLD_CHECKOUT --json results/key-norm-trained.jsonl

Each model: fit_starts.py's shape (hidden 64, 8 heads of 8, 8 K/V heads, 4 layers, vocabulary 512 with
stories260K's tokenizer; MLP 128), the class's own initialisation under torch seed SEED, trained by
`python -m uptrain.train configs/demo-cpu.yaml` with the LM loss only (no teacher) on the shipped
training text (examples/data/tinystories-train-sample.txt, repeated), lr 3e-3, --tokens tokens, one
thread. Converted with `--calib` the same text (16,384 tokens). Measured as fit_starts.py measures:
each attention's relative output error on the source's attention inputs of the held-out text's first
8,192 tokens (256-token windows), and the KL to the source over them (nats/token); and the KL of every
model that takes each layer's attention from the mean or the fit conversion (2^4 mixes): which
per-layer choice the whole model would want.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts" / "studies"))
sys.path.insert(0, str(REPO / "scripts" / "tools"))

from fit_starts import MHA8, SMALL, TRAIN, VALID, errors, kl_to  # noqa: E402

# case -> (model type, config extra): one model of each registry family with a key norm (the shared
# norm: Qwen3 for Qwen3 / Gemma 3 / EXAONE 4, and Phi's qk_layernorm; per head: StableLM, Cohere; whole
# projection: OLMo-2)
CASES = {"qwen3": ("qwen3", {}), "olmo2": ("olmo2", {}),
         "phi-qk_layernorm": ("phi", dict(qk_layernorm=True, partial_rotary_factor=0.5)),
         "stablelm-qk_layernorm": ("stablelm", dict(qk_layernorm=True, partial_rotary_factor=0.25, use_qkv_bias=True)),
         "cohere-use_qk_norm": ("cohere", dict(use_qk_norm=True))}


def trained(case: str, seed: int, tokens: int, work: Path) -> Path:
    """The case's model trained from its own initialisation (made once; reused after)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    run_dir = work / f"{case}-s{seed}-train"
    if (run_dir / "model" / "config.json").is_file():
        return run_dir / "model"
    init = work / f"{case}-s{seed}-init"
    torch.manual_seed(seed)
    model_type, extra = CASES[case]
    config = AutoConfig.for_model(model_type, **{**SMALL, "intermediate_size": 128, **extra})
    AutoModelForCausalLM.from_config(config).save_pretrained(init)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (init / f).write_bytes((MHA8 / f).read_bytes())
    subprocess.run([sys.executable, "-m", "uptrain.train", "configs/demo-cpu.yaml", f"model={init}",
                    f"run_dir={run_dir}", "overwrite=true", f"data.train.files=[{TRAIN}]",
                    f"data.val.files=[{VALID}]", "distill.teacher=null", "distill.alpha_kd=0",
                    f"budget.tokens={tokens}", "optim.lr=3e-3", f"seed={seed}", "threads=1", "eval.every=200",
                    "checkpoint.every=0", "log.log_with=[]", "log.progress_bar=false"],
                   check=True, cwd=REPO, capture_output=True,
                   env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    return run_dir / "model"


def convert(src: Path, out: Path, method: str, code: Path) -> None:
    """`python -m uptrain.convert` from the checkout `code` (the code as it was, or as it is)."""
    argv = [str(src.resolve()), "--kv-heads", "2", "--method", method, "--out", str(out.resolve()), "--force", "--threads", "1"]
    argv += ["--calib", str(TRAIN), "--calib-tokens", "16384"] if method == "fit" else []
    done = subprocess.run([sys.executable, "-m", "uptrain.convert", *argv], capture_output=True, text=True, cwd=code,
                          env={**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{' '.join(argv)} failed ({done.returncode}):\n{done.stderr[-1500:]}")


def measure(src: Path, folders: dict[str, Path]) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from uptrain.convert.layers.calibrate import calibration_sequences, read_calibration_texts

    ids, _, _, _ = calibration_sequences(read_calibration_texts(VALID), AutoTokenizer.from_pretrained(MHA8), 8192, 256)
    sequences = [torch.tensor(s) for s in ids if len(s) > 1]
    load = lambda p: AutoModelForCausalLM.from_pretrained(p).eval()  # noqa: E731
    source = load(src)
    out = {}
    with torch.no_grad():
        for name, folder in folders.items():
            model = load(folder)
            out[name] = {"errors": [round(e, 4) for e in errors(source, model, sequences)],
                         "kl": round(kl_to(source, model, sequences), 4)}
    return out


def mixes(src: Path, mean: Path, fit: Path) -> dict[str, float]:
    """KL to the source (held-out tokens, as `measure`) of every model that takes each layer's attention
    from `mean` ('m') or from `fit` ('f'): which per-layer choice the whole model would want."""
    import itertools

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from uptrain.convert.layers.calibrate import calibration_sequences, read_calibration_texts
    from uptrain.convert.math.refine import attention_modules

    ids, _, _, _ = calibration_sequences(read_calibration_texts(VALID), AutoTokenizer.from_pretrained(MHA8), 8192, 256)
    sequences = [torch.tensor(s) for s in ids if len(s) > 1]
    load = lambda p: AutoModelForCausalLM.from_pretrained(p).eval()  # noqa: E731
    source, fitted = load(src), attention_modules(load(fit))
    out = {}
    with torch.no_grad():
        for mix in itertools.product("mf", repeat=len(fitted)):
            model = load(mean)
            for module, fit_module, take in zip(attention_modules(model), fitted, mix):
                if take == "f":
                    module.load_state_dict(fit_module.state_dict())
            out["".join(mix)] = round(kl_to(source, model, sequences), 4)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--before", type=Path, required=True, help="a checkout of the code before the choice")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--tokens", type=int, default=1_000_000)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    torch.set_num_threads(1)
    print("| model | seed | per-layer error: mean | fit before | fit now | KL to source: mean / fit before / fit now "
          "| best per-layer mix (m/f per layer), its KL | whole-model check wrote |\n|---|---|---|---|---|---|---|---|",
          flush=True)
    for case in CASES:
        for seed in args.seeds:
            src = trained(case, seed, args.tokens, args.work)
            folders = {m: args.work / f"{case}-s{seed}-{m}" for m in ("mean", "fit-before", "fit-now")}
            convert(src, folders["mean"], "mean", REPO)
            convert(src, folders["fit-before"], "fit", args.before.resolve())
            convert(src, folders["fit-now"], "fit", REPO)
            r = measure(src, folders)
            r["mixes"] = mixes(src, folders["mean"], folders["fit-before"])
            r["check"] = json.loads((folders["fit-now"] / "uptrain_conversion.json").read_text()).get("whole_model")
            best = min(r["mixes"], key=r["mixes"].__getitem__)
            fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
            print(f"| {case} | {seed} | {fmt(r['mean']['errors'])} | {fmt(r['fit-before']['errors'])} | "
                  f"{fmt(r['fit-now']['errors'])} | {r['mean']['kl']:.4f} / {r['fit-before']['kl']:.4f} / "
                  f"{r['fit-now']['kl']:.4f} | {best} {r['mixes'][best]:.4f} | {(r['check'] or {}).get('written')} |",
                  flush=True)
            if args.json:
                with args.json.open("a") as f:
                    f.write(json.dumps({"case": case, "seed": seed, "tokens": args.tokens, **r}) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
