"""Copy probe and per-head ablation for a small MHA Llama (issue 59).

What it does
------------
1. Measures the *copy probe* on a causal LM (default: ``examples/copy-mha8``)
   with held-out text (default: ``examples/data/tinystories-valid-sample.txt``).
2. Ablates attention heads one at a time (zeroes that head's slice of the
   attention output, i.e. the input of ``o_proj``, with a forward pre-hook) and
   reports how much copy gain each head carries; then ablates the top heads
   together and, for comparison, the same number of randomly chosen other heads.
3. Writes everything as JSON (default ``results/copy-model.json``).

Copy probe (the definition the project uses)
--------------------------------------------
Held-out text is split into documents (blank-line separated), each tokenized
without special tokens, and concatenated into one token stream (no BOS inside).
A passage is ``P = 64`` consecutive tokens of that stream. For a distance ``d``
the sequence is ``BOS + passage + filler + passage`` where ``filler`` is ``d``
tokens of OTHER held-out text (taken half the stream away from the passage;
``d = 0`` means the passage repeats immediately). We score cross-entropy and
top-1 accuracy of predicting tokens 2..P of each occurrence from the previous
position (the first token of an occurrence cannot be copied, so it is left
out). ``copy gain = first_loss - second_loss``. Distances default to
``{0, 128, 320}``; those that do not fit the model's context are dropped
(``1 + 2P + d <= max_position_embeddings``).

Commands
--------
    .venv/bin/python scripts/tools/copy_ablation.py            # the copy model
    .venv/bin/python scripts/tools/copy_ablation.py --probe-only \
        --model examples/stories260K-mha8 --json ''                # probe only

CPU only, one thread by default.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import sys
import time

import torch

P_DEFAULT = 64
DISTANCES_DEFAULT = (0, 128, 320)


# --------------------------------------------------------------------------- data
def read_docs(path: str, heldout_tail: float | None = None) -> list[str]:
    """Documents of a text file (blank-line separated).

    ``heldout_tail``: keep only the last fraction of the file's characters
    (used for the ``examples/data/paper/*.txt.gz`` texts whose last 5% is held out).
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as fh:
        text = fh.read()
    if heldout_tail is not None:
        text = text[int(len(text) * (1.0 - heldout_tail)):]
    return [d.strip() for d in text.split("\n\n") if d.strip()]


def token_stream(tokenizer, docs: list[str]) -> list[int]:
    ids: list[int] = []
    for d in docs:
        ids.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
    return ids


def probe_sequences(stream: list[int], bos: int, P: int, d: int, n: int) -> list[list[int]]:
    """``n`` probe sequences BOS + passage + filler(d) + passage.

    Passage k starts at ``k * stride`` (non-overlapping when the stream is long
    enough); its filler starts half the stream later (wrapping around), so it
    is other held-out text.
    """
    L = len(stream)
    stride = max(P, (L - P) // n)
    seqs = []
    for k in range(n):
        s = (k * stride) % (L - P)
        passage = stream[s:s + P]
        f0 = (s + L // 2) % L
        filler = [stream[(f0 + i) % L] for i in range(d)]
        seqs.append([bos] + passage + filler + passage)
    return seqs


@torch.no_grad()
def probe(model, stream: list[int], bos: int, distances, P: int = P_DEFAULT,
          n: int = 64, batch: int = 16) -> dict:
    """Copy probe at each distance: dict d -> numbers."""
    model.eval()
    device = next(model.parameters()).device
    out = {}
    for d in distances:
        seqs = probe_sequences(stream, bos, P, d, n)
        ids = torch.tensor(seqs, dtype=torch.long, device=device)
        first_l, second_l, first_a, second_a = [], [], [], []
        for b in range(0, len(seqs), batch):
            x = ids[b:b + batch]
            logits = model(input_ids=x).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            tgt = x[:, 1:]
            nll = -logp.gather(-1, tgt.unsqueeze(-1)).squeeze(-1)
            hit = (logits[:, :-1].argmax(-1) == tgt).float()
            # occurrence 1 occupies positions 1..P, occurrence 2 positions 1+P+d..P+d+P.
            # predicting its tokens 2..P: target positions s+1..s+P-1, i.e. logit rows s..s+P-2.
            s1, s2 = 1, 1 + P + d
            first_l.append(nll[:, s1:s1 + P - 1].reshape(-1))
            second_l.append(nll[:, s2:s2 + P - 1].reshape(-1))
            first_a.append(hit[:, s1:s1 + P - 1].reshape(-1))
            second_a.append(hit[:, s2:s2 + P - 1].reshape(-1))
        fl = torch.cat(first_l).mean().item()
        sl = torch.cat(second_l).mean().item()
        out[int(d)] = {
            "first_loss": round(fl, 4),
            "second_loss": round(sl, 4),
            "first_top1": round(torch.cat(first_a).mean().item(), 4),
            "second_top1": round(torch.cat(second_a).mean().item(), 4),
            "gain": round(fl - sl, 4),
            "ratio_second_over_first": round(sl / fl, 4),
        }
    return out


def fit_distances(distances, P: int, ctx: int) -> list[int]:
    return [d for d in distances if 1 + 2 * P + d <= ctx]


# ----------------------------------------------------------------------- ablation
class HeadAblator:
    """Zero chosen heads' attention outputs (input of o_proj) via pre-hooks."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.layers = model.model.layers
        self.handles = []

    def set(self, heads: list[tuple[int, int]]):
        self.clear()
        by_layer: dict[int, list[int]] = {}
        for l, h in heads:
            by_layer.setdefault(l, []).append(h)
        hd = self.head_dim
        for l, hs in by_layer.items():
            def hook(mod, args, hs=tuple(hs)):
                x = args[0].clone()
                for h in hs:
                    x[..., h * hd:(h + 1) * hd] = 0
                return (x,) + tuple(args[1:])
            self.handles.append(self.layers[l].self_attn.o_proj.register_forward_pre_hook(hook))

    def clear(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def mean_gain(res: dict) -> float:
    return sum(v["gain"] for v in res.values()) / len(res)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="examples/copy-mha8")
    ap.add_argument("--text", action="append", default=None,
                    help="held-out text; may be given several times "
                         "(default examples/data/tinystories-valid-sample.txt)")
    ap.add_argument("--heldout-tail", type=float, default=None,
                    help="use only the last fraction of each text (0.05 for examples/data/paper)")
    ap.add_argument("--P", type=int, default=P_DEFAULT)
    ap.add_argument("--distances", default="0,128,320")
    ap.add_argument("--n", type=int, default=64, help="passages per distance")
    ap.add_argument("--top", default="2,3,4", help="sizes of the top-head sets to ablate")
    ap.add_argument("--random-draws", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--probe-only", action="store_true")
    ap.add_argument("--json", default="results/copy-model.json", help="'' to skip writing")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    texts = args.text or ["examples/data/tinystories-valid-sample.txt"]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    docs = []
    for t in texts:
        docs.extend(read_docs(t, args.heldout_tail))
    stream = token_stream(tok, docs)
    bos = tok.bos_token_id if tok.bos_token_id is not None else model.config.bos_token_id
    ctx = model.config.max_position_embeddings
    distances = fit_distances([int(x) for x in args.distances.split(",")], args.P, ctx)
    t0 = time.time()
    base = probe(model, stream, bos, distances, args.P, args.n)
    print(f"model {args.model}  stream {len(stream)} tokens  P={args.P} n={args.n}")
    print(f"{'d':>5} {'first':>8} {'second':>8} {'top1_1':>7} {'top1_2':>7} {'gain':>7} {'2nd/1st':>7}")
    for d, v in base.items():
        print(f"{d:>5} {v['first_loss']:8.4f} {v['second_loss']:8.4f} {v['first_top1']:7.3f} "
              f"{v['second_top1']:7.3f} {v['gain']:7.4f} {v['ratio_second_over_first']:7.3f}")
    result = {
        "model": args.model, "texts": texts, "heldout_tail": args.heldout_tail,
        "stream_tokens": len(stream), "P": args.P, "passages_per_distance": args.n,
        "distances": distances, "probe": {str(k): v for k, v in base.items()},
    }
    if not args.probe_only:
        cfg = model.config
        L, H = cfg.num_hidden_layers, cfg.num_attention_heads
        abl = HeadAblator(model)
        g0 = mean_gain(base)
        per_head = []
        for l in range(L):
            for h in range(H):
                abl.set([(l, h)])
                r = probe(model, stream, bos, distances, args.P, args.n)
                g = mean_gain(r)
                per_head.append({"layer": l, "head": h, "mean_gain": round(g, 4),
                                 "drop": round(g0 - g, 4),
                                 "gain_by_distance": {str(k): v["gain"] for k, v in r.items()},
                                 "second_loss_by_distance": {str(k): v["second_loss"] for k, v in r.items()}})
                print(f"ablate L{l}H{h}: mean gain {g:.4f} (drop {g0 - g:+.4f})", flush=True)
        abl.clear()
        ranked = sorted(per_head, key=lambda r: -r["drop"])
        rng = random.Random(args.seed)
        all_heads = [(l, h) for l in range(L) for h in range(H)]
        sets = []
        for k in [int(x) for x in args.top.split(",")]:
            top = [(r["layer"], r["head"]) for r in ranked[:k]]
            abl.set(top)
            rt = probe(model, stream, bos, distances, args.P, args.n)
            others = [x for x in all_heads if x not in top]
            rand_gains, rand_sets = [], []
            for _ in range(args.random_draws):
                pick = rng.sample(others, k)
                abl.set(pick)
                rr = probe(model, stream, bos, distances, args.P, args.n)
                rand_gains.append(mean_gain(rr))
                rand_sets.append([f"L{l}H{h}" for l, h in pick])
            abl.clear()
            entry = {
                "k": k, "top_heads": [f"L{l}H{h}" for l, h in top],
                "top_probe": {str(kk): v for kk, v in rt.items()},
                "top_mean_gain": round(mean_gain(rt), 4),
                "random_mean_gain_avg": round(sum(rand_gains) / len(rand_gains), 4),
                "random_mean_gain_min": round(min(rand_gains), 4),
                "random_mean_gain_max": round(max(rand_gains), 4),
                "random_sets": rand_sets,
                "random_mean_gains": [round(g, 4) for g in rand_gains],
            }
            sets.append(entry)
            print(f"top-{k} {entry['top_heads']}: mean gain {entry['top_mean_gain']:.4f}  "
                  f"random {k} others: avg {entry['random_mean_gain_avg']:.4f} "
                  f"[{entry['random_mean_gain_min']:.4f}, {entry['random_mean_gain_max']:.4f}]")
            for kk, v in rt.items():
                print(f"   d={kk}: first {v['first_loss']:.4f} second {v['second_loss']:.4f} "
                      f"top1 {v['second_top1']:.3f} gain {v['gain']:.4f}")
        result.update({"baseline_mean_gain": round(g0, 4), "per_head": per_head,
                       "ranked_heads": [f"L{r['layer']}H{r['head']}" for r in ranked],
                       "top_vs_random": sets, "random_draws": args.random_draws,
                       "seed": args.seed})
    result["seconds"] = round(time.time() - t0, 1)
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        tmp = args.json + ".tmp"
        with open(tmp, "w") as fh:
            json.dump(result, fh, indent=1)
        os.replace(tmp, args.json)
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
