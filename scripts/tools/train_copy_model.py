"""Train a tiny true-MHA Llama that copies from its context (issue 59).

What it does
------------
Trains from scratch a small ``LlamaForCausalLM`` (hidden 128, 4 layers,
8 heads of head_dim 16, ``num_key_value_heads = 8``: every K/V head is its own,
trained as MHA, none duplicated; ~0.86M parameters, ~3.4 MB in fp32) with the
``examples/stories260K-mha8`` tokenizer (vocab 512) on TinyStories text, so that
it forms induction / in-context-copy heads. The result (safetensors, loads with
plain ``AutoModelForCausalLM`` / ``AutoTokenizer``) is the example model that GQA
conversions (merging K/V heads to 4, 2, 1) are measured against: do they keep
copying?

Command (CPU, one thread, seeded, deterministic)::

    .venv/bin/python scripts/tools/train_copy_model.py --out examples/copy-mha8

Stop it any time; ``--resume`` continues from the last checkpoint in the work
folder (default ``runs/copy-model/``: ``ckpt.pt`` every ``--ckpt-every`` steps,
``log.jsonl`` with the loss and the copy probe every ``--probe-every`` steps).
The final model is written to ``<out>.tmp`` and then renamed to ``<out>``.

Recipe and why
--------------
Two stages; all sequences start with BOS, loss on every token.

* Stage 1 (copy bootstrap): 16 sequences of 128 tokens per step made only of
  uniformly random tokens (spans of 8-32) and REPEATS of spans that occur
  earlier in the same sequence (p = 0.5 per segment, 8-96 tokens). Nothing but
  copying can lower the loss below ln(512) = 6.24, and short sequences keep the
  attention signal undiluted. AdamW (0.9, 0.95), weight decay 0.1, lr 3e-3
  (50 warm-up steps, then constant), clip 1.0. The loss sits on a plateau
  (~6.24 -> 6.12 from an "in-context unigram" effect) for ~3,000 steps and then
  drops abruptly (the induction-head phase change); stage 1 ends once its
  50-step mean loss is under ``--synthetic-until-loss`` (4.0), at most
  ``--synthetic-steps``.
* Stage 2 (natural text, long context): 8 x 512 tokens per step; segments are
  natural chunks of ``examples/data/tinystories-train-sample.txt`` (32-160
  tokens, random start; 246 stories, ~99k tokens; the valid sample is held out
  for the probe and never trained on), random-token spans (16-64, p = 0.35) or
  repeats of earlier spans (16-96, p = 0.45), so repeats occur at every
  distance up to the context. lr 3e-3 cosine to 10% over ``--max-steps``;
  stops early once the held-out copy probe has second-occurrence loss below
  ``--stop-ratio`` (0.3) x first-occurrence loss at every distance for
  ``--stop-patience`` (2) probes in a row, after ``--min-steps`` stage-2 steps.

What did not work (same model, CPU): natural text + repeats from the start
(lr 2e-3, 1,000 steps of 8 x 512: no copying, the small training text gets
memorised instead: held-out loss rose); stage 1 at 512 tokens (250 steps, flat
at 6.24). The phase change needs thousands of cheap short-sequence steps.

Determinism: the batch of step ``s`` is drawn from ``random.Random(seed, s)``,
so a resumed run sees the same data as an uninterrupted one; torch runs on
one CPU thread.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import copy_ablation as ca  # noqa: E402

TOK_DIR = "examples/stories260K-mha8"
TOK_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "generation_config.json")
TRAIN_TEXT = "examples/data/tinystories-train-sample.txt"
VALID_TEXT = "examples/data/tinystories-valid-sample.txt"


def model_config(args):
    from transformers import LlamaConfig
    return LlamaConfig(
        vocab_size=512, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=8, num_key_value_heads=8, head_dim=args.hidden // 8,
        intermediate_size=args.intermediate, max_position_embeddings=args.seq_len,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        rms_norm_eps=1e-5, rope_theta=10000.0, initializer_range=args.init_std,
        hidden_act="silu", attention_bias=False, mlp_bias=False,
    )


def make_sequence(rng: random.Random, stream: list[int], T: int, bos: int,
                  p_rand: float, p_rep: float) -> list[int]:
    seq = [bos]
    while len(seq) < T:
        room = T - len(seq)
        u = rng.random()
        if u < p_rep and len(seq) > 16:
            n = min(rng.randint(8 if T <= 128 else 16, 96), len(seq) - 1, room)
            s = rng.randint(1, len(seq) - n)
            seq.extend(seq[s:s + n])
        elif u < p_rep + p_rand:
            n = min(rng.randint(8, 32) if T <= 128 else rng.randint(16, 64), room)
            seq.extend(rng.randrange(3, 512) for _ in range(n))
        else:
            n = min(rng.randint(32, 160), room)
            s = rng.randrange(0, len(stream) - n)
            seq.extend(stream[s:s + n])
    return seq[:T]


def batch_for_step(args, stream, bos, step, stage1):
    rng = random.Random(args.seed * 1_000_003 + step)
    if stage1:
        # stage 1: short sequences of random-token spans and their repeats only
        p_rand, p_rep = 1.0 - args.p_rep_synthetic, args.p_rep_synthetic
        T, B = args.synthetic_len, args.synthetic_batch
    else:
        p_rand, p_rep = args.p_rand, args.p_rep
        T, B = args.seq_len, args.batch
    seqs = [make_sequence(rng, stream, T, bos, p_rand, p_rep) for _ in range(B)]
    return torch.tensor(seqs, dtype=torch.long)


def lr_at(args, step, stage1_end):
    """Warm-up, constant during stage 1, cosine to 10% over stage 2."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if stage1_end is None:
        return args.lr
    s0 = max(stage1_end, args.warmup)
    t = min(1.0, max(0, step - s0) / max(1, stage1_end + args.max_steps - s0))
    return args.lr2 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def save_ckpt(path, model, opt, step, extra):
    tmp = path + ".tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, **extra}, tmp)
    os.replace(tmp, path)


