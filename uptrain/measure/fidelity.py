"""Fidelity of a model to its source: how close its next-token distributions stay, beside the loss.

Over exactly the tokens `uptrain.eval` averages the loss over (the same documents, `window_spans`
windows and positions), for a model against a reference (its source):
- `kl_to_source`: mean per-token KL(source || model), nats, from log_softmax of both in at least float32;
- `top1_agreement`: share of those tokens where the model's argmax is the source's;
- `loss_vs_source`: the model's loss minus the source's on the same tokens, with a standard error
  clustered by document (`loss_vs_source_se`), and `kl_doc_std`: the spread of per-document mean KL;
- `greedy_agreement`: share of greedy-continuation tokens equal, position by position, to the
  source's greedy continuation of the same prompts (the first `prompt_tokens` tokens of documents),
  and `greedy_prefix`: the mean length of their common prefix.
A loss near chance, or a model "beating" its source, says little on its own (`fidelity_warnings`).

Also the window rule both the loss and these numbers use (`window_spans`, `scored_window`; eval.py
re-exports them): eval.py imports this module, never the other way round.
"""

from __future__ import annotations

import argparse
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from uptrain.cli import positive_int
from uptrain.errors import UsageError  # imports nothing of measure: eval imports this module
from uptrain.measure.kv_cache import KVFormat, active, new_cache  # imports nothing of measure
from uptrain.units import NEAR_CHANCE  # noqa: F401 (a source loss >= 0.9 x ln(vocab) barely models the text)

BEATS_SOURCE_SE = 2.0  # a model below its source by more than 2 standard errors is not noise


@dataclass(frozen=True)
class GreedySettings:
    """Greedy-agreement prompts: the first `prompt_tokens` tokens of each document that has them, up
    to `prompts` prompts in document order, each continued `continuation_tokens` tokens (0 prompts: none)."""

    prompts: int = 16
    prompt_tokens: int = 32
    continuation_tokens: int = 32

    def within(self, max_length: int, explicit: bool) -> GreedySettings:
        """These settings if prompt + continuation fit the window; else the defaults shrunk to half a
        window each, or (`explicit`: the user chose them) a one-line refusal."""
        if self.prompt_tokens + self.continuation_tokens <= max_length:
            return self
        if explicit:
            raise UsageError(f"--prompt-tokens {self.prompt_tokens} + --continuation-tokens "
                             f"{self.continuation_tokens} exceed the window --max-length {max_length}: the "
                             f"greedy continuation must fit the model's scoring window; give smaller ones")
        half = max_length // 2
        return GreedySettings(self.prompts, max_length - half, half)


@dataclass
class FidelitySums:
    """Sums over scored tokens (a window, a document): the pieces of the means, summed in float64."""

    nll: float = 0.0  # the model's summed negative log-likelihood, as sequence_nll sums it
    ref_nll: float = 0.0  # the reference's, over the same tokens
    kl: float = 0.0  # summed per-token KL(reference || model), nats
    agree: int = 0  # tokens where both argmaxes are equal
    tokens: int = 0

    def __add__(self, o: FidelitySums) -> FidelitySums:
        return FidelitySums(self.nll + o.nll, self.ref_nll + o.ref_nll, self.kl + o.kl,
                            self.agree + o.agree, self.tokens + o.tokens)


@dataclass
class Fidelity:
    """A model against its reference over the scored tokens and the greedy prompts (None: not measured)."""

    kl_to_source: float  # mean per-token KL(source || model), nats
    top1_agreement: float  # share of scored tokens with the same argmax
    kl_doc_std: float  # standard deviation across documents of per-document mean KL (0 with one document)
    kl_doc_max: float  # the largest per-document mean KL
    loss_vs_source: float  # model loss - source loss on the same tokens, nats/token
    loss_vs_source_se: float | None  # its standard error, clustered by document (None under 2 documents)
    source_loss: float  # the reference's loss on the same tokens
    greedy_agreement: float | None  # share of continuation tokens equal to the source's, position by position
    greedy_prefix: float | None  # mean common-prefix length of the continuations, tokens
    greedy_agreement_se: float | None  # its standard error over the prompts (None under 2 prompts)
    prompts: int  # greedy prompts used
    prompt_tokens: int
    continuation_tokens: int
    tokens: int
    documents: int

    def result_fields(self) -> dict:
        """The fields an EvalResult carries (uptrain.measure.eval), under its names."""
        return dict(source_loss=self.source_loss, kl_to_source=self.kl_to_source, top1_agreement=self.top1_agreement,
                    greedy_agreement=self.greedy_agreement, greedy_prefix=self.greedy_prefix,
                    greedy_agreement_se=self.greedy_agreement_se, kl_doc_std=self.kl_doc_std, kl_doc_max=self.kl_doc_max, loss_vs_source=self.loss_vs_source,
                    loss_vs_source_se=self.loss_vs_source_se, greedy_prompts=self.prompts,
                    prompt_tokens=self.prompt_tokens, continuation_tokens=self.continuation_tokens)


