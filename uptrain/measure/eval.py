"""Loss (nats/token) and perplexity of causal LMs on a data source, in strided windows.

`python -m uptrain.eval MODEL [MODEL ...] --data FILE... | --dataset NAME ...`

Each document is tokenized with its model's own tokenizer (so models with different
vocabularies are each scored on their own tokens) and scored on its own. A document longer
than `max_length` is scored in windows that start every `stride` tokens, each window scoring
only the tokens no earlier window scored (the Hugging Face perplexity recipe), so every token
but the first of a document is scored exactly once, with up to `max_length - 1` tokens of context.
The reported loss is the token-weighted mean over all scored tokens; perplexity = exp(loss).
With `--reference SOURCE`, also each model's fidelity to the source over the same tokens (KL, top-1 and
greedy agreement: uptrain.measure.fidelity).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TextIO

import torch
import torch.nn.functional as F

from uptrain.cli import ArgParser, format_table, positive_int, prog_name, write_json
from uptrain.data.source import TEXT_UNITS, DataSource  # standard library only: no `datasets` for bench
from uptrain.measure.copy_probe import PASSAGES, copy_against, copy_warning, probe_model
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.threads import add_threads_arg, announce_threads, start_threads
from uptrain.measure.kv_cache import (DEFAULT, FORMATS, KVFormat, active, add_kv_cache_arg, check_paths, kv_format,
                                      model_bytes_per_token)
from uptrain.measure.models import LOAD_DTYPES, load_model, require_model_folder  # noqa: F401 (public here too)

# the window rule and the one window scoring live beside the fidelity to a source, which needs them and
# imports nothing from here; importable from here as before
from uptrain.measure.fidelity import (  # noqa: F401 (scored_window, window_spans: public here too)
    FIDELITY_COLUMNS, GreedySettings, Reference, add_fidelity_args, check_vocabulary, fidelity_cells, fidelity_note,
    fidelity_warnings, greedy_from_args, greedy_prompts, scored_window, window_spans)


# what --dtype accepts when loading a model: the shared table plus "auto" (as saved)


@dataclass
class EvalResult:
    """Loss of one model on one data source."""

    model: str
    loss: float  # mean negative log-likelihood, nats per scored token
    perplexity: float
    tokens: int  # number of scored tokens
    documents: int
    threads: int = 1  # torch CPU threads it ran with
    kv_cache: str = "model"  # the K/V cache format it was scored with (uptrain.measure.kv_cache)
    kv_bytes_per_token: float | None = None  # KV bytes one token costs in that format, block scales counted
    # against a reference (--reference; uptrain.measure.fidelity), over the same scored tokens; else None
    reference: str | None = None  # the reference (source) model folder
    source_loss: float | None = None  # the reference's loss on the same tokens
    vocab_size: int | None = None  # the shared vocabulary (chance loss = ln vocab_size)
    kl_to_source: float | None = None  # mean per-token KL(source || model), nats
    top1_agreement: float | None = None  # share of tokens with the source's argmax
    greedy_agreement: float | None = None  # share of greedy-continuation tokens equal to the source's
    greedy_prefix: float | None = None  # mean common-prefix length of the greedy continuations, tokens
    greedy_agreement_se: float | None = None  # its standard error over the prompts
    kl_doc_std: float | None = None  # spread of per-document mean KL (standard deviation)
    kl_doc_max: float | None = None  # the largest per-document mean KL
    loss_vs_source: float | None = None  # loss - source_loss, nats/token
    loss_vs_source_se: float | None = None  # its standard error, clustered by document
    greedy_prompts: int | None = None  # prompts the greedy agreement was measured on
    prompt_tokens: int | None = None
    continuation_tokens: int | None = None
    # the copy probe (uptrain.measure.copy_probe: a passage seen again at distances up to the window)
    copy_first_loss: float | None = None  # loss on a passage's first occurrence, nats/token
    copy_second_loss: float | None = None  # on its second, where the model can copy it
    copy_gain: float | None = None  # first - second
    copy_top1: float | None = None  # share of second-occurrence tokens predicted exactly
    copy_first_top1: float | None = None
    copy_passage: int | None = None  # tokens per passage
    copy_passages: int | None = None  # passages per distance
    copy_distances: list[int] | None = None  # tokens between the two occurrences
    copy_by_distance: dict | None = None  # per distance: first_loss, second_loss, top1, first_top1
    copy_gain_kept: float | None = None  # with a reference: copy_gain / the source's
    source_copy_top1: float | None = None
    source_copy_gain: float | None = None


# ---------------------------------------------------------------- pure computation


@torch.no_grad()
def sequence_nll(model: torch.nn.Module, input_ids: torch.Tensor, max_length: int, stride: int,
                 tick: Callable[[int], None] | None = None, kv: KVFormat | None = None) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and number of scored tokens of one sequence.

    `input_ids`: LongTensor [seq] or [1, seq]. Scored in windows of `window_spans`; the logits
    `[1, window, vocab]` are taken in at least float32 for the log-softmax. tick(n): called with
    each window's scored tokens (`ScoringProgress`). kv: the cache format it runs with (`kv_cache`).
    """
    ids = input_ids.reshape(-1).to(model.device)
    total, count = 0.0, 0
    for span in window_spans(ids.numel(), max_length, stride):
        pred, targets = scored_window(model, ids, span, kv)  # [n_scored, vocab], [n_scored]
        total += F.cross_entropy(pred, targets, reduction="sum").item()
        count += targets.numel()
        if tick is not None:
            tick(targets.numel())
    return total, count


