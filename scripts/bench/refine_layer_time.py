"""Seconds `--refine` takes per layer at Llama-2-7B and 70B attention shapes on this CPU, before
issue 43 and now; numbers for results/refine-layer-time.md.

    # results/refine-layer-time.json (3.5 min on 2 idle cores; ~5 min a shape at most):
    .venv/bin/python scripts/bench/refine_layer_time.py --shape both --steps-timed 5 \
        --json results/refine-layer-time.json
    # the small case the test runs (seconds): --shape tiny --steps-timed 1 --json SCRATCH/t.json

A whole layer's refinement (hours at these widths) is not run. Its pieces are measured on a real
transformers `LlamaAttention` and the refinement's own functions (`uptrain.convert.math.refine`,
`output_solve`), then added up as `refine_attention` runs them:

- one training sequence: the student's forward on [T, hidden], the relative squared error against
  the target and its backward, exactly the expression `refine._descend` runs per sequence; with
  denormals flushed (`refine._flushing_denormals`, today's code) and without (the code before
  issue 43 did not flush); the two interleaved, after one warm-up;
- the Adam update over `refine._param_groups` (once per step whatever the batch);
- one held-out sequence's evaluation (`refine.relative_error` on one sequence, no gradient);
- the parameter copy kept at each improving check (an upper bound: every check counted);
- the output solve (today only, `output_solve.solve_output`): per training sequence (its forward,
  the float64 Gram and cross products, timed with the solve itself stubbed out) and the solve of
  the [hidden, hidden] float64 system once (`output_solve.solve_linear` on a positive definite
  matrix of that size, as the 14 x 2048 = 28,672 training rows give).

Per layer = before-checks (every sequence once: held-out and training error) + steps x (batch x
sequence + Adam) + checks x (held-out sequences x evaluation + copy) + (today) the solve with its
projection-finding forward and its held-out check + the final training error. Steps are the
schedule's full length: an upper bound, since the held-out rule may stop a layer sooner.

The calibration the converter would use: --calib-tokens 32768 (options.DEFAULT_CALIB_TOKENS) cut into
windows of min(calibrate.WINDOW = 2048, max_position_embeddings = 4096) tokens: 16 sequences of
2,048 where every document has at least 2,048 tokens (the longest and so the costliest case; shorter
documents give shorter, cheaper sequences); held out as `split_held_out` does with each sequence its
own document: 2 sequences (4,096 tokens, MIN_HOLDOUT_TOKENS), 14 trained on.

Also reported: `probe_seconds_per_step` (the converter's plan-time probe, `layers/time_estimate.py`) for today's batch, and (7b and tiny; --no-check skips it) one real `refine_attention`
call (4 sequences, 3 steps of today's defaults) against what the pieces predict for it. Each piece's
figure is the median of its timed runs (raw times in the JSON), with the 1-minute load average beside
them: on a shared machine other jobs slow every piece.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

from uptrain.convert.layers import calibrate
from uptrain.convert.layers.time_estimate import probe_seconds_per_step  # the converter's plan-time probe
from uptrain.convert.math import output_solve, refine
from uptrain.convert.options import DEFAULT_CALIB_TOKENS

# name: (hidden, query heads, source K/V heads, converted K/V heads, head_dim, layers of the model,
#        max_position_embeddings)
SHAPES = {
    "7b": (4096, 32, 32, 8, 128, 32, 4096),  # Llama-2-7B, 32 -> 8 K/V heads (the repo's 7B benchmark)
    "70b": (8192, 64, 64, 8, 128, 80, 4096),  # 70B width (Llama-2-70B's hidden and heads), 64 -> 8
    "tiny": (64, 4, 4, 2, 16, 2, 64),  # for the test: seconds
}
# the refinement's defaults before issue 43 (git show 892f58d:uptrain/convert/math/refine.py):
# STEPS 1200, LR 1e-2, BATCH 4, EVAL_EVERY 20, constant rate, no output solve, no denormal flush
OLD = {"steps": 1200, "batch": 4, "eval_every": 20, "solve": False, "flush": False}
NEW = {"steps": refine.STEPS, "batch": refine.BATCH, "eval_every": refine.EVAL_EVERY, "solve": True, "flush": True}


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def machine() -> dict:
    def lscpu(field: str) -> str:
        try:
            out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        except (OSError, subprocess.CalledProcessError):
            return ""
        return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith(field + ":")), "")
    mem = next((ln.split()[1] for ln in Path("/proc/meminfo").read_text().splitlines() if ln.startswith("MemTotal")),
               "0") if Path("/proc/meminfo").exists() else "0"
    return {"cpu": lscpu("Model name"), "arch": platform.machine(), "nproc": os.cpu_count(),
            "ram_gib": round(int(mem) / 2**20, 1), "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(), "gpu": "none used"}


def build(shape: str, seq_len: int, n_seq: int, seed: int = 0):
    """(student, teacher, call, inputs, targets, config of the student): real LlamaAttention modules
    of a one-layer LlamaForCausalLM (sdpa, float32, random weights), the call arguments the model's
    own forward hands its attention (captured), random inputs [T, hidden] and the teacher's outputs."""
    hidden, heads, src_kv, new_kv, head_dim, _, max_pos = SHAPES[shape]
    torch.manual_seed(seed)

    def model(kv: int) -> LlamaForCausalLM:
        cfg = LlamaConfig(hidden_size=hidden, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                          num_hidden_layers=1, vocab_size=256, intermediate_size=64,
                          max_position_embeddings=max_pos, attn_implementation="sdpa")
        return LlamaForCausalLM(cfg).eval()
    teacher_model, student_model = model(src_kv), model(new_kv)
    captured = refine.capture(student_model, [torch.randint(0, 256, (seq_len,))])[0]
    kwargs = [captured.kwargs[0]] * (n_seq + 1)  # same length, same positions: the same call arguments
    call = refine.call_with(kwargs)
    teacher, student = refine.attention_modules(teacher_model)[0], refine.attention_modules(student_model)[0]
    for p in teacher.parameters():
        p.requires_grad_(False)
    inputs = [torch.randn(seq_len, hidden) for _ in range(n_seq)]
    with torch.no_grad():
        targets = [call(teacher, x, i) for i, x in enumerate(inputs)]
    return student, teacher, call, inputs, targets, student_model.config


