"""The prepared GPU check (run by scripts/gpu_check.sh): every path of uptrain that runs on a GPU,
measured into one JSON file. First the paths beside the trainer (`paths`), each a fresh process
with `--device cuda`:
  a. the quality-path conversion of one Llama-2-7B-shaped layer (`uptrain.convert --method fit
     --grouping similar --calib --refine --device cuda`): seconds, the refinement's held-out error;
  b. the source's samples (`python -m uptrain.train.samples --device cuda`): tokens/s;
  c. `uptrain.eval --reference --device cuda`: the converted 1B-class model against its source.
Then a 1B-class Llama-shaped model with random weights, converted to 8 K/V heads and uptrained
with bf16 + torch.compile three ways, printing tokens/s and MFU for each.

    bash scripts/gpu_check.sh                  # on a GPU machine: full shape, ~5 min on an H100/H200 (estimate)
    GPU_CHECK_TINY=1 bash scripts/gpu_check.sh  # tiny shape (automatic without CUDA), ~1 min on CPU

Runs (each a fresh process, as a user launches it; configs/demo-cpu.yaml + overrides):
  1. one process: mixed_precision=bf16, compile=true (torch.compile of the whole model; not in
     the tiny mode, where a cold compile costs minutes of a shared CPU)
  2. shard=fsdp2 over one process: the trainer's fully_shard with its bf16 policy, compile per layer
  3. accelerate's FSDP2 config (configs/accelerate/fsdp2.yaml, --num_processes 1, bf16 from the
     config, accelerate's regional compilation). On CPU accelerate drops FSDP, so there the
     trainer must refuse the launch in one line (exit 2): that refusal is what is checked.

Tokens/s is the steady state: between the first metrics record after `--warmup` steps (compile
and first steps excluded) and the last one, from the records' cumulative tokens / tok_per_s.
MFU uses uptrain/train/report/mfu.py (6N + attention FLOPs, the bf16 dense peak of the detected GPU;
GPU_CHECK_PEAK_TFLOPS overrides, e.g. for a GPU not in the table).

Environment: GPU_CHECK_TINY=1, GPU_CHECK_STEPS, GPU_CHECK_WORK (default runs/gpu-check),
GPU_CHECK_PEAK_TFLOPS.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from uptrain.train.report.mfu import bf16_peak_tflops, mfu, model_flops_per_token

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo-cpu.yaml"
TOKENIZER = REPO / "examples" / "stories260K-mha8"  # 512 tokens: the ids fit any vocabulary
TRAIN_TXT = REPO / "examples" / "data" / "tinystories-train-sample.txt"
VALID_TXT = REPO / "examples" / "data" / "tinystories-valid-sample.txt"

# Llama 3.2 1B's shapes (1.24B parameters, tied embeddings), as multi-head attention (32 K/V
# heads) so that the conversion to its real 8 K/V heads is a real one.
FULL_SHAPE = {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
              "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 64, "vocab_size": 128256,
              "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
              "tie_word_embeddings": True, "hidden_act": "silu", "bos_token_id": 1, "eos_token_id": 2}
TINY_SHAPE = {**FULL_SHAPE, "hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
              "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8, "vocab_size": 512,
              "max_position_embeddings": 512}
# One layer of Llama 2 7B (32 heads of 128, 32 K/V heads: MHA), for the quality path's conversion.
LAYER_7B = {**FULL_SHAPE, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 1,
            "num_attention_heads": 32, "num_key_value_heads": 32, "head_dim": 128, "vocab_size": 32000,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False}
# (K/V heads, calibration tokens, refinement steps, sample tokens) of the paths beside the trainer
FULL_PATHS = dict(kv_heads=8, calib_tokens=16384, refine_steps=400, sample_tokens=262144)
TINY_PATHS = dict(kv_heads=2, calib_tokens=2048, refine_steps=20, sample_tokens=2048)
# (steps, warm-up steps excluded from the speed, seq_len, micro batch, log.every, K/V heads after)
FULL_RUN = dict(steps=150, warmup=20, seq_len=2048, micro_batch=4, log_every=10, kv_heads=8)
TINY_RUN = dict(steps=12, warmup=4, seq_len=64, micro_batch=2, log_every=4, kv_heads=2)


def run(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run `cmd` from the repository root, its output to `log`; return the finished process."""
    with log.open("w") as out:
        return subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, **(env or {})})