class ScoringProgress:
    """Never silent while a model is scored (minutes on a long text): `tick(n)` after each window of n
    scored tokens writes a line to stderr once UPTRAIN_PROGRESS_EVERY (10) s have passed since the last:
    tokens scored of all, seconds, time left at the pace so far."""

    def __init__(self, label: str, total_tokens: int):
        from uptrain.convert.progress import progress_every

        self.label, self.total, self.every = label, total_tokens, progress_every()
        self.began = self.last = time.monotonic()
        self.done = 0

    def __call__(self, tokens: int) -> None:
        self.done += tokens
        now = time.monotonic()
        if now - self.last < self.every or self.done >= self.total:
            return
        left = (now - self.began) / self.done * (self.total - self.done)
        print(f"  {self.label}: {self.done:,} of {self.total:,} tokens scored in {now - self.began:.0f} s, "
              f"~{left:.0f} s left", file=sys.stderr, flush=True)
        self.last = now


def evaluate(
    model: torch.nn.Module,
    token_sequences: Iterable[torch.Tensor],
    max_length: int,
    stride: int,
    name: str = "model",
    tick: Callable[[int], None] | None = None,
    kv: KVFormat | None = None,
) -> EvalResult:
    """Token-weighted mean loss and perplexity of `model` over `token_sequences` (each [seq]), its K/V
    cache stored as `kv` (None: the model's own dtype)."""
    total, count, docs = 0.0, 0, 0
    for ids in token_sequences:
        nll, n = sequence_nll(model, ids, max_length, stride, tick, kv)
        total, count, docs = total + nll, count + n, docs + 1
    if count == 0:
        raise UsageError("no tokens to score: the data is empty or every document is one token long")
    loss = total / count
    fmt = kv or FORMATS[DEFAULT]
    return EvalResult(model=name, loss=loss, perplexity=math.exp(loss), tokens=count, documents=docs,
                      threads=torch.get_num_threads(), kv_cache=fmt.name,
                      kv_bytes_per_token=model_bytes_per_token(fmt, model))


# ---------------------------------------------------------------- I/O


def tokenize_texts(tokenizer, texts: Iterable[str]) -> Iterable[torch.Tensor]:
    """Yield LongTensor [seq] per text, with the tokenizer's special tokens (e.g. BOS)."""
    for text in texts:
        yield torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)


