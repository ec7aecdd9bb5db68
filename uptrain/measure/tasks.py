"""Downstream task scores through lm-evaluation-harness (the optional `uptrain[eval]` extra).

`uptrain.eval --tasks NAMES` and `uptrain.compare --tasks NAMES` call `run_tasks` on every model:
lm-eval's `simple_evaluate` on an `HFLM` wrapped around the model object already loaded, with
the bundled offline tasks (`task_data/`: stories_ppl, stories_cloze, stories_ending, stories_name,
built by `scripts/tools/make_tasks.py` from the held-out TinyStories sample), any `--tasks-path` folder
of task YAML, and (network permitting) every task lm-eval knows.

Generating tasks (`output_type: generate_until`, e.g. stories_name, scored by exact match) run on
the same HFLM as the log-likelihood ones: lm-eval batches the contexts with left padding, leaves
each `max_length - max_gen_toks` tokens (so a task should set `max_gen_toks` in its
`generation_kwargs`: lm-eval's default, 256, would cut a 512-token model's contexts to 255),
stops at the task's `until` strings or EOS and decodes with the tokenizer. Decoding is greedy
unless the task asks to sample: lm-eval passes `do_sample=False` to `generate` when the task's
temperature is 0 or unset, which overrides a checkpoint's `generation_config.json` that samples.

How lm-eval's rolling perplexity relates to `uptrain.eval` (see the README): lm-eval scores a
document in non-overlapping windows of `max_length` input tokens, each window's first token
predicted from one token of context, and puts a prefix token (BOS) before the document's tokens;
when the tokenizer adds BOS itself (`add_bos_token` left unset) the document then starts with
two BOS tokens and lm-eval also scores the second one. With `add_bos_token=False` and lm-eval's
`max_length = M`, the scored tokens, their contexts and so the summed log-likelihood are exactly
those of `uptrain.eval --max-length M+1 --stride M`. `run_tasks` therefore runs rolling tasks with
`add_bos_token=False` and `max_length = uptrain.eval's max_length - 1`; other tasks keep lm-eval's
default (the tokenizer's own special tokens: one BOS before a context, as in training).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from uptrain.cli import distinct_names, format_table, positive_int
from uptrain.errors import UsageError

TASK_DATA = Path(__file__).resolve().parent / "task_data"
BUNDLED_TASKS = ("stories_ppl", "stories_cloze", "stories_ending", "stories_name")
INSTALL_HINT = "pip install 'uptrain[eval]' (or: pip install 'lm-eval>=0.4,<0.5')"


@dataclass
class TaskScore:
    """One metric of one lm-eval task for one model."""

    task: str
    metric: str  # e.g. acc, acc_norm, word_perplexity
    value: float
    stderr: float | None  # lm-eval's standard error; None where it gives none (perplexities)
    samples: int  # documents scored

    @property
    def column(self) -> str:
        return f"{self.task}/{self.metric}"


# ---------------------------------------------------------------- pure helpers


def parse_task_names(values: Sequence[str]) -> list[str]:
    """Task names from `--tasks a b,c` (space- or comma-separated), in order, without repeats."""
    names: list[str] = []
    for v in values:
        for n in v.split(","):
            if n.strip() and n.strip() not in names:
                names.append(n.strip())
    if not names:
        raise UsageError("--tasks needs at least one task name, e.g. --tasks stories_cloze,stories_ending")
    return names


def scores_from_results(results: Mapping[str, Mapping], samples: Mapping[str, int]) -> list[TaskScore]:
    """TaskScores from lm-eval's `results["results"]` (keys like `acc,none`, `acc_stderr,none`)."""
    out = []
    for task, metrics in results.items():
        n = int(samples.get(task, metrics.get("sample_len", 0)) or 0)
        for key, value in metrics.items():
            metric, _, filt = key.partition(",")
            if not filt or metric.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            se = metrics.get(f"{metric}_stderr,{filt}")
            label = metric if filt == "none" else f"{metric},{filt}"
            out.append(TaskScore(task, label, float(value),
                                 float(se) if isinstance(se, (int, float)) and math.isfinite(se) else None, n))
    return out


def format_score(s: TaskScore) -> str:
    return f"{s.value:.4f}" if s.stderr is None else f"{s.value:.4f} ± {s.stderr:.4f}"