def make_mha(work: Path, shape: dict, device: str, name: str = "mha") -> Path:
    """A random Llama-shaped MHA model (scripts/tools/make_shaped_model.py, in this process) with
    stories260K's tokenizer (512 ids: they fit any vocabulary)."""
    sys.path.insert(0, str(REPO / "scripts" / "tools"))
    import make_shaped_model

    (work / f"{name}.json").write_text(json.dumps(shape))
    mha = work / name
    if make_shaped_model.main([str(work / f"{name}.json"), str(mha), "--dtype", "bfloat16", "--device", device]) != 0:
        sys.exit("gpu_check: scripts/tools/make_shaped_model.py failed")
    for file in ("tokenizer.json", "tokenizer_config.json"):  # travels with the source into the converted folder
        shutil.copyfile(TOKENIZER / file, mha / file)
    return mha


def make_model(work: Path, shape: dict, kv_heads: int, device: str) -> Path:
    """`make_mha` -> `uptrain.convert --kv-heads` (mean pooling), through the CLI's main in this process."""
    from uptrain.convert.__main__ import main as convert

    mha, gqa = make_mha(work, shape, device), work / f"gqa{kv_heads}"
    if convert([str(mha), "--kv-heads", str(kv_heads), "--out", str(gqa), "--force"]) != 0:
        sys.exit("gpu_check: uptrain.convert failed")
    return gqa


def path_runs(work: Path, tiny: bool, device: str, mha: Path, gqa: Path) -> list[dict]:
    """The paths beside the trainer (module doc: a, b, c), each a fresh process on `device`; a record each."""
    p = TINY_PATHS if tiny else FULL_PATHS
    layer = make_mha(work, {**LAYER_7B, **({k: TINY_SHAPE[k] for k in ("hidden_size", "intermediate_size",
                     "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size")} if tiny else {})},
                     "cuda" if device == "cuda" else "cpu", "layer-7b")
    py = [sys.executable, "-m"]
    paths = [
        ("quality-path conversion of a Llama-2-7B-shaped layer",
         [*py, "uptrain.convert", str(layer), "--kv-heads", str(p["kv_heads"]), "--method", "fit",
          "--grouping", "similar", "--calib", str(TRAIN_TXT), "--calib-tokens", str(p["calib_tokens"]), "--refine",
          "--refine-steps", str(p["refine_steps"]), "--device", device, "--out", str(work / "layer-7b-fit"),
          "--force"], work / "layer-7b-fit"),
        ("the source's samples", [*py, "uptrain.train.samples", str(mha), "--tokens", str(p["sample_tokens"]),
                                  "--out", str(work / "samples.jsonl"), "--device", device, "--force"],
         work / "samples.jsonl"),
        ("uptrain.eval against the source", [*py, "uptrain.eval", str(gqa), "--reference", str(mha), "--data",
                                             str(VALID_TXT), "--device", device, "--json", str(work / "eval.json")],
         work / "eval.json"),
    ]
    records = []
    for i, (name, cmd, made) in enumerate(paths):
        t = time.time()
        proc = run(cmd, work / f"path{i + 1}.log", {"PYTHONUNBUFFERED": "1"})
        lines = (work / f"path{i + 1}.log").read_text().strip().splitlines() or [""]
        record = {"path": name, "device": device, "returncode": proc.returncode, "seconds": round(time.time() - t, 1)}
        if proc.returncode != 0:
            record["error"] = lines[-1]
        else:
            record.update(path_figures(i, made, record["seconds"], lines))
        print(f"{name}: " + (f"FAILED (exit {proc.returncode}): {lines[-1]}" if proc.returncode else
                             ", ".join(f"{k} {v}" for k, v in record.items() if k not in ("path", "returncode"))),
              flush=True)
        records.append(record)
    return records