def source_from_args(args: argparse.Namespace) -> DataSource:
    """The DataSource named by the data arguments of `add_data_args` (read it with `read_cli_documents`)."""
    if bool(args.data) == bool(args.dataset):
        raise UsageError("give the text to score as --data FILE... (local files) or --dataset NAME (a Hub "
                         "dataset), one of the two")
    return DataSource(
        dataset=args.dataset, config=args.dataset_config, split=args.split,
        files=list(args.data or []), text_field=args.text_field, text_unit=args.text_unit,
    )


def read_cli_documents(args: argparse.Namespace) -> list[str]:
    """The documents of the data arguments; errors name these options, not the trainer's config keys."""
    from uptrain.data import read_documents

    try:
        return read_documents(source_from_args(args), args.max_documents, field_option="--text-field")
    except UsageError as err:
        raise UsageError(str(err).replace("local files (data.train.files / data.val.files)",
                                          "local files (--data FILE...)")) from None


def _check_context(model: torch.nn.Module, path: str, max_length: int) -> None:
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if limit and max_length > limit:
        raise UsageError(f"{path}: --max-length {max_length} exceeds its max_position_embeddings {limit}")


def load_reference(reference: str, paths: Sequence[str], texts: Sequence[str], max_length: int,
                   dtype: str = "auto", device: str = "cpu", greedy: GreedySettings | None = None) -> Reference:
    """The source, loaded once after checking every model shares its vocabulary, with its greedy
    continuations; `greedy` None: the defaults shrunk to fit the window, else exactly these (refused
    when prompt + continuation exceed `max_length`)."""
    settings = (greedy or GreedySettings()).within(max_length, explicit=greedy is not None)
    check_vocabulary(paths, reference, texts[0] if texts else None)
    print(f"reference {reference}: fidelity over the scored tokens; greedy agreement over up to {settings.prompts} "
          f"prompts of {settings.prompt_tokens} tokens, each continued {settings.continuation_tokens} tokens",
          file=sys.stderr, flush=True)
    model, tokenizer = load_model(reference, dtype, device)
    _check_context(model, reference, max_length)
    prompts = greedy_prompts(tokenize_texts(tokenizer, texts), settings)  # [B, P]
    return Reference(reference, model, tokenizer, prompts, settings)


def evaluate_against(model: torch.nn.Module, reference: Reference, token_sequences: Iterable[torch.Tensor],
                     max_length: int, stride: int, name: str = "model",
                     tick: Callable[[int], None] | None = None, kv: KVFormat | None = None) -> EvalResult:
    """`evaluate`'s result, its loss from the same logits (bitwise the same number), with the
    fidelity to `reference` (as saved) filled in (uptrain.measure.fidelity); `kv`: the model's cache format."""
    docs, fid = reference.score(model, token_sequences, max_length, stride, tick, kv)
    total, count = 0.0, 0
    for d in docs:  # summed in evaluate's order
        total, count = total + d.nll, count + d.tokens
    loss = total / count
    fmt = kv or FORMATS[DEFAULT]
    return EvalResult(model=name, loss=loss, perplexity=math.exp(loss), tokens=count, documents=len(docs),
                      threads=torch.get_num_threads(), kv_cache=fmt.name,
                      kv_bytes_per_token=model_bytes_per_token(fmt, model), reference=reference.path,
                      vocab_size=reference.model.config.get_text_config().vocab_size, **fid.result_fields())


