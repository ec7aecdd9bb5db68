"""Layer-wise reconstruction (`--refine`): tune a converted attention module so that its output
matches the ORIGINAL attention module's output on calibration text.

Pure optimisation on modules and tensors (no paths, no model loading). The student is the
converted layer's attention module, a real transformers module (built with the converted config,
fewer K/V heads) holding the closed-form start (`fit`, or `mean` where the fit refuses); it runs its
own forward, so softmax, RoPE, masks, key norms (Qwen3, OLMo-2, ...) and partial rotary (Phi,
StableLM, ...) are the family's own. Every parameter of the module is trained: the q/k/v/o
weights and biases and the attention's own norms where it has them (q_norm/k_norm).

Loss: squared error of the outputs relative to the targets' power, summed over the sequences of a
mini-batch (gradient accumulation: sequences of different lengths, no padding). Adam, with each
parameter's learning rate `lr` times the RMS of its start value (a bias takes its weight's RMS), so
one `lr` suits weights of any scale; the rate warms up linearly over the first fifth of `steps` and
decays along a cosine towards zero at `steps` (results/refine-speed.md: 2 sequences x 400 steps, a
fifth of the sequences the constant rate before issue 43 ran, end within 1% of its held-out loss;
that rate given the same 800 sequences a layer ended 2.5-3.2% above it). Stopping: the error on
held-out sequences is measured every `eval_every` steps. Whole documents are held out
(`split_held_out`: windows of one document are alike, so a document on both sides would let the
held-out error follow the training error), at least `min_holdout_tokens` tokens where the text
allows, at most half. The best held-out state is kept (put back at the end), and training stops
after `patience` measurements without an improvement. Then, with the rest of that state fixed,
the output is linear in the output projection: it is solved in closed form (`output_solve`: least
squares on the training sequences) and kept where the held-out error improves. A start that is
already exact (held-out error below `atol`) is returned unchanged.

Cost (CPU): the attention's backward dominates and grows with the square of the sequence length,
so the steps are what costs; denormal floats (which the softmax backward makes) are flushed to
zero while refining, which made one stories260K layer 40% faster (results/refine-speed.md).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from uptrain.stopping import at_once
from uptrain.convert.math.capture import Captured, recording
from uptrain.convert.math.output_solve import output_projection, solve_output
from uptrain.convert.registry.choices import REFINE_INPUTS

# the call that runs an attention module on calibration sequence i: (module, x [T, D], i) -> [T, D]
AttentionCall = Callable[[nn.Module, Tensor, int], Tensor]

# defaults chosen by measurement on stories260K-mha8 and reference-mha8 (results/refine-speed.md)
STEPS = 400  # the schedule's length (the held-out rule may stop it sooner)
LR = 6e-2  # the peak, after the warm-up (without the warm-up this rate lost 1.4% of held-out loss)
BATCH = 2  # 2 a step beat 4 a step given a quarter more sequences (twice the updates)
WARMUP = 0.2  # the share of `steps` the rate takes to reach `lr` (0.05 and 0.1 did worse)
SCHEDULES = ("cosine", "constant")  # constant: the optimiser before issue 43, kept for comparisons
HOLDOUT = 0.125
MIN_HOLDOUT_TOKENS = 4096  # held out at least (where the text has twice that): a stop rule on fewer is noise
PATIENCE = 4
EVAL_EVERY = 40
MIN_DELTA = 1e-3  # relative improvement of the held-out error that counts as one
ATOL = 1e-7  # held-out relative error treated as exact (float32 rounding is ~1e-12 of the power)
PROGRESS_EVERY = 10.0  # seconds (wall) between two `progress` calls inside a layer's refinement


@dataclass
class RefineResult:
    """Relative output errors ||y - t||² / ||t||² (summed over sequences) before and after."""

    error_before: float  # held-out sequences
    error_after: float
    train_error_before: float  # the sequences trained on
    train_error_after: float
    steps_run: int
    best_step: int  # the step whose state was kept (0: the start)
    stopped_early: bool
    seconds: float
    held_out: list[int]  # indices of the held-out sequences (never trained on)
    held_out_tokens: int
    held_out_documents: int
    history: list[tuple[int, float]]  # (step, held-out error) of every measurement after the start
    solved_error: float | None = None  # held-out error right after the output solve (None: not run)
    output_solved: bool = False  # that solve improved the held-out error and was kept

    def as_dict(self) -> dict[str, float | int | bool]:
        return dict(self.__dict__)


@dataclass
class RefineProgress:
    """Where a layer's refinement is (`refine_attention(progress=...)`): called every `progress_every`
    seconds and right after each held-out measurement, because at 7B shapes a layer takes an hour
    on a CPU and a user must see it move. seconds_left: (steps - step) x the mean seconds per step
    so far (held-out measurements included), an estimate for this layer, 0 at the last step."""

    step: int  # steps done, 1..steps
    steps: int  # the schedule's length (the held-out rule may stop sooner)
    held_out_error: float  # the last held-out measurement (before the first: the start's)
    best_error: float  # the best held-out error so far (the state that will be kept)
    seconds: float  # spent in this layer's descent so far
    seconds_left: float
    measured: bool  # called right after a held-out measurement
    stopped: bool = False  # the held-out rule stopped the descent at this step (the time left is void)


def relative_error(student: nn.Module, call: AttentionCall, inputs: Sequence[Tensor], targets: Sequence[Tensor],
                   indices: Sequence[int]) -> float:
    """sum_i ||call(student, inputs[i], i) - targets[i]||² / sum_i ||targets[i]||² over `indices`."""
    err = power = 0.0
    with torch.no_grad():
        for i in indices:
            t = targets[i].float()
            err += (call(student, inputs[i], i).float() - t).pow(2).sum().item()
            power += t.pow(2).sum().item()
    return err / max(power, 1e-30)


def split_held_out(lengths: Sequence[int], documents: Sequence[int], fraction: float, min_tokens: int,
                   seed: int) -> tuple[list[int], list[int]]:
    """Which sequences are held out (the stop rule's test) and which are trained on: (held, train).

    lengths[i]: tokens of sequence i (>= 1); documents[i]: the document it was cut from. Whole
    documents are held out, in a seeded order, until the held-out tokens reach the target
    max(fraction x total, min_tokens), never more than half the tokens (total // 2): no document
    has windows on both sides, and both sides keep at least one document. Where the seeded order
    overshoots the cap but some set of documents reaches the target under it, that set is found
    (subset sum). One document only: a contiguous tail of its windows (at least one, at least one
    left). Both lists in increasing index order; the same for the same inputs and seed.
    """
    n = len(lengths)
    if n != len(documents) or n < 2 or min(lengths) < 1 or not 0 < fraction < 1:
        raise ValueError(f"split_held_out needs >= 2 sequences of >= 1 token, one document each, and "
                         f"0 < fraction < 1; got {n} lengths, {len(documents)} documents, fraction {fraction}")
    total = sum(lengths)
    target, cap = max(math.ceil(fraction * total), min_tokens), total // 2
    by_doc: dict[int, list[int]] = {}
    for i, d in enumerate(documents):
        by_doc.setdefault(d, []).append(i)
    if len(by_doc) == 1:  # no second document: the tail windows, adjacent to the trained ones
        held = [n - 1]
        while len(held) < n - 1 and sum(lengths[i] for i in held) < target \
                and sum(lengths[i] for i in held) + lengths[held[0] - 1] <= cap:
            held.insert(0, held[0] - 1)
        return held, list(range(held[0]))
    docs = list(by_doc)
    random.Random(seed).shuffle(docs)
    size = {d: sum(lengths[i] for i in by_doc[d]) for d in docs}
    chosen, held_tokens = [], 0
    for d in docs:  # greedy in the seeded order, skipping documents that would pass the cap
        if held_tokens < target and held_tokens + size[d] <= cap:
            chosen.append(d)
            held_tokens += size[d]
    if held_tokens < target:  # the order overshot: the smallest subset sum >= target under the cap, if any
        chosen = _subset_sum([size[d] for d in docs], target, cap, [docs.index(d) for d in chosen])
        chosen = [docs[j] for j in chosen]
    held = sorted(i for d in chosen for i in by_doc[d])
    out = set(held)
    return held, [i for i in range(n) if i not in out]


def _subset_sum(sizes: list[int], target: int, cap: int, fallback: list[int]) -> list[int]:
    """Indices of `sizes` whose sum is the smallest in [target, cap]; `fallback` where none is."""
    reach = [1]  # reach[k]: bitset of the sums the first k sizes can make
    mask = (1 << (cap + 1)) - 1
    for s in sizes:
        reach.append((reach[-1] | (reach[-1] << s)) & mask)
    best = next((t for t in range(target, cap + 1) if reach[-1] >> t & 1), None)
    if best is None:
        return fallback
    picked = []
    for k in range(len(sizes), 0, -1):  # walk back: keep size k-1 where the sum needs it
        if not reach[k - 1] >> best & 1:
            picked.append(k - 1)
            best -= sizes[k - 1]
    return sorted(picked)


def _param_groups(student: nn.Module, lr: float) -> list[dict]:
    """One Adam group per parameter, lr scaled by the RMS of its start value (biases: their weight's);
    `base_lr` keeps the scaled rate that the schedule multiplies."""
    named = dict(student.named_parameters())
    groups = []
    for name, p in named.items():
        ref = named.get(name[: -len("bias")] + "weight", p) if name.endswith("bias") else p
        scale = ref.detach().float().pow(2).mean().sqrt().item()
        rate = lr * (scale if scale > 0 else 1.0)
        groups.append({"params": [p], "lr": rate, "base_lr": rate})
    return groups


def lr_factor(step: int, steps: int, schedule: str = "cosine") -> float:
    """The learning rate of `step` (1..steps) as a share of the peak: linear warm-up over the first
    WARMUP x steps (at least one), then a cosine from 1 down towards 0 (the last step still moves);
    1 throughout for the `constant` schedule."""
    if schedule == "constant":
        return 1.0
    warmup = max(1, round(WARMUP * steps))
    if step <= warmup:
        return step / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / (steps - warmup + 1)))


@contextmanager
def _flushing_denormals() -> Iterator[None]:
    """Denormal floats flushed to zero inside the block (CPU): the softmax backward makes them and
    runs up to 40% slower on them; torch has no getter, so the block ends at torch's default (off)."""
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def _improves(err: float, best: float, min_delta: float, atol: float) -> bool:
    return err < best - max(min_delta * best, atol)


def _descend(student: nn.Module, call: AttentionCall, inputs: Sequence[Tensor], targets: Sequence[Tensor],
             held: list[int], train: list[int], best: float, o: dict) -> tuple[dict, float, int, int, bool, list]:
    """Adam on the training sequences, the held-out error measured every o['eval_every'] steps (o:
    `refine_attention`'s settings). Returns (best state, its held-out error, its step, steps run,
    stopped early, history)."""
    params = dict(student.named_parameters())
    best_state = {k: p.detach().clone() for k, p in params.items()}
    opt = torch.optim.Adam(_param_groups(student, o["lr"]))
    gen = torch.Generator().manual_seed(o["seed"])
    queue: list[int] = []
    best_step, bad, step, steps = 0, 0, 0, o["steps"]
    history: list[tuple[int, float]] = []
    began = shown = time.perf_counter()
    err = best
    for step in range(1, steps + 1):
        at_once.pause("refine")
        at_once.check()  # Ctrl-C: stop within a step, not at the end of the layer
        factor = lr_factor(step, steps, o["schedule"])
        for group in opt.param_groups:
            group["lr"] = group["base_lr"] * factor
        if len(queue) < o["batch"]:  # epochs over the training sequences, each in a fresh order
            queue += [train[j] for j in torch.randperm(len(train), generator=gen).tolist()]
        idx, queue = queue[: o["batch"]], queue[o["batch"]:]
        power = sum(targets[i].float().pow(2).sum() for i in idx).clamp_min(1e-30)
        opt.zero_grad(set_to_none=True)
        for i in idx:  # one backward per sequence: lengths differ, nothing is padded
            ((call(student, inputs[i], i).float() - targets[i].float()).pow(2).sum() / power).backward()
        opt.step()
        measured = step % o["eval_every"] == 0 or step == steps
        if measured:
            err = relative_error(student, call, inputs, targets, held)
            history.append((step, err))
            if _improves(err, best, o["min_delta"], o["atol"]):
                best, best_step, bad = err, step, 0
                best_state = {k: p.detach().clone() for k, p in params.items()}
            else:
                bad += 1
        now = time.perf_counter()
        if o["progress"] is not None and (measured or now - shown >= o["progress_every"]):
            shown = now
            o["progress"](RefineProgress(step, steps, err, best, now - began, (steps - step) * (now - began) / step,
                                         measured))
        if bad >= o["patience"]:
            if o["progress"] is not None and step < steps:
                o["progress"](RefineProgress(step, steps, err, best, now - began, 0.0, measured, stopped=True))
            return best_state, best, best_step, step, step < steps, history
    return best_state, best, best_step, step, False, history


def _solve_and_keep(student: nn.Module, call: AttentionCall, inputs: Sequence[Tensor], targets: Sequence[Tensor],
                    held: list[int], train: list[int], best: float, o: dict) -> tuple[float | None, bool]:
    """The output projection solved on the training sequences for the student's current (kept)
    state; kept where the held-out error improves by the stop rule's measure, else put back.
    Returns (held-out error after the solve or None where no projection qualifies, kept)."""
    proj = output_projection(student, lambda: call(student, inputs[train[0]], train[0]))
    if proj is None:
        return None, False
    before = {k: p.detach().clone() for k, p in proj.named_parameters()}
    at_once.pause("solve")
    solve_output(proj, lambda i: call(student, inputs[i], i), targets, train)
    err = relative_error(student, call, inputs, targets, held)
    if _improves(err, best, o["min_delta"], o["atol"]):
        return err, True
    with torch.no_grad():
        for k, p in proj.named_parameters():
            p.copy_(before[k])
    return err, False


def refine_attention(student: nn.Module, call: AttentionCall, inputs: Sequence[Tensor], targets: Sequence[Tensor],
                     *, steps: int = STEPS, lr: float = LR, batch: int = BATCH, holdout_fraction: float = HOLDOUT,
                     patience: int = PATIENCE, eval_every: int = EVAL_EVERY, seed: int = 0,
                     min_delta: float = MIN_DELTA, atol: float = ATOL, documents: Sequence[int] | None = None,
                     min_holdout_tokens: int = MIN_HOLDOUT_TOKENS, schedule: str = "cosine",
                     progress: Callable[[RefineProgress], None] | None = None,
                     progress_every: float = PROGRESS_EVERY,
                     phase: Callable[[str], AbstractContextManager] | None = None) -> RefineResult:
    """Tune `student`'s parameters in place so that call(student, inputs[i], i) ≈ targets[i].

    inputs[i]: [T_i, D] attention-module input of calibration sequence i (after the layer's input
    norm); targets[i]: [T_i, D_out] the original attention module's output on it. Both on the
    student's device. At least 2 sequences (one is held out). documents[i]: the document sequence i
    was cut from (default: each its own), so that `split_held_out` holds out whole documents.
    schedule: "cosine" (warm-up, cosine decay, then the output solve) or "constant" (the optimiser
    before issue 43: a constant rate, no solve; for comparisons). progress: called with a
    `RefineProgress` at most every `progress_every` seconds (wall) and after each held-out measurement.
    phase: a context manager per phase without steps (the held-out error of the start, the output
    solve, the training error after), named for what it does (`progress.Heartbeat`: never silent).
    Returns the errors before and after.
    """
    n = len(inputs)
    if n != len(targets) or n < 2:
        raise ValueError(f"refine needs at least 2 (input, target) sequence pairs, got {n} inputs and {len(targets)} targets")
    if steps < 0 or lr <= 0 or batch < 1 or not 0 < holdout_fraction < 1 or schedule not in SCHEDULES:
        raise ValueError(f"refine needs steps >= 0, lr > 0, batch >= 1, 0 < holdout_fraction < 1 and a schedule "
                         f"in {SCHEDULES}")
    start = time.perf_counter()
    o = dict(steps=steps, lr=lr, batch=batch, patience=patience, eval_every=eval_every, seed=seed,
             min_delta=min_delta, atol=atol, schedule=schedule, progress=progress, progress_every=progress_every)
    documents = list(range(n)) if documents is None else list(documents)
    lengths = [int(x.shape[0]) for x in inputs]
    held, train = split_held_out(lengths, documents, holdout_fraction, min_holdout_tokens, seed)
    was_training = student.training
    student.eval()  # no dropout: the target is the deterministic original output
    phase = phase or (lambda what: nullcontext())
    with _flushing_denormals():
        with phase("the start's error on the calibration sequences"):
            before_h = relative_error(student, call, inputs, targets, held)
            before_t = relative_error(student, call, inputs, targets, train)
        best, best_step, step, stopped, history, solved, kept = before_h, 0, 0, False, [], None, False
        if before_h > atol and steps > 0:
            state, best, best_step, step, stopped, history = _descend(student, call, inputs, targets, held, train,
                                                                      before_h, o)
            with torch.no_grad():
                for k, p in student.named_parameters():
                    p.copy_(state[k])
            if schedule == "cosine":
                with phase("the output solve (least squares in float64)"):
                    solved, kept = _solve_and_keep(student, call, inputs, targets, held, train, best, o)
                best = solved if kept else best
        with phase("the refined layer's error on the training sequences"):
            after_t = relative_error(student, call, inputs, targets, train)
    student.train(was_training)
    return RefineResult(before_h, best, before_t, after_t, step, best_step, stopped,
                        round(time.perf_counter() - start, 3), held, sum(lengths[i] for i in held),
                        len({documents[i] for i in held}), history, solved, kept)


# ------------------------------------------------------------------ whole models in memory

def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module of each decoder layer, in layer order: the modules the registry names for
    the model's type (`Attention.module`: `self_attn`, `attn`, ...) directly under a numbered layer."""
    import re

    from uptrain.convert.registry.architectures import attention_for

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    attention = attention_for(model_type) if model_type else None
    if attention is None:
        raise ValueError(f"model type {model_type!r} is not in the registry (uptrain/convert/registry/architectures.py)")
    pattern = re.compile(rf"(?:^|\.)(\d+)\.{re.escape(attention.module)}$")
    found = {int(m[1]): mod for name, mod in model.named_modules() if (m := pattern.search(name))}
    if not found or sorted(found) != list(range(len(found))):
        raise ValueError(f"found no numbered decoder layers holding a `{attention.module}` module in the model")
    return [found[i] for i in range(len(found))]


@torch.no_grad()
def capture(model: nn.Module, sequences: Sequence[Tensor], layers: Sequence[int] | None = None) -> dict[int, Captured]:
    """Run `model` on each token sequence ([T] ids) and record the attention modules of `layers` (all: None)."""
    mods = attention_modules(model)
    wanted = range(len(mods)) if layers is None else layers
    out = {i: Captured() for i in wanted}
    device = next(model.parameters()).device
    with ExitStack() as hooks:
        for i in wanted:
            hooks.enter_context(recording(mods[i], out[i]))
        for ids in sequences:
            model(input_ids=ids.reshape(1, -1).to(device), use_cache=False)
    return out


def call_with(kwargs: Sequence[dict]) -> AttentionCall:
    """The AttentionCall that runs a module on sequence i with the call arguments recorded for it."""
    def call(module: nn.Module, x: Tensor, i: int) -> Tensor:
        out = module(hidden_states=x.unsqueeze(0), **kwargs[i])
        return (out[0] if isinstance(out, tuple) else out)[0]
    return call


def refine_model(original: nn.Module, converted: nn.Module, sequences: Sequence[Tensor], *,
                 inputs: str = "original", log: Callable[[str], None] | None = None, **options) -> list[RefineResult]:
    """Refine every attention module of `converted` (in place, layer by layer) towards `original`'s.

    sequences: calibration token ids, each [T]. inputs="original": each layer learns on the original
    model's attention inputs, targets the original module's outputs on them; inputs="converted":
    on the converted model's own inputs (with the layers before it already refined), targets the
    original module's outputs on those. options: `refine_attention`'s keywords.
    """
    if inputs not in REFINE_INPUTS:
        raise ValueError(f"inputs must be 'original' or 'converted', not {inputs!r}")
    teacher = attention_modules(original)
    students = attention_modules(converted)
    if len(teacher) != len(students):
        raise ValueError(f"the original has {len(teacher)} attention layers, the converted model {len(students)}")
    for p in original.parameters():
        p.requires_grad_(False)
    reference = capture(original, sequences) if inputs == "original" else None
    results = []
    for layer, student in enumerate(students):
        if reference is not None:
            rec = reference[layer]
            xs, ys = rec.inputs, rec.outputs
        else:
            rec = capture(converted, sequences, [layer])[layer]
            xs = rec.inputs
            with torch.no_grad():
                ys = [call_with(rec.kwargs)(teacher[layer], x, i) for i, x in enumerate(xs)]
        result = refine_attention(student, call_with(rec.kwargs), xs, ys, **options)
        if log:
            log(f"layer {layer}: error {result.error_before:.4f} -> {result.error_after:.4f} "
                f"({result.steps_run} steps, best {result.best_step}, {result.seconds:.1f}s)")
        results.append(result)
    return results