def path_figures(index: int, made: Path, seconds: float, lines: list[str]) -> dict:
    """What a finished path measured, from what it wrote (its record, its file, its JSON)."""
    if index == 0:
        record = json.loads((made / "uptrain_conversion.json").read_text())
        layers = (record.get("refinement") or {}).get("layers") or [{}]
        return {"kv_heads": record["new_kv_heads"], "calibration_tokens": record["calibration"]["tokens_used"],
                "refine_error_before": layers[0].get("error_before"), "refine_error_after": layers[0].get("error_after"),
                "refine_steps_run": layers[0].get("steps_run")}
    if index == 1:  # "N documents, T tokens written to FILE in S s (R tokens/s)"
        found = re.search(r"([\d,]+) documents, ([\d,]+) tokens written .* \(([\d,.]+) tokens/s\)", "\n".join(lines))
        documents, tokens, rate = (float(g.replace(",", "")) for g in found.groups()) if found else (0, 0, 0)
        return {"documents": int(documents), "tokens": int(tokens), "tokens_per_s": rate}
    result = json.loads(made.read_text())[0]
    return {"loss": round(result["loss"], 4), "kl_to_source": round(result["kl_to_source"], 5),
            "tokens": result["tokens"], "tokens_per_s": round(result["tokens"] / seconds, 1)}