def evaluate_paths(paths: Sequence[str], texts: Sequence[str], max_length: int, stride: int,
                   dtype: str = "auto", device: str = "cpu", reference: str | None = None,
                   greedy: GreedySettings | None = None, kv_cache: str = DEFAULT,
                   copy_passages: int = PASSAGES) -> list[EvalResult]:
    """Evaluate each model folder on `texts`, each with its own tokenizer; a line on stderr as each
    model starts and ends, and while it is scored at most every ~10 s (`ScoringProgress`: scoring a
    large text takes minutes: never silent that long).

    `reference`: a source folder every model is also measured against (uptrain.measure.fidelity),
    loaded once; a path that is the reference's uses the same model object (KL exactly 0). `greedy`:
    the greedy-agreement settings (None: the defaults, 16 prompts of 32 tokens, 32 continued, shrunk
    to fit the window). The loss is the same number with and without a reference. `kv_cache`: every
    model's K/V cache stored in that format (`uptrain.measure.kv_cache`; refused before anything loads
    when a model cannot take it), the reference's as saved. `copy_passages`: passages per distance of the
    copy probe (`uptrain.measure.copy_probe`; 0: none).
    """
    fmt = kv_format(kv_cache)
    check_paths(fmt, paths)
    ref = None if reference is None else load_reference(reference, paths, texts, max_length, dtype, device, greedy)
    ref_copy = None if ref is None or not copy_passages else probe_model(
        ref.model, list(tokenize_texts(ref.tokenizer, texts)), max_length, copy_passages)
    results = []
    for k, path in enumerate(paths, 1):
        began = time.monotonic()
        print(f"scoring model {k}/{len(paths)}: {path} on {len(texts):,} documents ...", file=sys.stderr, flush=True)
        same = ref is not None and ref.is_path(path)
        model, tokenizer = (ref.model, ref.tokenizer) if same else load_model(path, dtype, device)
        _check_context(model, path, max_length)
        docs = list(tokenize_texts(tokenizer, texts))
        tick = ScoringProgress(f"model {k}/{len(paths)}", sum(max(int(d.numel()) - 1, 0) for d in docs))
        results.append(evaluate(model, docs, max_length, stride, name=path, tick=tick, kv=active(fmt)) if ref is None
                       else evaluate_against(model, ref, docs, max_length, stride, name=path, tick=tick, kv=active(fmt)))
        if copy_passages:
            results[-1] = with_copy(results[-1], probe_model(model, docs, max_length, copy_passages, active(fmt)),
                                    ref_copy)
        kl = "" if ref is None else f", KL to source {results[-1].kl_to_source:.4f}"
        print(f"  done in {time.monotonic() - began:.1f} s: loss {results[-1].loss:.4f}{kl}", file=sys.stderr,
              flush=True)
    return results


def with_copy(result: EvalResult, probe: dict | None, source: dict | None) -> EvalResult:
    """`result` with the copy probe's fields (and, beside a source's probe, the share of its gain kept)."""
    if probe is None:
        return result
    return replace(result, **probe, **(copy_against(probe, source) if source is not None else {}))


def print_fidelity_warnings(results: Sequence[EvalResult], source_result: EvalResult | None = None,
                            vocab_size: int | None = None, out: TextIO | None = None) -> list[str]:
    """Print (to `out`, default stdout) and return `fidelity_warnings` for results scored against a
    reference: a source near chance on the text, a model beating its source beyond the noise. The
    source's loss is `source_result.loss`, else the results' `source_loss`; the vocabulary theirs
    unless given. Results without fidelity fields are left out (none: no warnings)."""
    scored = [r for r in results if r.loss_vs_source is not None]
    if not scored:
        return []
    source_loss = source_result.loss if source_result is not None else scored[0].source_loss
    lines = fidelity_warnings(source_loss, vocab_size or scored[0].vocab_size,
                              [(r.model, r.loss, r.loss_vs_source, r.loss_vs_source_se) for r in scored])
    for line in lines:
        print(line, file=out or sys.stdout)
    return lines


def fidelity_records(results: Sequence[EvalResult]) -> list[list[str] | None]:
    """Per result, the warnings about it (the source near chance, it beating its source): the JSON's
    `warnings` list of each record; None for a result not scored against a reference."""
    return [None if r.loss_vs_source is None else
            fidelity_warnings(r.source_loss, r.vocab_size, [(r.model, r.loss, r.loss_vs_source, r.loss_vs_source_se)])
            for r in results]