def task_table(names: Sequence[str], scores: Sequence[Sequence[TaskScore]], shorten: bool = True) -> str:
    """Markdown: one row per model, one 'task/metric ± stderr' column per metric seen.

    `shorten`: names are model paths, shown by their shortest distinct trailing folders.
    """
    columns: list[str] = []
    for row in scores:
        columns += [s.column for s in row if s.column not in columns]
    cells = [{s.column: format_score(s) for s in row} for row in scores]
    return format_table(["model"] + [f"{c} ± stderr" for c in columns],
                        [[n] + [c.get(col, "-") for col in columns]
                         for n, c in zip(distinct_names(list(names)) if shorten else names, cells)])


def scores_json(scores: Sequence[TaskScore]) -> dict[str, dict]:
    """`{"task/metric": {"value", "stderr", "samples"}}` for a model's JSON record."""
    return {s.column: {k: v for k, v in asdict(s).items() if k in ("value", "stderr", "samples")} for s in scores}


# ---------------------------------------------------------------- lm-eval I/O


def require_lm_eval() -> None:
    """UsageError (one line, with the install command) when lm-eval cannot be imported."""
    try:
        import lm_eval  # noqa: F401
        from lm_eval.models.huggingface import HFLM  # noqa: F401
    except ImportError as err:
        raise UsageError(f"--tasks needs lm-evaluation-harness, which is not installed ({err}): {INSTALL_HINT}") from None


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def task_manager(names: Sequence[str], paths: Sequence[str] = ()):
    """An lm-eval TaskManager that knows every name: bundled and `paths` tasks first, the Hub's if needed.

    Indexing lm-eval's own few thousand task files takes seconds, so it happens only when a name
    is not local. Unknown names, or Hub names while HF_HUB_OFFLINE is set: UsageError.
    """
    from lm_eval.tasks import TaskManager

    for p in paths:
        if not Path(p).is_dir():
            raise UsageError(f"--tasks-path {p}: not a folder (it should hold lm-eval task YAML files)")
    include = [str(TASK_DATA), *map(str, paths)]
    local = TaskManager(include_path=include, include_defaults=False)
    missing = [n for n in names if n not in local.all_tasks]
    if not missing:
        return local
    where = f"bundled: {', '.join(BUNDLED_TASKS)}" + (f"; --tasks-path: {', '.join(paths)}" if paths else "")
    if _offline():
        raise UsageError(f"task {', '.join(missing)} is not local ({where}) and HF_HUB_OFFLINE is set, so lm-eval's "
                         f"Hub tasks cannot be loaded: unset it, or give a folder of task YAML with --tasks-path")
    full = TaskManager(include_path=include, include_defaults=True)
    unknown = [n for n in missing if n not in full.all_tasks]
    if unknown:
        raise UsageError(f"unknown task {', '.join(unknown)}: not local ({where}) and not an lm-eval task "
                         f"(`lm-eval ls tasks` lists them)")
    return full


@contextlib.contextmanager
def _logger_level(name: str, level: int):
    logger = logging.getLogger(name)
    old = logger.level
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.setLevel(old)


def _quiet():
    """Silence lm-eval's progress bars and per-request warnings (they would bury our tables), and
    the Hub client's retry warnings while a task's data is fetched (a failure ends in one line)."""
    logging.getLogger("lm_eval").setLevel(logging.ERROR)
    stack = contextlib.ExitStack()
    stack.enter_context(_logger_level("huggingface_hub", logging.ERROR))
    buf = io.StringIO()
    stack.enter_context(contextlib.redirect_stderr(buf))
    stack.enter_context(contextlib.redirect_stdout(buf))
    return stack


def _load_tasks(manager, name: str) -> dict:
    """`manager.load([name])`, with a failure to get the task's data as one line."""
    try:
        return manager.load([name])
    except Exception as err:  # lm-eval raises whatever `datasets` or the Hub raise
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UsageError(f"task {name}: could not load it ({type(err).__name__}: {first})") from None


