"""Generation speed of `data.train.teacher_samples`: the trainer's generate_documents on a teacher.

    python scripts/bench_teacher_samples.py examples/stories260K-mha8 --threads 1 --batches 1,64 --tokens 16384
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from uptrain.data import TeacherSamples
from uptrain.train.model.teacher_samples import generate_documents


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("teacher")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batches", default="1,64", help="comma-separated generation batch sizes")
    parser.add_argument("--tokens", type=int, default=16384, help="new tokens per measurement")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.teacher, dtype=torch.float32).to(args.device).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.teacher)
    for batch in map(int, args.batches.split(",")):
        ts = TeacherSamples(tokens=args.tokens, max_new_tokens=args.max_new_tokens, batch=batch)
        t0 = time.time()
        texts, n = generate_documents(model, tokenizer, ts, torch.device(args.device))
        s = time.time() - t0
        print(f"threads {args.threads} batch {batch}: {len(texts)} documents, {n} new tokens in {s:.1f} s = "
              f"{len(texts) / s:.1f} samples/s, {n / s:,.0f} tokens/s")


if __name__ == "__main__":
    main()
