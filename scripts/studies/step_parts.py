"""What a distillation step on the bundled model is made of, measured in one process (results/quality-curve.md,
round two, seventh part): the source's forward against the student's forward and backward, per micro batch;
the attention alone (SDPA against a hand-written grouped attention, float32 and bfloat16); and a whole micro
batch (the source's forward, the student's forward and backward of the KL) with that attention in the models.

    OMP_NUM_THREADS=1 python scripts/studies/step_parts.py --student runs/demo-tail3/stories260K-gqa2

One thread, CPU time (`time.process_time`) per call, the median of three rounds; timings from one process
only, so that the machine's drift (a third within an hour on the 2-core machine) does not enter a ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from uptrain.train.model.cpu_attention import attention_forward, grouped_causal_attention

REPO = Path(__file__).resolve().parents[2]


def _ms(fn, calls: int) -> float:
    """Median over three rounds of CPU milliseconds per call of fn()."""
    rounds = []
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(calls):
            fn()
        rounds.append((time.process_time() - t0) / calls * 1e3)
    return statistics.median(rounds)


def _models_and_ids(student_dir: Path, teacher_dir: Path, seq: int):
    """(student, teacher in eval mode, one micro batch of 1,024 tokens in blocks of `seq`)."""
    student = AutoModelForCausalLM.from_pretrained(student_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    return student, teacher, torch.randint(3, 512, (1024 // seq, seq), generator=torch.Generator().manual_seed(0))


def model_parts(student_dir: Path, teacher_dir: Path, seq: int) -> dict:
    """The source's forward and the student's forward + backward of one micro batch of 1,024 tokens."""
    student, teacher, ids = _models_and_ids(student_dir, teacher_dir, seq)

    def teach():
        with torch.no_grad():
            teacher(input_ids=ids)

    def learn():
        student(input_ids=ids).logits.float().logsumexp(-1).sum().backward()

    teach(), learn()  # warm-up
    return {"seq": seq, "teacher_forward_ms": _ms(teach, 10), "student_forward_backward_ms": _ms(learn, 10)}


def attention_parts(batch: int, seq: int, dtype: torch.dtype, heads: int = 8, kv: int = 2, dim: int = 8) -> dict:
    """Forward + backward of the attention alone at the student's shapes, SDPA and by hand."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(batch, heads, seq, dim, generator=g).to(dtype)
    k, v = (torch.randn(batch, kv, seq, dim, generator=g).to(dtype) for _ in range(2))

    def run(fn):
        def once():
            a, b, c = (x.clone().requires_grad_() for x in (q, k, v))
            fn(a, b, c).sum().backward()
        return once

    sdpa = run(lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True))
    by_hand = run(lambda a, b, c: grouped_causal_attention(a, b, c, dim**-0.5, dtype))
    return {"batch": batch, "seq": seq, "dtype": str(dtype).split(".")[-1],
            "sdpa_ms": _ms(sdpa, 20), "by_hand_ms": _ms(by_hand, 20)}


def _in_model(dtype: torch.dtype):
    """uptrain's `attention_forward` (bfloat16, what `bf16_attention=true` trains with) with its products in
    `dtype` instead."""
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        if attention_mask is not None or key.size(2) != query.size(2) or dropout or query.size(2) == 1:
            return attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                     **kwargs)  # SDPA's
        scale = query.size(-1) ** -0.5 if scaling is None else scaling
        return grouped_causal_attention(query, key, value, scale, dtype).transpose(1, 2).contiguous(), None

    return attention


def micro_batch_by_attention(student_dir: Path, teacher_dir: Path, seq: int) -> dict:
    """CPU ms of one 1,024-token distillation micro batch with each attention in both models."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from uptrain.train.model.losses import kd_loss_sum

    student, teacher, ids = _models_and_ids(student_dir, teacher_dir, seq)

    def step():
        with torch.no_grad():
            target = teacher(input_ids=ids).logits
        kd_loss_sum(student(input_ids=ids).logits, target, 1.0).backward()

    result = {"seq": seq}
    for name, attention in (("sdpa", sdpa_attention_forward), ("by_hand_float32", _in_model(torch.float32)),
                            ("by_hand_bfloat16", attention_forward)):
        AttentionInterface._global_mapping["sdpa"] = attention
        step()
        result[f"{name}_ms"] = _ms(step, 8)
    AttentionInterface._global_mapping["sdpa"] = sdpa_attention_forward
    return result


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--student", type=Path, required=True, help="the converted start (e.g. a demo's stories260K-gqa2)")
    p.add_argument("--teacher", type=Path, default=REPO / "examples" / "stories260K-mha8")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    for seq in (128, 512):
        print(model_parts(args.student, args.teacher, seq), flush=True)
    for batch, seq in ((8, 128), (2, 512)):
        for dtype in (torch.float32, torch.bfloat16):
            print(attention_parts(batch, seq, dtype), flush=True)
    for seq in (128, 512):
        print(micro_batch_by_attention(args.student, args.teacher, seq), flush=True)


if __name__ == "__main__":
    main()