def run_tasks(model, tokenizer, names: Sequence[str], manager, max_length: int, limit: int | None = None,
              batch_size: int = 8, device: str = "cpu", bootstrap_iters: int = 1000) -> list[TaskScore]:
    """Scores of one loaded model on lm-eval tasks `names` (each a task, group or tag of `manager`).

    Rolling-loglikelihood tasks run with `add_bos_token=False` and lm-eval `max_length =
    max_length - 1`, so they agree with `uptrain.eval --max-length max_length --stride
    max_length-1` (module docstring); the others with lm-eval's defaults and the same max_length.
    `limit`: score only the first N documents of each task.
    """
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    os.environ.setdefault("DISABLE_MULTIPROC", "1")  # bootstrap stderrs in-process, not a pool per CPU
    lms: dict[bool, object] = {}
    scores: list[TaskScore] = []
    for name in names:
        with _quiet():
            loaded = _load_tasks(manager, name)
        rolling = all(t.get_config("output_type") == "loglikelihood_rolling" for t in loaded["tasks"].values())
        with _quiet():
            if rolling not in lms:
                lms[rolling] = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, device=device,
                                    max_length=max_length - 1, add_bos_token=False if rolling else None)
            res = simple_evaluate(model=lms[rolling], tasks=[name], task_manager=manager, limit=limit,
                                  log_samples=False, bootstrap_iters=bootstrap_iters)
        n = {t: v.get("effective", v.get("original", 0)) for t, v in res.get("n-samples", {}).items()}
        scores += scores_from_results(res["results"], n)
    return scores


def add_task_args(parser: argparse.ArgumentParser) -> None:
    """--tasks, --tasks-path, --task-limit, --task-plot (shared by eval and compare)."""
    g = parser.add_argument_group("downstream tasks (lm-evaluation-harness; pip install 'uptrain[eval]')")
    g.add_argument("--tasks", nargs="+", metavar="NAMES",
                   help=f"lm-eval tasks, space- or comma-separated: bundled offline ones ({', '.join(BUNDLED_TASKS)}), "
                        "those in --tasks-path, or any lm-eval task name (needs the network)")
    g.add_argument("--tasks-path", nargs="+", default=[], metavar="DIR", help="folders of extra lm-eval task YAML")
    g.add_argument("--task-limit", type=positive_int, default=None, help="score only the first N documents of each task")
    g.add_argument("--task-plot", metavar="PNG", help="also write a bar chart of the task accuracies")


def tasks_from_args(args: argparse.Namespace):
    """(names, TaskManager) for `--tasks`, or (None, None) without it; checks lm-eval first."""
    if not args.tasks:
        return None, None
    require_lm_eval()
    names = parse_task_names(args.tasks)
    return names, task_manager(names, args.tasks_path)


def score_paths(paths: Sequence[str], names: Sequence[str], manager, max_length: int, limit: int | None,
                dtype: str = "auto", device: str = "cpu") -> list[list[TaskScore]]:
    """`run_tasks` on each model folder (loaded as `uptrain.eval` loads it)."""
    from uptrain.measure.models import load_model

    out = []
    for path in paths:
        model, tokenizer = load_model(path, dtype, device)
        out.append(run_tasks(model, tokenizer, names, manager, max_length, limit, device=device))
    return out


def print_task_scores(args: argparse.Namespace, paths: Sequence[str], scores: Sequence[Sequence[TaskScore]],
                      max_length: int, out) -> None:
    """The task table on `out` and, with --task-plot, the bar chart."""
    limit = f", first {args.task_limit} documents per task" if args.task_limit else ""
    print(f"\nlm-eval tasks (max_length {max_length - 1}; rolling tasks without a second BOS{limit}):", file=out)
    print(task_table(paths, scores), file=out)
    if args.task_plot:
        from uptrain.measure.plots import plot_task_scores

        plot_task_scores({p: [asdict(s) for s in row] for p, row in zip(paths, scores)}, args.task_plot)
        print(f"wrote {args.task_plot}", file=out)


def print_demo_scores(labels: Sequence[str], paths: Sequence[str], names: Sequence[str], limit: int | None,
                      max_length: int = 512) -> None:
    """The demo's task table (bundled tasks, offline); one line instead where lm-eval is not installed.
    `max_length`: the scoring window (the model's context, as for the loss table)."""
    try:
        require_lm_eval()
    except UsageError as err:
        print(f"\n(task scores skipped: {err})")
        return
    scores = score_paths(paths, names, task_manager(names), max_length, limit)
    print(f"\nlm-eval task scores ({', '.join(names)}; first {limit} items each; ± standard error):\n")
    print(task_table(labels, scores, shorten=False))
