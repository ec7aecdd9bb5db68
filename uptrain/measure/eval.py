"""Loss (nats/token) and perplexity of causal LMs on a data source, in strided windows.

`python -m uptrain.eval MODEL [MODEL ...] --data FILE... | --dataset NAME ...`

Each document is tokenized with its model's own tokenizer (so models with different
vocabularies are each scored on their own tokens) and scored on its own. A document longer
than `max_length` is scored in windows that start every `stride` tokens, each window scoring
only the tokens no earlier window scored (the Hugging Face perplexity recipe), so every token
but the first of a document is scored exactly once, with up to `max_length - 1` tokens of context.
The reported loss is the token-weighted mean over all scored tokens; perplexity = exp(loss).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from uptrain.cli import ArgParser, format_table, positive_int, prog_name, write_json
from uptrain.data.source import TEXT_UNITS, DataSource  # standard library only: no `datasets` for bench
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.threads import add_threads_arg, announce_threads, start_threads
from uptrain.measure.models import LOAD_DTYPES, load_model, require_model_folder  # noqa: F401 (public here too)


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


# ---------------------------------------------------------------- pure computation


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


@torch.no_grad()
def sequence_nll(model: torch.nn.Module, input_ids: torch.Tensor, max_length: int, stride: int) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and number of scored tokens of one sequence.

    `input_ids`: LongTensor [seq] or [1, seq]. Scored in windows of `window_spans`; the logits
    `[1, window, vocab]` are taken in at least float32 for the log-softmax.
    """
    ids = input_ids.reshape(-1).to(model.device)
    total, count = 0.0, 0
    for begin, end, first in window_spans(ids.numel(), max_length, stride):
        window = ids[begin:end].unsqueeze(0)  # [1, w]
        logits = model(input_ids=window, use_cache=False).logits[0]  # [w, vocab]
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16/fp16 -> fp32
        # logits at window position i predict token i + 1; score targets [first, end).
        pred = logits[first - begin - 1 : end - begin - 1]  # [n_scored, vocab]
        targets = ids[first:end]  # [n_scored]
        total += F.cross_entropy(pred, targets, reduction="sum").item()
        count += targets.numel()
    return total, count


def evaluate(
    model: torch.nn.Module,
    token_sequences: Iterable[torch.Tensor],
    max_length: int,
    stride: int,
    name: str = "model",
) -> EvalResult:
    """Token-weighted mean loss and perplexity of `model` over `token_sequences` (each [seq])."""
    total, count, docs = 0.0, 0, 0
    for ids in token_sequences:
        nll, n = sequence_nll(model, ids, max_length, stride)
        total, count, docs = total + nll, count + n, docs + 1
    if count == 0:
        raise UsageError("no tokens to score: the data is empty or every document is one token long")
    loss = total / count
    return EvalResult(model=name, loss=loss, perplexity=math.exp(loss), tokens=count, documents=docs,
                      threads=torch.get_num_threads())


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
        return read_documents(source_from_args(args), args.max_documents)
    except UsageError as err:
        raise UsageError(str(err).replace("local files (data.train.files / data.val.files)",
                                          "local files (--data FILE...)")) from None


def evaluate_paths(paths: Sequence[str], texts: Sequence[str], max_length: int, stride: int,
                   dtype: str = "auto", device: str = "cpu") -> list[EvalResult]:
    """Evaluate each model folder on `texts`, each with its own tokenizer; a line on stderr as each
    model starts and ends (scoring a large text takes minutes: never silent that long)."""
    import time

    results = []
    for k, path in enumerate(paths, 1):
        began = time.monotonic()
        print(f"scoring model {k}/{len(paths)}: {path} on {len(texts):,} documents ...", file=sys.stderr, flush=True)
        model, tokenizer = load_model(path, dtype, device)
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        if limit and max_length > limit:
            raise UsageError(f"{path}: --max-length {max_length} exceeds its max_position_embeddings {limit}")
        results.append(evaluate(model, tokenize_texts(tokenizer, texts), max_length, stride, name=path))
        print(f"  done in {time.monotonic() - began:.1f} s: loss {results[-1].loss:.4f}", file=sys.stderr, flush=True)
    return results


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
    """CLI: evaluate each MODEL on the data and print loss and perplexity."""
    parser = ArgParser(prog=prog_name("uptrain.eval"), description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+", metavar="MODEL", help="local model folders")
    add_data_args(parser)
    parser.add_argument("--dtype", default="auto", choices=sorted(LOAD_DTYPES), help="weights dtype; auto: as saved")
    parser.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda")
    parser.add_argument("--json", metavar="PATH", help="also write results as JSON (- for stdout)")
    add_threads_arg(parser)
    from uptrain.measure import tasks as lm_tasks  # standard library only until --tasks is given

    lm_tasks.add_task_args(parser)
    args = parser.parse_args(argv)
    start_threads(args.threads)
    task_names, manager = lm_tasks.tasks_from_args(args)  # refuse bad --tasks before any scoring
    max_length, stride = window_args(args, args.models)
    with_data = not task_names or args.data or args.dataset  # with --tasks, perplexity only where data is named
    texts = read_cli_documents(args) if with_data else None
    announce_threads()
    out = sys.stderr if args.json == "-" else sys.stdout
    records: list[dict] = [{"model": m} for m in args.models]
    if texts is not None:
        results = evaluate_paths(args.models, texts, max_length, stride, args.dtype, args.device)
        rows = [(r.model, f"{r.loss:.4f}", f"{r.perplexity:.3f}", r.tokens, r.documents) for r in results]
        print(f"max_length {max_length}, stride {stride}", file=out)
        print(format_table(["model", "loss (nats/token)", "perplexity", "tokens", "documents"], rows), file=out)
        records = [asdict(r) | {"max_length": max_length, "stride": stride} for r in results]
    if task_names:
        scores = lm_tasks.score_paths(args.models, task_names, manager, max_length, args.task_limit,
                                      args.dtype, args.device)
        lm_tasks.print_task_scores(args, args.models, scores, max_length, out)
        records = [r | {"tasks": lm_tasks.scores_json(s)} for r, s in zip(records, scores)]
    if args.json:
        write_json(records, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
