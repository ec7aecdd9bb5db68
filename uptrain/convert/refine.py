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
one `lr` suits weights of any scale. Stopping: the error on a held-out slice of the sequences is
measured every `eval_every` steps; the best held-out state is kept, and training stops after
`patience` measurements without an improvement. A start that is already exact (held-out error
below `atol`) is returned unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from uptrain.convert.choices import REFINE_INPUTS

# the call that runs an attention module on calibration sequence i: (module, x [T, D], i) -> [T, D]
AttentionCall = Callable[[nn.Module, Tensor, int], Tensor]

# defaults chosen by measurement on stories260K-mha8 -> 2 and 1 K/V heads (results/refine.md)
STEPS = 1200  # a cap: the held-out rule stopped 2 of 5 stories260K MQA layers at 840 and 1080
LR = 1e-2
BATCH = 4
HOLDOUT = 0.125
PATIENCE = 4
EVAL_EVERY = 20
MIN_DELTA = 1e-3  # relative improvement of the held-out error that counts as one
ATOL = 1e-7  # held-out relative error treated as exact (float32 rounding is ~1e-12 of the power)


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

    def as_dict(self) -> dict[str, float | int | bool]:
        return dict(self.__dict__)


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


def _param_groups(student: nn.Module, lr: float) -> list[dict]:
    """One Adam group per parameter, lr scaled by the RMS of its start value (biases: their weight's)."""
    named = dict(student.named_parameters())
    groups = []
    for name, p in named.items():
        ref = named.get(name[: -len("bias")] + "weight", p) if name.endswith("bias") else p
        scale = ref.detach().float().pow(2).mean().sqrt().item()
        groups.append({"params": [p], "lr": lr * (scale if scale > 0 else 1.0)})
    return groups


def refine_attention(student: nn.Module, call: AttentionCall, inputs: Sequence[Tensor], targets: Sequence[Tensor],
                     *, steps: int = STEPS, lr: float = LR, batch: int = BATCH, holdout_fraction: float = HOLDOUT,
                     patience: int = PATIENCE, eval_every: int = EVAL_EVERY, seed: int = 0,
                     min_delta: float = MIN_DELTA, atol: float = ATOL) -> RefineResult:
    """Tune `student`'s parameters in place so that call(student, inputs[i], i) ≈ targets[i].

    inputs[i]: [T_i, D] attention-module input of calibration sequence i (after the layer's input
    norm); targets[i]: [T_i, D_out] the original attention module's output on it. Both on the
    student's device. At least 2 sequences (one is held out). Returns the errors before and after.
    """
    n = len(inputs)
    if n != len(targets) or n < 2:
        raise ValueError(f"refine needs at least 2 (input, target) sequence pairs, got {n} inputs and {len(targets)} targets")
    if steps < 0 or lr <= 0 or batch < 1 or not 0 < holdout_fraction < 1:
        raise ValueError("refine needs steps >= 0, lr > 0, batch >= 1 and 0 < holdout_fraction < 1")
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=gen).tolist()
    n_hold = min(n - 1, max(1, round(n * holdout_fraction)))
    held, train = order[:n_hold], order[n_hold:]
    was_training = student.training
    student.eval()  # no dropout: the target is the deterministic original output
    params = dict(student.named_parameters())
    before_h = relative_error(student, call, inputs, targets, held)
    before_t = relative_error(student, call, inputs, targets, train)
    best, best_step, bad, stopped, step = before_h, 0, 0, False, 0
    best_state = {k: p.detach().clone() for k, p in params.items()}
    if before_h > atol and steps > 0:
        opt = torch.optim.Adam(_param_groups(student, lr))
        queue: list[int] = []
        for step in range(1, steps + 1):
            if len(queue) < batch:  # epochs over the training sequences, each in a fresh order
                queue += [train[j] for j in torch.randperm(len(train), generator=gen).tolist()]
            idx, queue = queue[:batch], queue[batch:]
            power = sum(targets[i].float().pow(2).sum() for i in idx).clamp_min(1e-30)
            opt.zero_grad(set_to_none=True)
            for i in idx:  # one backward per sequence: lengths differ, nothing is padded
                ((call(student, inputs[i], i).float() - targets[i].float()).pow(2).sum() / power).backward()
            opt.step()
            if step % eval_every == 0 or step == steps:
                err = relative_error(student, call, inputs, targets, held)
                if err < best - max(min_delta * best, atol):
                    best, best_step, bad = err, step, 0
                    best_state = {k: p.detach().clone() for k, p in params.items()}
                else:
                    bad += 1
                    if bad >= patience:
                        stopped = step < steps
                        break
    with torch.no_grad():
        for k, p in params.items():
            p.copy_(best_state[k])
    after_t = relative_error(student, call, inputs, targets, train)
    student.train(was_training)
    return RefineResult(before_h, best, before_t, after_t, step, best_step, stopped,
                        round(time.perf_counter() - start, 3))


# ------------------------------------------------------------------ whole models in memory

def attention_modules(model: nn.Module) -> list[nn.Module]:
    """The attention module of each decoder layer, in layer order: the modules the registry names for
    the model's type (`Attention.module`: `self_attn`, `attn`, ...) directly under a numbered layer."""
    import re

    from uptrain.convert.architectures import attention_for

    model_type = getattr(getattr(model, "config", None), "model_type", None)
    attention = attention_for(model_type) if model_type else None
    if attention is None:
        raise ValueError(f"model type {model_type!r} is not in the registry (uptrain/convert/architectures.py)")
    pattern = re.compile(rf"(?:^|\.)(\d+)\.{re.escape(attention.module)}$")
    found = {int(m[1]): mod for name, mod in model.named_modules() if (m := pattern.search(name))}
    if not found or sorted(found) != list(range(len(found))):
        raise ValueError(f"found no numbered decoder layers holding a `{attention.module}` module in the model")
    return [found[i] for i in range(len(found))]


@dataclass
class Captured:
    """What one attention module saw and gave on each calibration sequence (batch dim dropped)."""

    inputs: list[Tensor]  # [T_i, D] hidden_states after the layer's input norm
    outputs: list[Tensor]  # [T_i, D] attention output (before the residual add)
    kwargs: list[dict]  # the rest of its call: position_embeddings, attention_mask, position_ids, ...


@torch.no_grad()
def capture(model: nn.Module, sequences: Sequence[Tensor], layers: Sequence[int] | None = None) -> dict[int, Captured]:
    """Run `model` on each token sequence ([T] ids) and record the attention modules of `layers` (all: None)."""
    mods = attention_modules(model)
    wanted = range(len(mods)) if layers is None else layers
    out = {i: Captured([], [], []) for i in wanted}

    def hook(rec: Captured):
        def record(_module, args, kwargs, output):
            x = kwargs.get("hidden_states", args[0] if args else None)
            rec.inputs.append(x[0].detach())
            rec.outputs.append((output[0] if isinstance(output, tuple) else output)[0].detach())
            rec.kwargs.append({k: v for k, v in kwargs.items()
                               if k not in ("hidden_states", "cache", "past_key_values", "past_key_value")})
        return record
    handles = [mods[i].register_forward_hook(hook(out[i]), with_kwargs=True) for i in wanted]
    device = next(model.parameters()).device
    try:
        for ids in sequences:
            model(input_ids=ids.reshape(1, -1).to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
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