# ---------------------------------------------------------------- windows: the loss's and fidelity's


def window_spans(n_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """Windows `(begin, end, first_scored)` over a sequence of `n_tokens` tokens.

    Window tokens are `[begin, end)`; the tokens scored in it are `[first_scored, end)`, each
    predicted from the window tokens before it. Over all windows, positions 1 .. n_tokens-1
    are scored exactly once (position 0 has no context).
    """
    if max_length < 2 or not 1 <= stride < max_length:
        raise UsageError(
            f"need max_length >= 2 and 1 <= stride < max_length, so that windows overlap and every "
            f"token is scored (got max_length {max_length}, stride {stride})"
        )
    spans: list[tuple[int, int, int]] = []
    prev_end = 0
    for begin in range(0, n_tokens if n_tokens > 1 else 0, stride):
        end = min(begin + max_length, n_tokens)
        spans.append((begin, end, max(prev_end, begin + 1)))  # stride < max_length: begin < prev_end
        prev_end = end
        if end == n_tokens:
            break
    return spans


def scored_window(model: torch.nn.Module, ids: torch.Tensor, span: tuple[int, int, int],
                  kv: KVFormat | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [n_scored, vocab] in at least float32, targets [n_scored]) of one `window_spans` span.

    `ids`: LongTensor [seq] on the model's device. The one place a window is run, so that the loss
    with and without a reference (uptrain.measure.fidelity) comes from the same numbers. `kv`: the
    window's keys and values stored in that cache format and read back (`uptrain.measure.kv_cache`);
    None or `model`: no cache, as saved.
    """
    begin, end, first = span
    window = ids[begin:end].unsqueeze(0)  # [1, w]
    cache = new_cache(kv, model.config)
    with_cache = {"use_cache": False} if cache is None else {"use_cache": True, _cache_argument(model): cache}
    logits = model(input_ids=window, **with_cache).logits[0]  # [w, vocab]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 -> fp32
    # logits at window position i predict token i + 1; score targets [first, end).
    return logits[first - begin - 1 : end - begin - 1], ids[first:end]


def window_fidelity(pred: torch.Tensor, ref_pred: torch.Tensor, targets: torch.Tensor) -> FidelitySums:
    """Sums of one window: `pred`, `ref_pred` logits [n, vocab] (model, reference), `targets` [n].

    The model's NLL is computed exactly as `sequence_nll` computes it, so the loss is the same with
    and without a reference. KL and argmax in at least float32.
    """
    nll = F.cross_entropy(pred, targets, reduction="sum").item()
    ref_nll = F.cross_entropy(ref_pred, targets, reduction="sum").item()
    dtype = torch.promote_types(torch.promote_types(pred.dtype, ref_pred.dtype), torch.float32)
    logp = F.log_softmax(pred.to(dtype), -1)  # [n, vocab]
    ref_logp = logp if ref_pred is pred else F.log_softmax(ref_pred.to(dtype), -1)  # [n, vocab]
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1)  # [n]: KL(ref || model) per token
    # KL >= 0; a tiny negative per-token sum is rounding of two near-equal distributions
    kl = kl.clamp_min(0).double().sum().item()
    agree = int((pred.argmax(-1) == ref_pred.argmax(-1)).sum().item())
    return FidelitySums(nll, ref_nll, kl, agree, targets.numel())


@torch.no_grad()
def sequence_fidelity(model: torch.nn.Module, reference: torch.nn.Module, ids: torch.Tensor,
                      max_length: int, stride: int, tick: Callable[[int], None] | None = None,
                      kv: KVFormat | None = None) -> FidelitySums:
    """Sums of one document (`ids`: LongTensor [seq] or [1, seq]) in `window_spans` windows, both
    models' logits one window at a time. `reference is model` with no cache format: its logits are
    reused (KL exactly 0). `kv`: the model's cache format; the reference runs as saved.
    tick(n): called with each window's scored tokens (a progress line: `eval.ScoringProgress`)."""
    ids = ids.reshape(-1).to(model.device)
    sums = FidelitySums()
    same = reference is model and active(kv) is None
    for span in window_spans(ids.numel(), max_length, stride):
        pred, targets = scored_window(model, ids, span, kv)  # [n, vocab], [n]
        ref_pred = pred if same else scored_window(reference, ids.to(reference.device), span)[0]
        sums = sums + window_fidelity(pred, ref_pred.to(pred.device), targets)
        if tick is not None:
            tick(targets.numel())
    return sums


def _cache_argument(model: torch.nn.Module) -> str:
    """The name this transformers gives the KV-cache argument: `cache` since 5.x, `past_key_values`
    before (still taken by 5.x, with a deprecation warning)."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.no_grad()
def greedy_continuation(model: torch.nn.Module, prompt_ids: torch.Tensor, n: int,
                        kv: KVFormat | None = None) -> torch.Tensor:
    """The `n` tokens greedy decoding appends to `prompt_ids` (LongTensor [P] or [B, P] of equal-length
    prompts, so no padding): [n] or [B, n], on the CPU. Explicit argmax with the KV cache (a model
    without one: the whole sequence again each step), never stopping at EOS; no `generate`, whose
    generation_config may sample or stop. `kv`: the cache stored in that format (`kv_cache`)."""
    batch = (prompt_ids.unsqueeze(0) if prompt_ids.dim() == 1 else prompt_ids).to(model.device)  # [B, P]
    out = torch.empty(batch.shape[0], n, dtype=torch.long)
    name, seq, cache = _cache_argument(model), batch, new_cache(kv, model.config)
    for t in range(n if batch.shape[0] else 0):  # no prompts: nothing to run
        step = model(input_ids=seq if t == 0 else seq[:, -1:], use_cache=True,
                     **({name: cache} if cache is not None else {}))
        nxt = step.logits[:, -1].argmax(-1)  # [B]: logits [B, t, vocab], the last position predicts
        out[:, t] = nxt.cpu()
        seq = torch.cat([seq, nxt[:, None]], 1)  # [B, P + t + 1]
        cache = getattr(step, "cache", None) or getattr(step, "past_key_values", None)
    return out[0] if prompt_ids.dim() == 1 else out


def greedy_prompts(token_sequences: Iterable[torch.Tensor], settings: GreedySettings) -> torch.Tensor:
    """LongTensor [prompts, prompt_tokens]: the first tokens of each long-enough document, in order."""
    rows = []
    for ids in token_sequences:
        if len(rows) >= settings.prompts:
            break
        if ids.numel() >= settings.prompt_tokens:
            rows.append(ids.reshape(-1)[: settings.prompt_tokens])
    return torch.stack(rows) if rows else torch.empty(0, settings.prompt_tokens, dtype=torch.long)


def greedy_scores(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float | None, float | None]:
    """(agreement, mean common-prefix length) of continuations [B, C] against the reference's."""
    if ours.numel() == 0:
        return None, None
    same = ours == ref  # [B, C]
    prefix = same.long().cumprod(-1).sum(-1)  # [B]: tokens before the first difference
    return int(same.sum()) / same.numel(), int(prefix.sum()) / prefix.numel()


def greedy_agreement_se(ours: torch.Tensor, ref: torch.Tensor) -> float | None:
    """The standard error of the greedy agreement of continuations [B, C], over the prompts: they are
    the independent units (within one continuation, tokens after a first difference rarely agree
    again, so tokens are far from independent). None under 2 prompts."""
    if ours.shape[0] < 2:
        return None
    per_prompt = (ours == ref).double().mean(-1)  # [B]
    return float(per_prompt.std(unbiased=True)) / math.sqrt(per_prompt.numel())


def greedy_cell(agreement: float | None, se: float | None) -> str:
    """'48.0% ± 9.1%' (± one standard error over the prompts), '-' when not measured."""
    if agreement is None:
        return "-"
    return f"{agreement:.1%}" + ("" if se is None else f" ± {se:.1%}")


def fidelity_from(docs: Sequence[FidelitySums], greedy: tuple[float | None, float | None],
                  settings: GreedySettings, prompts: int, greedy_se: float | None = None) -> Fidelity:
    """The means of per-document sums, the KL's spread over documents, and the paired loss difference
    with its standard error clustered by document (a ratio estimator: documents are the independent units)."""
    scored = [d for d in docs if d.tokens]
    total = sum(scored, FidelitySums())
    n = total.tokens
    doc_kl = [d.kl / d.tokens for d in scored]
    diff = [d.nll - d.ref_nll for d in scored]  # per document, nats
    mean = sum(diff) / n
    g = len(scored)
    se = (math.sqrt(g / (g - 1) * sum((dd - mean * d.tokens) ** 2 for dd, d in zip(diff, scored))) / n
          if g > 1 else None)
    return Fidelity(
        kl_to_source=total.kl / n, top1_agreement=total.agree / n,
        kl_doc_std=statistics.stdev(doc_kl) if g > 1 else 0.0, kl_doc_max=max(doc_kl),
        loss_vs_source=mean, loss_vs_source_se=se, source_loss=total.ref_nll / n,
        greedy_agreement=greedy[0], greedy_prefix=greedy[1], greedy_agreement_se=greedy_se, prompts=prompts,
        prompt_tokens=settings.prompt_tokens, continuation_tokens=settings.continuation_tokens,
        tokens=n, documents=len(docs),
    )


class Reference:
    """The source, loaded once, with its greedy continuations computed once for every model scored against it.

    `prompts`: LongTensor [B, P] (`greedy_prompts`, in the reference's tokens); `tokenizer` may be None.
    """

    def __init__(self, path: str, model: torch.nn.Module, tokenizer, prompts: torch.Tensor, settings: GreedySettings):
        self.path, self.model, self.tokenizer, self.settings = path, model, tokenizer, settings
        self.resolved = Path(path).resolve()
        self.prompts = prompts  # [B, P]
        self.continuations = greedy_continuation(model, prompts, settings.continuation_tokens)  # [B, C]

    def is_path(self, path: str) -> bool:
        return Path(path).resolve() == self.resolved

    def score(self, model: torch.nn.Module, token_sequences: Iterable[torch.Tensor], max_length: int,
              stride: int, tick: Callable[[int], None] | None = None,
              kv: KVFormat | None = None) -> tuple[list[FidelitySums], Fidelity]:
        """Per-document sums and the Fidelity of `model` (the reference itself as saved: KL 0, agreements
        1, exactly), its cache stored as `kv` (`kv_cache`; the reference's as saved)."""
        docs = [sequence_fidelity(model, self.model, ids, max_length, stride, tick, kv) for ids in token_sequences]
        if not any(d.tokens for d in docs):
            raise UsageError("no tokens to score: the data is empty or every document is one token long")
        ours = (self.continuations if model is self.model and active(kv) is None else
                greedy_continuation(model, self.prompts, self.settings.continuation_tokens, kv))
        return docs, fidelity_from(docs, greedy_scores(ours, self.continuations), self.settings, len(self.prompts),
                                   greedy_agreement_se(ours, self.continuations))


def check_vocabulary(paths: Sequence[str], reference: str, first_text: str | None) -> None:
    """One line (UsageError) unless every model shares the reference's vocabulary: the same vocab size
    and the same ids for the first document. Config and tokenizer only, before any weights load."""
    from transformers import AutoConfig, AutoTokenizer

    def facts(path: str) -> tuple[int, list[int] | None]:
        vocab = AutoConfig.from_pretrained(path).get_text_config().vocab_size
        ids = None if first_text is None else AutoTokenizer.from_pretrained(path)(first_text)["input_ids"]
        return vocab, ids

    ref_vocab, ref_ids = facts(reference)
    for path in paths:
        if Path(path).resolve() == Path(reference).resolve():
            continue
        vocab, ids = facts(path)
        why = (f"vocab sizes {vocab} and {ref_vocab}" if vocab != ref_vocab else
               "their tokenizers give different ids on the first document" if ids != ref_ids else None)
        if why:
            raise UsageError(f"{path} and the reference {reference} do not share a vocabulary ({why}): KL and "
                             f"agreement compare next-token distributions token by token; give as --reference "
                             f"the model's own source (same tokenizer), or leave --reference out")


FIDELITY_COLUMNS = ["KL to source", "top-1 agr.", "greedy agr.", "loss - source (± se)"]


def fidelity_cells(r) -> list[str]:
    """The FIDELITY_COLUMNS cells of an EvalResult scored against a reference ("-" where not measured)."""
    if r.kl_to_source is None:
        return ["-"] * len(FIDELITY_COLUMNS)
    greedy = greedy_cell(r.greedy_agreement, r.greedy_agreement_se)
    se = "" if r.loss_vs_source_se is None else f" ± {r.loss_vs_source_se:.4f}"
    return [f"{r.kl_to_source:.4f}", f"{r.top1_agreement:.1%}", greedy, f"{r.loss_vs_source:+.4f}{se}"]


def fidelity_note(results: Sequence) -> str | None:
    """The line under a table of EvalResults saying what the fidelity columns are measured on (None: no reference)."""
    r = next((r for r in results if r.kl_to_source is not None), None)
    if r is None:
        return None
    return (f"fidelity against {r.reference}: KL(source || model) nats/token and top-1 agreement over the "
            f"{r.tokens:,} scored tokens; greedy agreement over {r.greedy_prompts} prompts (the first "
            f"{r.prompt_tokens} tokens of each document that has them) each continued {r.continuation_tokens} tokens, "
            f"{GREEDY_SE_NOTE}")


# Said wherever greedy agreement is shown with its ± (eval, compare, the sweep, the demo).
GREEDY_SE_NOTE = ("± one standard error over the prompts (two models' greedy agreements closer than about twice "
                  "it are within noise: more prompts with --greedy-prompts narrow it)")


def add_fidelity_args(parser: argparse.ArgumentParser, reference: bool = True) -> None:
    """--reference (eval; compare's source is the reference) and the greedy-agreement settings."""
    g = parser.add_argument_group("fidelity to a source")
    if reference:
        g.add_argument("--reference", metavar="SOURCE", help="also measure every model against this source "
                       "folder (same tokenizer): KL to source, top-1 and greedy agreement, loss - source")
    d = GreedySettings()
    g.add_argument("--greedy-prompts", type=positive_int, default=None, metavar="N",
                   help=f"greedy agreement over the first N documents that have --prompt-tokens tokens "
                        f"(default {d.prompts})")
    g.add_argument("--prompt-tokens", type=positive_int, default=None, metavar="P",
                   help=f"prompt length: a document's first P tokens (default {d.prompt_tokens})")
    g.add_argument("--continuation-tokens", type=positive_int, default=None, metavar="C",
                   help=f"greedy tokens compared per prompt (default {d.continuation_tokens}; "
                        f"P + C within --max-length)")


def greedy_from_args(args: argparse.Namespace, max_length: int, reference: str | None) -> GreedySettings:
    """The greedy settings of the arguments: prompt and continuation lengths given are refused when they
    do not fit the window, the defaults shrunk to fit; greedy options without a reference are refused."""
    given = {k: v for k, v in (("prompts", args.greedy_prompts), ("prompt_tokens", args.prompt_tokens),
                               ("continuation_tokens", args.continuation_tokens)) if v is not None}
    if given and reference is None:
        raise UsageError("--greedy-prompts, --prompt-tokens and --continuation-tokens measure agreement with a "
                         "source: give --reference SOURCE too")
    explicit = "prompt_tokens" in given or "continuation_tokens" in given
    return GreedySettings(**given).within(max_length, explicit)


def fidelity_warnings(source_loss: float, vocab_size: int,
                      rows: Sequence[tuple[str, float, float | None, float | None]]) -> list[str]:
    """One-line warnings on a scoring against a source; `rows`: (name, loss, loss_vs_source, its se).

    (a) The source's loss >= NEAR_CHANCE x ln(vocab_size) (uniform guessing): the source barely models
    the text, so loss differences between models there are mostly noise. (b) A model whose loss is
    below its source's by more than BEATS_SOURCE_SE standard errors (none without an se). Both point at
    the KL to the source, which measures what a conversion keeps whatever the text.
    """
    out = []
    chance = math.log(vocab_size)
    if source_loss >= NEAR_CHANCE * chance:
        out.append(f"warning: the source's loss on this text, {source_loss:.3f} nats/token, is "
                   f"{source_loss / chance:.0%} of chance (ln {vocab_size} = {chance:.3f}, uniform guessing; "
                   f"warned from {NEAR_CHANCE:.0%}): the source barely models this text, so the losses here say "
                   f"little about how close a model is to it; fidelity (KL to the source) is what shows that; or "
                   f"score on text like the source's own")
    for name, loss, diff, se in rows:
        if diff is not None and se is not None and diff < -BEATS_SOURCE_SE * se:
            times = f"{-diff / se:.1f} standard errors" if se > 0 else "with no spread across documents"
            out.append(f"warning: {name} beats its source by {-diff:.4f} nats/token (loss {loss:.4f}, {times}, "
                       f"beyond {BEATS_SOURCE_SE:g}): a conversion rarely beats its source; it has moved away "
                       f"from it on this text, and fidelity (KL to the source) is what shows how far")
    return out
