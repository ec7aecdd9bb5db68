"""One Llama-2-7B-shaped layer through the quality path (issue 50): is the conversion ever silent
for more than 30 s, and how does what it takes compare with the plan's bound?

    python scripts/bench/convert_7b_layer.py --label after --log results/convert-7b-layer-after.log \
        --json results/convert-7b-layer.jsonl [--code OTHER_CHECKOUT]

The model (made once under --work, seed 0, random weights N(0, 0.02)): a one-layer LlamaForCausalLM
of Llama-2-7B's shape (hidden 4096, 32 heads of 128, 32 K/V heads, MLP 11,008, vocabulary 32,000,
4,096 positions), float32 safetensors, with examples/stories260K-mha8's tokenizer (its ids are below
32,000). The conversion, one torch thread (as the issue measured it):

    python -m uptrain.convert MODEL --kv-heads 8 --method fit \
        --calib examples/data/tinystories-train-sample.txt --calib-tokens 16384 --refine --threads 1 --out OUT --force

Every output line is written to --log with the seconds since the start; the JSON line gives the
longest silence (and where it ended), the plan's bound (refinement.probe.bound_s.total of the
record), what the run took (calibration.seconds + the refined layer's seconds_with_setup) and
their ratio, the wall time, and the seconds between the phase lines that bracket the output solve
(where the code prints them). --code runs another checkout's code (the code before, for the
"before" log) with this script and this model.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CALIB = REPO / "examples" / "data" / "tinystories-train-sample.txt"
TOKENIZER = REPO / "examples" / "stories260K-mha8"
SHAPE = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 32, "intermediate_size": 11008,
         "num_hidden_layers": 1, "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


def make_model(folder: Path) -> Path:
    """The one-layer 7B-shaped model under `folder` (made once; reused after)."""
    if (folder / "config.json").is_file():
        return folder
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**SHAPE, initializer_range=0.02))
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True)
    for f in TOKENIZER.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, partial / f.name)
    partial.rename(folder)
    return folder


def relative(text: str, *roots: Path) -> str:
    """`text` without this machine's folders (results/ holds no absolute paths): each root's path
    (and the Python executable's) replaced by a relative name."""
    text = text.replace(sys.executable, "python")
    for root in roots:
        text = text.replace(str(root) + "/", "")
    return text


def run_logged(cmd: list[str], cwd: Path, log: Path) -> tuple[list[tuple[float, str]], float, int]:
    """Run `cmd`, every output line (split at newlines and carriage returns) timed from the start
    and written to `log` as `[  12.3 s] line`; (the timed lines, wall seconds, exit code)."""
    env = {**os.environ, "PYTHONPATH": str(cwd), "PYTHONUNBUFFERED": "1"}
    began = time.monotonic()
    lines: list[tuple[float, str]] = []
    with subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc, \
            log.open("w") as out:
        out.write(f"# {relative(' '.join(cmd), cwd, REPO)}\n")
        pending = b""
        while chunk := proc.stdout.read1(65536):
            pending += chunk
            *whole, pending = re.split(rb"[\r\n]", pending)
            for raw in whole:
                if raw.strip():
                    at = time.monotonic() - began
                    lines.append((at, relative(raw.decode(errors="replace"), cwd, REPO)))
                    out.write(f"[{at:7.1f} s] {lines[-1][1]}\n")
                    out.flush()
        code = proc.wait()
    return lines, time.monotonic() - began, code


def phase_seconds(lines: list[tuple[float, str]], start: str, end: str) -> float | None:
    """Seconds from the first line containing `start` to the first later line containing `end`."""
    t0 = next((t for t, x in lines if start in x), None)
    t1 = next((t for t, x in lines if t0 is not None and t > t0 and end in x), None)
    return None if t1 is None else round(t1 - t0, 1)


def summary(label: str, lines: list[tuple[float, str]], wall: float, record: dict) -> dict:
    """The JSON line: silences, bound, actual, their ratio."""
    times = [0.0] + [t for t, _ in lines] + [wall]
    gaps = [(b - a, i) for i, (a, b) in enumerate(zip(times, times[1:]))]
    longest, at = max(gaps)
    bound = record["refinement"]["probe"]["bound_s"]
    actual = record["calibration"]["seconds"] + sum(x["seconds_with_setup"] for x in record["refinement"]["layers"])
    return {"label": label, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": round(wall, 1),
            "lines": len(lines), "longest_silence_s": round(longest, 1),
            "silence_ended_by": lines[at][1][:160] if at < len(lines) else "(the end)",
            "silences_over_30_s": sum(g > 30 for g, _ in gaps),
            "bound_s": round(bound["total"], 1), "actual_s": round(actual, 1),
            "actual_over_bound": round(actual / bound["total"], 3),
            "steps_run": sum(x["steps_run"] for x in record["refinement"]["layers"]),
            "output_solve_s": phase_seconds(lines, "output solve", "held-out"),
            "load_1min_end": round(os.getloadavg()[0], 2)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", required=True)
    p.add_argument("--log", type=Path, required=True)
    p.add_argument("--json", type=Path, help="append the summary as one JSON line")
    p.add_argument("--code", type=Path, default=REPO, help="the checkout whose uptrain runs")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "7b-layer")
    p.add_argument("--calib-tokens", type=int, default=16384)
    args = p.parse_args()
    model = make_model(args.work / "model")
    out = args.work / f"out-{args.label}"
    cmd = [sys.executable, "-m", "uptrain.convert", str(model), "--kv-heads", "8", "--method", "fit", "--calib",
           str(CALIB), "--calib-tokens", str(args.calib_tokens), "--refine", "--threads", "1", "--out", str(out),
           "--force"]
    lines, wall, code = run_logged(cmd, args.code.resolve(), args.log)
    if code:
        raise SystemExit(f"the conversion failed (exit {code}); see {args.log}")
    row = summary(args.label, lines, wall, json.loads((out / "uptrain_conversion.json").read_text()))
    print(json.dumps(row))
    if args.json:
        with args.json.open("a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