def add_data_args(parser: argparse.ArgumentParser) -> None:
    """Data-source and windowing arguments shared by eval and compare."""
    g = parser.add_argument_group("data")
    g.add_argument("--data", nargs="+", metavar="FILE", help="local .txt/.jsonl/.json/.parquet files")
    g.add_argument("--dataset", help="a Hub dataset name (instead of --data)")
    g.add_argument("--dataset-config", default=None)
    g.add_argument("--split", default="validation", help="split of a Hub dataset (default: validation)")
    g.add_argument("--text-field", default="text", help="column holding the text (default: text)")
    g.add_argument("--text-unit", default=DataSource.text_unit, choices=list(TEXT_UNITS),
                   help="what one document of a .txt file is: a line, a paragraph (documents separated by "
                        "a blank line; default) or the whole file")
    g.add_argument("--max-documents", type=positive_int, default=None, help="score only the first N documents")
    g.add_argument("--max-length", type=positive_int, default=None,
                   help="window length in tokens (default: the model's max_position_embeddings, at most 2048)")
    g.add_argument("--stride", type=positive_int, default=None, help="window step, < max-length (default: max-length / 2)")


def window_args(args: argparse.Namespace, model_paths: Sequence[str]) -> tuple[int, int]:
    """(max_length, stride) from the arguments (`model_windows`)."""
    return model_windows(model_paths, args.max_length, args.stride)