LICENSE_TEXT = """MIT License

Copyright (c) 2026 the uptrain authors

Permission is hereby granted, free of charge, to any person obtaining a copy
of these model weights and associated files (the "Software"), to deal
in the Software without restriction, including without limitation the rights
to use, copy, modify, merge, publish, distribute, sublicense, and/or sell
copies of the Software, and to permit persons to whom the Software is
furnished to do so, subject to the following conditions:

The above copyright notice and this permission notice shall be included in all
copies or substantial portions of the Software.

THE SOFTWARE IS PROVIDED "AS IS", WITHOUT WARRANTY OF ANY KIND, EXPRESS OR
IMPLIED, INCLUDING BUT NOT LIMITED TO THE WARRANTIES OF MERCHANTABILITY,
FITNESS FOR A PARTICULAR PURPOSE AND NONINFRINGEMENT. IN NO EVENT SHALL THE
AUTHORS OR COPYRIGHT HOLDERS BE LIABLE FOR ANY CLAIM, DAMAGES OR OTHER
LIABILITY, WHETHER IN AN ACTION OF CONTRACT, TORT OR OTHERWISE, ARISING FROM,
OUT OF OR IN CONNECTION WITH THE SOFTWARE OR THE USE OR OTHER DEALINGS IN THE
SOFTWARE.

---------------------------------------------------------------------------
Third-party material

* Weights: trained from scratch in this repository
  (scripts/tools/train_copy_model.py); MIT as above.
* Training text: a 246-story sample of TinyStories (Eldan & Li, 2023,
  https://huggingface.co/datasets/roneneldan/TinyStories), licensed
  CDLA-Sharing-1.0. No text written by the stories260K model was used.
* Tokenizer files (tokenizer.json, tokenizer.model, tokenizer_config.json,
  generation_config.json) are copied from examples/stories260K-mha8, which
  derives from Andrej Karpathy's llama2.c stories260K
  (https://huggingface.co/karpathy/tinyllamas), MIT License,
  Copyright (c) 2023 Andrej.
"""


