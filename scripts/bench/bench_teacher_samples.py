"""Generation speed of `data.train.teacher_samples`, before and after issue 49, in one run.

    python scripts/bench/bench_teacher_samples.py examples/stories260K-mha8 --threads 1 --tokens 262144
    python scripts/bench/bench_teacher_samples.py examples/stories260K-mha8 --threads 2 --tokens 262144 --json results/teacher-samples-speed.json

"before": transformers' `generate` (dynamic KV cache, full-sort top-p), 64 sequences at a time: what
`generate_documents` ran before issue 49 with the shipped config's batch 64 (kept here, verbatim in
what it computes, so that both are measured on one machine at one moment). "after": today's
`generate_documents` (uptrain.train.model.sampling: static cache, top-k-bounded top-p), with the
config's default batch (auto) and, for comparison, batch 64. Same teacher, seed, temperature, top-p,
max_new_tokens and token count in every row; each row reports tokens/s of new tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from uptrain.data import TeacherSamples
from uptrain.train.model.teacher_samples import batch_rows, generate_documents, new_tokens_cap


def before(model, tokenizer, ts: TeacherSamples) -> int:
    """The pre-issue-49 generation: `model.generate` per batch of ts.batch rows from BOS, seeded per
    batch; returns the new tokens counted as generate_documents counted them."""
    eos, bos = tokenizer.eos_token_id, tokenizer.bos_token_id
    made, index = 0, 0
    while made < ts.tokens:
        torch.manual_seed(ts.seed * 1_000_003 + index)
        ids = torch.full((ts.batch, 1), bos)
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                 temperature=ts.temperature, top_p=ts.top_p, top_k=0,
                                 max_new_tokens=new_tokens_cap(model, ts, 1), use_cache=True, pad_token_id=eos,
                                 eos_token_id=eos)
        for row in out[:, 1:].tolist():
            made += row.index(eos) + 1 if eos in row else len(row)
            if made >= ts.tokens:
                break
        index += 1
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("teacher")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=262144, help="new tokens per measurement")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--json", help="append the rows to this JSON file")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.teacher)
    rows = []
    for name, batch in (("before: transformers generate", 64), ("after: uptrain sampler", 0),
                        ("after: uptrain sampler", 64)):
        ts = TeacherSamples(tokens=args.tokens, max_new_tokens=args.max_new_tokens, batch=batch, seed=0)
        load, t0 = os.getloadavg()[0], time.time()
        n = before(model, tokenizer, ts) if name.startswith("before") else \
            generate_documents(model, tokenizer, ts, torch.device("cpu"))[1]
        s = time.time() - t0
        rows.append({"impl": name, "batch": batch or f"auto ({batch_rows(model, ts)})", "threads": args.threads,
                     "tokens": n, "seconds": round(s, 2), "tokens_per_s": round(n / s), "load_1min": round(load, 2)})
        print(f"{name:30s} batch {rows[-1]['batch']!s:11s} threads {args.threads}: {n:,} new tokens in {s:.1f} s = "
              f"{n / s:,.0f} tokens/s (load {load:.2f})", flush=True)
    speedup = rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"]
    print(f"after (default batch) / before: {speedup:.1f}x")
    if args.json:
        old = json.load(open(args.json)) if os.path.isfile(args.json) else []
        old.append({"teacher": args.teacher, "machine": f"{os.cpu_count()} CPUs, {platform.machine()}",
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "rows": rows,
                    "speedup": round(speedup, 2)})
        with open(args.json, "w") as f:
            json.dump(old, f, indent=1)


if __name__ == "__main__":
    main()