def model_windows(model_paths: Sequence[str], max_length: int | None = None,
                  stride: int | None = None) -> tuple[int, int]:
    """(max_length, stride) of a scoring: the window defaults to the smallest model context (at most
    2048), the stride to half of it; a max_length beyond a model's context is refused here, before
    any model loads. The one rule: uptrain.eval, compare and the demo score with it."""
    from transformers import AutoConfig

    for p in model_paths:
        require_model_folder(p)
    contexts = [getattr(AutoConfig.from_pretrained(p).get_text_config(), "max_position_embeddings", None)
                for p in model_paths]
    if max_length is None:
        max_length = min(2048, *(c or 2048 for c in contexts))
    for p, limit in zip(model_paths, contexts):
        if limit and max_length > limit:
            raise UsageError(f"{p}: --max-length {max_length} exceeds its max_position_embeddings {limit}")
    stride = stride or max(1, max_length // 2)
    window_spans(0, max_length, stride)  # validates the pair
    return max_length, stride


@exit_on_usage_error
def main(argv: Sequence[str] | None = None) -> int:
    """CLI: evaluate each MODEL on the data and print loss and perplexity (and fidelity, --reference)."""
    parser = ArgParser(prog=prog_name("uptrain.eval"), description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", metavar="MODEL", help="local model folders")
    add_data_args(parser)
    add_fidelity_args(parser)
    parser.add_argument("--copy-passages", type=int, default=PASSAGES, metavar="N",
                        help=f"the copy probe: N passages per distance read twice (default {PASSAGES}; 0: none); "
                             "docs/measure.md")
    parser.add_argument("--dtype", default="auto", choices=sorted(LOAD_DTYPES), help="weights dtype; auto: as saved")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda")
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON (- for stdout)")
    add_kv_cache_arg(parser)
    add_threads_arg(parser)
    from uptrain.measure import tasks as lm_tasks  # standard library only until --tasks is given

    lm_tasks.add_task_args(parser)
    args = parser.parse_args(argv)
    start_threads(args.threads)
    task_names, manager = lm_tasks.tasks_from_args(args)  # refuse bad --tasks before any scoring
    if args.reference is not None:
        require_model_folder(args.reference)
    check_paths(kv_format(args.kv_cache), args.models)  # a format a model cannot take: refused before any scoring
    max_length, stride = window_args(args, [*args.models, *([args.reference] if args.reference else [])])
    greedy = greedy_from_args(args, max_length, args.reference)
    with_data = not task_names or args.data or args.dataset  # with --tasks, perplexity only where data is named
    if args.reference is not None and not with_data:
        raise UsageError("--reference measures fidelity on the scoring text: give --data FILE... or --dataset NAME")
    texts = read_cli_documents(args) if with_data else None
    announce_threads()
    out = sys.stderr if args.json == "-" else sys.stdout
    records: list[dict] = [{"model": m} for m in args.models]
    if texts is not None:
        results = evaluate_paths(args.models, texts, max_length, stride, args.dtype, args.device,
                                 args.reference, greedy, args.kv_cache, max(0, args.copy_passages))
        _print_results(results, max_length, stride, out)
        records = [asdict(r) | {"max_length": max_length, "stride": stride} for r in results]
        if args.reference is not None:  # per record: the warnings about it (the source near chance, it beating it)
            records = [r | {"warnings": w} for r, w in zip(records, fidelity_records(results))]
        records = [r | _calibration_overlap(r, texts, out) for r in records]
        records = [r | ({"warnings": [*(r.get("warnings") or []), w]} if (w := copy_warning(r["model"], r)) else {})
                   for r in records]
    if task_names:
        scores = lm_tasks.score_paths(args.models, task_names, manager, max_length, args.task_limit,
                                      args.dtype, args.device)
        lm_tasks.print_task_scores(args, args.models, scores, max_length, out)
        records = [r | {"tasks": lm_tasks.scores_json(s)} for r, s in zip(records, scores)]
    if args.json:
        write_json(records, args.json)
    return 0


def _calibration_overlap(record: dict, texts: list[str], out: TextIO) -> dict:
    """A record's `warnings` with the overlap of the scored documents and the model's calibration text
    (`uptrain.data.overlap`), printed; {} when there is none."""
    from uptrain.data.overlap import calibration_overlap_warning

    line = calibration_overlap_warning(Path(record["model"]), texts, "--data")
    if line is None:
        return {}
    print(line, file=out)
    return {"warnings": [*(record.get("warnings") or []), line]}


# What this loss is, beside the trainer's val_loss on the same text (they differ, and both say why).
SCORING = ("each document scored on its own in strided windows, every token with up to max_length tokens of its own "
           "document before it (the trainer's val loss packs documents end to end into seq_len blocks, where a "
           "token sees only the tokens of its block before it: a different, usually higher number)")


def _print_results(results: Sequence[EvalResult], max_length: int, stride: int, out: TextIO) -> None:
    """The loss table; with a reference, the fidelity columns beside the loss, what they are, the warnings."""
    note = fidelity_note(results)
    extra = FIDELITY_COLUMNS if note else []
    rows = [(r.model, f"{r.loss:.4f}", f"{r.perplexity:.3f}", *(fidelity_cells(r) if note else []), r.kv_cache,
             f"{r.kv_bytes_per_token:,.4g}", r.tokens, r.documents) for r in results]
    print(f"max_length {max_length}, stride {stride}: {SCORING}", file=out)
    print(format_table(["model", "loss (nats/token)", "perplexity", *extra, "KV cache", "KV B/token", "tokens",
                        "documents"], rows), file=out)
    if note:
        print(note, file=out)
        print_fidelity_warnings(results, out=out)
    for line in copy_lines(results):
        print(line, file=out)


def copy_lines(results: Sequence[EvalResult]) -> list[str]:
    """The copy probe's lines under the table (what it is, each model's figures, the warnings)."""
    probed = [r for r in results if r.copy_gain is not None]
    if not probed:
        return []
    r0 = probed[0]
    lines = [f"copy probe: {r0.copy_passages} passages of {r0.copy_passage} tokens seen again after "
             f"{'/'.join(map(str, r0.copy_distances))} tokens of other text (uptrain.measure.copy_probe; docs/measure.md)"]
    for r in probed:
        kept = "" if r.copy_gain_kept is None else f", {r.copy_gain_kept:.0%} of the source's gain kept"
        lines.append(f"  {r.model}: loss {r.copy_first_loss:.3f} -> {r.copy_second_loss:.3f} on the second reading "
                     f"(gain {r.copy_gain:.3f}), top-1 {r.copy_first_top1:.1%} -> {r.copy_top1:.1%}{kept}")
    return lines + [w for r in probed if (w := copy_warning(r.model, asdict(r)))]


if __name__ == "__main__":
    sys.exit(main())