def write_final(args, model, log_rows, stats):
    out = args.out.rstrip("/")
    tmp = out + ".tmp"
    if os.path.exists(tmp):
        shutil.rmtree(tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    for f in TOK_FILES:
        shutil.copyfile(os.path.join(TOK_DIR, f), os.path.join(tmp, f))
    with open(os.path.join(tmp, "LICENSE"), "w") as fh:
        fh.write(LICENSE_TEXT)
    last = [r for r in log_rows if "probe" in r][-1]
    lines = [
        "# copy-mha8: tiny true-MHA Llama that copies from its context",
        "",
        "LlamaForCausalLM, hidden 128, 4 layers, 8 attention heads (head_dim 16),",
        "num_key_value_heads 8 (distinct K/V heads, trained as MHA), intermediate "
        f"{args.intermediate}, context {args.seq_len}, tied embeddings, vocab 512 "
        "(tokenizer of examples/stories260K-mha8). Trained from scratch; see LICENSE.",
        "",
        "## Record",
        "",
        "| | |",
        "|---|---|",
        f"| command | `{stats['command']}` |",
        f"| seed | {args.seed} |",
        f"| optimizer steps | {stats['steps']} |",
        f"| stage 1 (random-token spans + repeats, {args.synthetic_batch} x {args.synthetic_len} tokens, "
        f"constant lr {args.lr} after {args.warmup} warm-up steps) | steps 1-{stats['stage1_end']} |",
        f"| stage 2 ({TRAIN_TEXT} with repeated spans p_rep {args.p_rep} and random-token spans "
        f"p_rand {args.p_rand}, {args.batch} x {args.seq_len} tokens, lr {args.lr2} cosine to 10% "
        f"over {args.max_steps} steps) | steps {stats['stage1_end'] + 1}-{stats['steps']} |",
        f"| tokens seen | {stats['tokens']} |",
        f"| parameters | {stats['params']} |",
        f"| training wall time | {stats['wall_s']:.0f} s (sum over resumed runs) |",
        "| machine | 2 vCPU, no GPU; torch 1 thread |",
        f"| final train loss (mean of last 50 steps) | {stats['train_loss']:.4f} |",
        "",
        f"## Copy probe at step {last['step']} (held-out {VALID_TEXT}, P = 64, "
        f"{args.probe_n} passages)",
        "",
        "| distance d | first loss | second loss | second top-1 | gain |",
        "|---|---|---|---|---|",
    ]
    for d, v in last["probe"].items():
        lines.append(f"| {d} | {v['first_loss']:.4f} | {v['second_loss']:.4f} | "
                     f"{v['second_top1']:.3f} | {v['gain']:.4f} |")
    lines += ["", "Probe definition and head ablation: scripts/tools/copy_ablation.py; "
              "full write-up: results/copy-model.md.", ""]
    with open(os.path.join(tmp, "RECORD.md"), "w") as fh:
        fh.write("\n".join(lines))
    if os.path.exists(out):
        old = out + ".old"
        if os.path.exists(old):
            shutil.rmtree(old)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old)
    else:
        os.replace(tmp, out)
    print(f"wrote {out}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="examples/copy-mha8")
    ap.add_argument("--work", default="runs/copy-model")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--intermediate", type=int, default=344)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=3e-3, help="stage-1 lr (constant after warm-up)")
    ap.add_argument("--lr2", type=float, default=3e-3, help="stage-2 peak lr (cosine to 10%%)")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--weight-decay-stage1", type=float, default=0.1)
    ap.add_argument("--init-std", type=float, default=0.02)
    ap.add_argument("--max-steps", type=int, default=1000, help="stage-2 steps")
    ap.add_argument("--min-steps", type=int, default=300,
                    help="stage-2 steps before the early stop may trigger")
    ap.add_argument("--p-rep", type=float, default=0.45)
    ap.add_argument("--p-rand", type=float, default=0.35)
    ap.add_argument("--synthetic-steps", type=int, default=6000,
                    help="at most this many stage-1 steps (random-token spans and their "
                         "repeats only, short sequences); 0 skips stage 1")
    ap.add_argument("--p-rep-synthetic", type=float, default=0.5)
    ap.add_argument("--synthetic-len", type=int, default=128)
    ap.add_argument("--synthetic-until-loss", type=float, default=4.0,
                    help="stage 1 ends early once its 50-step mean loss is below this")
    ap.add_argument("--synthetic-batch", type=int, default=16)
    ap.add_argument("--probe-every", type=int, default=50)
    ap.add_argument("--probe-n", type=int, default=32)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--stop-ratio", type=float, default=0.3)
    ap.add_argument("--stop-patience", type=int, default=2)
    ap.add_argument("--no-final", action="store_true", help="do not write --out")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(TOK_DIR)
    bos = tok.bos_token_id
    stream = ca.token_stream(tok, ca.read_docs(TRAIN_TEXT))
    probe_stream = ca.token_stream(tok, ca.read_docs(VALID_TEXT))
    distances = ca.fit_distances(ca.DISTANCES_DEFAULT, ca.P_DEFAULT, args.seq_len)
    print(f"train stream {len(stream)} tokens, probe stream {len(probe_stream)} tokens, "
          f"distances {distances}", flush=True)

    cfg = model_config(args)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    os.makedirs(args.work, exist_ok=True)
    ckpt_path = os.path.join(args.work, "ckpt.pt")
    log_path = os.path.join(args.work, "log.jsonl")
    step, wall_prev, stable = 0, 0.0, 0
    stage1_end = None if args.synthetic_steps > 0 else 0
    log_rows = []
    if args.resume and os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, wall_prev, stable = ck["step"], ck["wall_s"], ck.get("stable", 0)
        stage1_end = ck.get("stage1_end", stage1_end)
        if os.path.exists(log_path):
            with open(log_path) as fh:
                log_rows = [json.loads(x) for x in fh if x.strip()]
            log_rows = [r for r in log_rows if r["step"] <= step]
        print(f"resumed at step {step}", flush=True)
    else:
        open(log_path, "w").close()
    with open(log_path, "w") as fh:
        for r in log_rows:
            fh.write(json.dumps(r) + "\n")
    print(f"params {n_params}", flush=True)

    t_start = time.time()
    recent = []
    done = False
    def finished():
        return stage1_end is not None and step >= stage1_end + args.max_steps

    while not finished() and not done:
        model.train()
        stage1 = stage1_end is None
        x = batch_for_step(args, stream, bos, step, stage1)
        for i, g in enumerate(opt.param_groups):
            g["lr"] = lr_at(args, step, stage1_end)
            if i == 0:  # no weight decay in stage 1: it holds q/k at the zero saddle
                g["weight_decay"] = args.weight_decay_stage1 if stage1 else args.weight_decay
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        recent.append(loss.item())
        recent = recent[-50:]
        if stage1 and (step >= args.synthetic_steps or (
                len(recent) == 50 and sum(recent) / 50 < args.synthetic_until_loss)):
            stage1_end = step
            recent = []
            print(f"stage 1 (synthetic copy) ends at step {step}", flush=True)
        row = {"step": step, "loss": round(loss.item(), 4), "stage": 1 if stage1 else 2,
               "lr": round(lr_at(args, step - 1, None if stage1 else stage1_end), 6),
               "grad_norm": round(gn, 3), "wall_s": round(wall_prev + time.time() - t_start, 1)}
        if step % args.probe_every == 0 or finished():
            pr = ca.probe(model, probe_stream, bos, distances, n=args.probe_n)
            row["probe"] = {str(d): v for d, v in pr.items()}
            ok = (stage1_end is not None and step - stage1_end >= args.min_steps) and all(
                v["second_loss"] < args.stop_ratio * v["first_loss"] for v in pr.values())
            stable = stable + 1 if ok else 0
            ptxt = "  ".join(f"d{d}: {v['first_loss']:.3f}->{v['second_loss']:.3f} "
                             f"top1 {v['second_top1']:.2f}" for d, v in pr.items())
            print(f"step {step:5d} loss {sum(recent) / len(recent):.4f} lr {row['lr']:.2e} "
                  f"{row['wall_s']:.0f}s | probe {ptxt}", flush=True)
            if stable >= args.stop_patience:
                print(f"copy probe stable for {stable} probes: stopping at step {step}", flush=True)
                done = True
        elif step % 25 == 0:
            print(f"step {step:5d} loss {sum(recent) / len(recent):.4f} lr {row['lr']:.2e} "
                  f"{row['wall_s']:.0f}s", flush=True)
        log_rows.append(row)
        with open(log_path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if step % args.ckpt_every == 0 or done or finished():
            save_ckpt(ckpt_path, model, opt, step,
                      {"wall_s": wall_prev + time.time() - t_start, "stable": stable,
                       "stage1_end": stage1_end,
                       "args": vars(args)})
    wall = wall_prev + time.time() - t_start
    if not any("probe" in r for r in log_rows) or "probe" not in log_rows[-1]:
        pr = ca.probe(model, probe_stream, bos, distances, n=args.probe_n)
        log_rows[-1]["probe"] = {str(d): v for d, v in pr.items()}
    if not args.no_final:
        cmd = "python scripts/tools/train_copy_model.py " + " ".join(sys.argv[1:] if argv is None else argv)
        write_final(args, model, log_rows, {
            "command": ".venv/bin/" + cmd.replace(" --resume", "").strip(), "steps": step,
            "params": n_params, "wall_s": wall, "stage1_end": stage1_end,
            "tokens": stage1_end * args.synthetic_batch * args.synthetic_len
            + (step - stage1_end) * args.batch * args.seq_len,
            "train_loss": sum(r["loss"] for r in log_rows[-50:]) / len(log_rows[-50:])})
    return 0


if __name__ == "__main__":
    sys.exit(main())