def timed(fn) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


def measure(shape: str, steps_timed: int, calib_tokens: int, check: bool, log) -> dict:
    hidden, heads, src_kv, new_kv, head_dim, layers, max_pos = SHAPES[shape]
    seq_len = min(calibrate.WINDOW, max_pos)
    n = max(2, calib_tokens // seq_len)  # documents of >= seq_len tokens: full windows
    held, train = refine.split_held_out([seq_len] * n, list(range(n)), refine.HOLDOUT, refine.MIN_HOLDOUT_TOKENS, 0)
    loads = [load()]
    began = time.perf_counter()
    student, _, call, inputs, targets, config = build(shape, seq_len, 3)
    setup_s = time.perf_counter() - began
    log(f"{shape}: hidden {hidden}, {heads} heads of {head_dim}, K/V {src_kv} -> {new_kv}, T {seq_len}; "
        f"{n} sequences ({len(held)} held out, {len(train)} trained); built in {setup_s:.1f} s")
    student.eval()
    opt = torch.optim.Adam(refine._param_groups(student, refine.LR))

    def sequence(i: int, flush: bool) -> float:
        """One training sequence as `_descend` runs it (loss over a batch of one; the same work)."""
        with refine._flushing_denormals() if flush else nullcontext():
            power = targets[i].float().pow(2).sum().clamp_min(1e-30)
            return timed(lambda: ((call(student, inputs[i], i).float() - targets[i].float()).pow(2).sum()
                                  / power).backward())

    def adam() -> float:
        with refine._flushing_denormals():
            t = timed(opt.step)
        opt.zero_grad(set_to_none=True)
        return t

    sequence(0, True)  # warm-up: allocation, kernel choice, Adam's state
    adam()
    seq_new, seq_old, adam_s = [], [], []
    for r in range(steps_timed):  # interleaved, the order alternating, so load changes hit both alike
        order = (True, False) if r % 2 == 0 else (False, True)
        for flush in order:
            (seq_new if flush else seq_old).append(sequence(r % 3, flush))
        adam_s.append(adam())
        loads.append(load())
        log(f"  round {r + 1}: sequence {seq_new[-1]:.2f} s flushed / {seq_old[-1]:.2f} s not; "
            f"Adam {adam_s[-1]:.3f} s; load {loads[-1][0]}")
    with refine._flushing_denormals():
        evals = [timed(lambda i=i: refine.relative_error(student, call, inputs, targets, [i])) for i in (0, 1)]
        params = dict(student.named_parameters())
        copies = [timed(lambda: {k: p.detach().clone() for k, p in params.items()}) for _ in range(2)]
        real_solve = output_solve.solve_linear
        output_solve.solve_linear = lambda gram, cross, current, ridge=0.0: current.T.T  # the per-sequence part only
        proj = student.o_proj
        saved = proj.weight.detach().clone()
        try:
            solve_seq = [timed(lambda i=i: output_solve.solve_output(proj, lambda j: call(student, inputs[j], j),
                                                                     targets, [i])) for i in (0, 1)]
        finally:
            output_solve.solve_linear = real_solve
        n_in = proj.in_features + (proj.bias is not None)
        gram = torch.randn(n_in, n_in, dtype=torch.float64)  # symmetric, then made positive definite
        gram = (gram + gram.T) / 2 + n_in * torch.eye(n_in, dtype=torch.float64)
        cross = torch.randn(n_in, proj.out_features, dtype=torch.float64)
        current = proj.weight.detach().double()
        solve_fixed = [timed(lambda: output_solve.solve_linear(gram, cross, current)) for _ in range(2)]
        with torch.no_grad():
            proj.weight.copy_(saved)
        del gram, cross
    loads.append(load())
    log(f"  evaluation {_median(evals):.2f} s/sequence, copy {_median(copies):.3f} s, solve {_median(solve_seq):.2f} "
        f"s/sequence + {_median(solve_fixed):.2f} s; load {loads[-1][0]}")
    probe = probe_seconds_per_step(config, seq_len, refine.BATCH, "cpu")
    loads.append(load())
    log(f"  probe_seconds_per_step (batch {refine.BATCH}): {probe:.2f} s; load {loads[-1][0]}")

    piece = {"sequence_flushed_s": _median(seq_new), "sequence_not_flushed_s": _median(seq_old),
             "adam_s": _median(adam_s),
             "evaluation_s": _median(evals), "copy_s": _median(copies), "solve_per_sequence_s": _median(solve_seq),
             "solve_system_s": _median(solve_fixed)}
    result = {"shape": shape, "hidden": hidden, "heads": heads, "head_dim": head_dim, "kv_from": src_kv,
              "kv_to": new_kv, "model_layers": layers, "sequence_tokens": seq_len, "calib_tokens": calib_tokens,
              "sequences": n, "held_out": len(held), "trained": len(train), "steps_timed": steps_timed,
              "raw": {"sequence_flushed_s": seq_new, "sequence_not_flushed_s": seq_old, "adam_s": adam_s,
                      "evaluation_s": evals, "copy_s": copies, "solve_per_sequence_s": solve_seq,
                      "solve_system_s": solve_fixed, "build_s": setup_s},
              "pieces": piece, "probe_seconds_per_step": probe,
              "old": per_layer(OLD, piece, n, len(held), len(train), layers),
              "new": per_layer(NEW, piece, n, len(held), len(train), layers)}
    if check and hidden <= 4096:  # 70B: the call alone would take minutes more (the budget is ~5 a shape)
        result["check"] = end_to_end(student, call, inputs, targets, piece, log)
        loads.append(load())
    result["load_1min"] = [x[0] for x in loads]
    result["load_samples"] = loads
    result["seconds"] = round(time.perf_counter() - began, 1)
    result["old_over_new"] = result["old"]["layer_s"] / result["new"]["layer_s"]
    return result


def _median(xs: list[float]) -> float:
    """The median: on a shared machine one round that another job slowed (or left alone) moves a mean."""
    return statistics.median(xs)


def per_layer(d: dict, p: dict, n: int, held: int, train: int, layers: int) -> dict:
    """A layer's seconds as `refine_attention` spends them with defaults `d` (all steps run)."""
    seq = p["sequence_flushed_s"] if d["flush"] else p["sequence_not_flushed_s"]
    step = d["batch"] * seq + p["adam_s"]
    checks = math.ceil(d["steps"] / d["eval_every"])  # every eval_every steps, and the last step
    parts = {"before_checks": n * p["evaluation_s"], "steps": d["steps"] * step,
             "held_out_checks": checks * (held * p["evaluation_s"] + p["copy_s"]) + p["copy_s"],
             "solve": (p["evaluation_s"] + train * p["solve_per_sequence_s"] + p["solve_system_s"]
                       + held * p["evaluation_s"]) if d["solve"] else 0.0,
             "after_check": train * p["evaluation_s"]}
    total = sum(parts.values())
    return {"defaults": d, "step_s": step, "steps": d["steps"], "checks": checks, "parts_s": parts, "layer_s": total,
            "model_h": total * layers / 3600}


def end_to_end(student, call, inputs, targets, p: dict, log) -> dict:
    """One real `refine_attention` (today's code: 3 steps of 2, the check at step 3, the solve) on 4
    sequences (2 held out: MIN_HOLDOUT_TOKENS), against what the pieces predict for that call."""
    xs, ys = inputs + inputs[:1], targets + targets[:1]  # 4 sequences
    held, train = refine.split_held_out([int(x.shape[0]) for x in xs], list(range(4)), refine.HOLDOUT,
                                        refine.MIN_HOLDOUT_TOKENS, 0)
    steps = 3
    began = time.perf_counter()
    res = refine.refine_attention(student, call, xs, ys, steps=steps)
    wall = time.perf_counter() - began
    predicted = (4 * p["evaluation_s"] + steps * (refine.BATCH * p["sequence_flushed_s"] + p["adam_s"])
                 + len(held) * p["evaluation_s"] + 2 * p["copy_s"]
                 + p["evaluation_s"] + len(train) * p["solve_per_sequence_s"] + p["solve_system_s"]
                 + len(held) * p["evaluation_s"] + len(train) * p["evaluation_s"])
    log(f"  refine_attention, 4 sequences ({len(held)} held out), {steps} steps: {wall:.1f} s measured, "
        f"{predicted:.1f} s from the pieces ({res.steps_run} steps run, output solved: {res.output_solved})")
    return {"sequences": 4, "held_out": len(held), "steps": steps, "measured_s": wall, "predicted_s": predicted,
            "steps_run": res.steps_run, "output_solved": res.output_solved}


def table(results: list[dict]) -> str:
    rows = ["| shape | T | old s/step | old steps | old s/layer | new s/step | new steps | new s/layer | old/new "
            "| layers | old model h | new model h |", "|" + "---|" * 12]
    for r in results:
        o, w = r["old"], r["new"]
        rows.append(f"| {r['shape']} ({r['kv_from']}->{r['kv_to']} K/V) | {r['sequence_tokens']} | {o['step_s']:.2f} | "
                    f"{o['steps']} x {o['defaults']['batch']} | {o['layer_s']:,.0f} | {w['step_s']:.2f} | "
                    f"{w['steps']} x {w['defaults']['batch']} | {w['layer_s']:,.0f} | {r['old_over_new']:.2f} | "
                    f"{r['model_layers']} | {o['model_h']:.1f} | {w['model_h']:.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=["7b", "70b", "both", "tiny"], default="both")
    p.add_argument("--steps-timed", type=int, default=3, help="timed rounds (one sequence with and one without "
                   "denormal flushing, one Adam update each) after one warm-up (default 3)")
    p.add_argument("--calib-tokens", type=int, default=DEFAULT_CALIB_TOKENS,
                   help=f"the converter's --calib-tokens (default {DEFAULT_CALIB_TOKENS})")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the real refine_attention call (3 steps on 4 sequences) that checks the sum "
                        "(made at hidden <= 4096 only: 7b, tiny)")
    p.add_argument("--json", type=Path, help="write the measurement here")
    args = p.parse_args(argv)
    if args.steps_timed < 1:
        p.error("--steps-timed must be at least 1")
    shapes = ["7b", "70b"] if args.shape == "both" else [args.shape]
    started = datetime.datetime.now(datetime.timezone.utc)
    log = lambda line: print(line, flush=True)  # noqa: E731
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads; load {load()}")
    results = [measure(s, args.steps_timed, args.calib_tokens, args.check, log) for s in shapes]
    print(table(results))
    if args.json:
        record = {"command": "python scripts/bench/refine_layer_time.py " + " ".join(sys.argv[1:] if argv is None else argv),
                  "started_utc": started.isoformat(timespec="seconds"),
                  "ended_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                  "machine": machine(), "old_defaults": OLD, "new_defaults": NEW, "shapes": results}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
