"""Held-out loss by position: where in the model's context a long uptraining gains and loses.

    OMP_NUM_THREADS=1 python scripts/studies/position_loss.py examples/stories260K-mha8 MODEL_DIR ...

Each held-out story (examples/data/tinystories-valid-sample.txt, read as the trainer reads it, BOS
first, cut at 512 tokens: the table's window) is scored whole by each model; the mean loss of the
tokens at positions 0-63, 64-127, 128-255 and 256-511 is printed per model. (issue 61: the 40M-token
run trained on 128-token blocks improved every position below 256 and lost at 256-511.)
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from uptrain.data import DataSource, read_documents

EDGES = (0, 64, 128, 256, 512)


def main(paths: list[str]) -> None:
    torch.set_num_threads(1)
    docs = read_documents(DataSource(files=["examples/data/tinystories-valid-sample.txt"]))
    tokenizer = AutoTokenizer.from_pretrained(paths[0])
    ids = [tokenizer(d, return_tensors="pt").input_ids[:, :EDGES[-1]] for d in docs]
    bands = list(zip(EDGES, EDGES[1:]))
    counts = [sum(max(0, min(hi, x.shape[1] - 1) - lo) for x in ids) for lo, hi in bands]
    print("| model | " + " | ".join(f"positions {lo}-{hi - 1}" for lo, hi in bands) + " |")
    print("|---|" + "---|" * len(bands))
    print("| tokens scored | " + " | ".join(f"{c:,}" for c in counts) + " |")
    for path in paths:
        model = AutoModelForCausalLM.from_pretrained(path).eval()
        sums = [0.0] * len(bands)
        with torch.no_grad():
            for x in ids:
                nll = -model(x).logits[0, :-1].log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0]
                for b, (lo, hi) in enumerate(bands):
                    sums[b] += nll[lo:hi].sum().item()
        print(f"| {path} | " + " | ".join(f"{s / c:.4f}" for s, c in zip(sums, counts)) + " |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