def train_args(model: Path, run_dir: Path, r: dict, extra: dict) -> list[str]:
    """configs/demo-cpu.yaml overrides for `r['steps']` steps of micro_batch x seq_len tokens."""
    tokens = r["steps"] * r["micro_batch"] * r["seq_len"]
    base = {"model": model, "run_dir": run_dir, "overwrite": "true", "data.train.files": f"[{TRAIN_TXT}]",
            "data.val.files": f"[{VALID_TXT}]", "data.seq_len": r["seq_len"], "data.repeat_data": "true",
            "batch.micro_batch": r["micro_batch"], "batch.grad_accum": 1, "budget.tokens": tokens,
            "optim.warmup_steps": min(10, r["steps"] // 2), "eval.every": 0, "eval.at_start": "false",
            "eval.max_batches": 1, "checkpoint.every": 0, "log.every": r["log_every"], "log.log_with": "[]",
            "log.progress_bar": "false", "save_dtype": "bfloat16", **extra}
    return [f"{k}={v}" for k, v in base.items()]


def steady_speed(run_dir: Path, warmup: int) -> tuple[float, float, float]:
    """(tokens/s between the first record past `warmup` and the last, first loss, last loss)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    first = next(r for r in steps if r["step"] > warmup)
    last = steps[-1]
    elapsed = {r["step"]: r["tokens"] / r["tok_per_s"] for r in (first, last)}  # seconds since the loop began
    speed = (last["tokens"] - first["tokens"]) / (elapsed[last["step"]] - elapsed[first["step"]])
    return speed, steps[0]["loss"], last["loss"]


def main() -> int:
    cuda = torch.cuda.is_available()
    tiny = os.environ.get("GPU_CHECK_TINY") == "1" or not cuda
    r = dict(TINY_RUN if tiny else FULL_RUN)
    r["steps"] = int(os.environ.get("GPU_CHECK_STEPS", r["steps"]))
    work = Path(os.environ.get("GPU_CHECK_WORK", REPO / "runs" / "gpu-check")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if cuda else "CPU"
    peak = float(os.environ["GPU_CHECK_PEAK_TFLOPS"]) if os.environ.get("GPU_CHECK_PEAK_TFLOPS") else (
        bf16_peak_tflops(device) if cuda else None)
    print(f"gpu_check: {'tiny' if tiny else 'full'} shape on {device}, {r['steps']} steps x "
          f"{r['micro_batch']} x {r['seq_len']} tokens per run; work folder {work}", flush=True)

    t0 = time.time()
    model = make_model(work, TINY_SHAPE if tiny else FULL_SHAPE, r["kv_heads"], "cuda" if cuda else "cpu")
    with torch.device("meta"):  # shapes only: no weights read
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model))
    n_params = sum(p.numel() for p in reference.parameters())
    per_token = model_flops_per_token(reference, r["seq_len"])
    print(f"model: {n_params:,} parameters, {r['kv_heads']} K/V heads, {per_token / 1e9:.4g} GFLOP "
          f"per token (made and converted in {time.time() - t0:.0f} s)", flush=True)
    paths = path_runs(work, tiny, "cuda" if cuda else "cpu", work / "mha", model)

    launch = [sys.executable, "-m", "accelerate.commands.launch"]
    # Tiny mode compiles per layer (run 2) but not the whole model: on a shared 2-core CPU each
    # cold inductor compile of a bf16 graph takes a minute or two.
    runs = [
        ("one process, bf16" + ("" if tiny else " + compile"), [sys.executable, "-m", "uptrain.train", str(DEMO)],
         {"mixed_precision": "bf16", "compile": "false" if tiny else "true"}),
        ("shard=fsdp2 over one process, bf16 + compile per layer", [sys.executable, "-m", "uptrain.train", str(DEMO)],
         {"mixed_precision": "bf16", "compile": "true", "shard": "fsdp2"}),
        ("accelerate FSDP2 config (configs/accelerate/fsdp2.yaml), regional compile",
         [*launch, "--config_file", "configs/accelerate/fsdp2.yaml", "--num_processes", "1",
          "--dynamo_backend", "inductor", "--dynamo_use_regional_compilation", "-m", "uptrain.train", str(DEMO)],
         {}),
    ]
    results, failed = [], 0
    for i, (name, cmd, extra) in enumerate(runs, 1):
        run_dir = work / f"run{i}"
        t = time.time()
        proc = run([*cmd, *train_args(model, run_dir, r, extra)], work / f"run{i}.log", {"PYTHONUNBUFFERED": "1"})
        lines = (work / f"run{i}.log").read_text().strip().splitlines() or [""]
        result = {"run": name, "returncode": proc.returncode, "seconds": round(time.time() - t, 1)}
        if i == 3 and not cuda:
            # accelerate drops FSDP without CUDA: the trainer must refuse in one line (its exit 2
            # becomes torchrun's 1; torchrun's own failure report follows the line).
            refusal = [x for x in lines if x.startswith("error: the launch asks for FSDP")]
            ok = proc.returncode != 0 and len(refusal) == 1
            result["refused_on_cpu"] = refusal[0] if refusal else lines[-1]
            print(f"{name}: {'refused on CPU as expected' if ok else 'NOT refused as expected'}: "
                  f"{result['refused_on_cpu']}")
            failed += not ok
        elif proc.returncode != 0:
            result["error"] = lines[-1]
            print(f"{name}: FAILED (exit {proc.returncode}): {lines[-1]}; see {work / f'run{i}.log'}")
            failed += 1
        else:
            speed, first, last = steady_speed(run_dir, r["warmup"])
            result.update(tokens_per_s=round(speed, 1), loss_first=first, loss_last=last,
                          tflops=round(speed * per_token / 1e12, 3))
            line = f"{name}: {speed:,.0f} tokens/s, loss {first:.3f} -> {last:.3f}, "
            if peak:
                result["mfu"] = mfu(speed, per_token, peak)
                line += f"MFU {result['mfu']:.1%} ({speed * per_token / 1e12:.1f} TFLOP/s of {peak:g})"
            else:
                line += "MFU n/a (no bf16 peak known for this device; set GPU_CHECK_PEAK_TFLOPS)"
            print(line + f" [{result['seconds']:.0f} s]", flush=True)
        results.append(result)
    summary = {"device": device, "tiny": tiny, "torch": torch.__version__, "parameters": n_params,
               "flops_per_token": per_token, "peak_tflops": peak, **{k: v for k, v in r.items()},
               "paths": paths, "runs": results, "seconds": round(time.time() - t0, 1)}
    (work / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {work / 'gpu_check.json'} ({summary['seconds']:.0f} s in all)")
    return 1 if failed or any(x["returncode"] != 0 for x in paths) else 0


if __name__ == "__main__":
    sys.exit(main())
