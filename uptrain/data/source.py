"""What to read (step 1 of `uptrain.data`): a Hub dataset or local text/jsonl/parquet files.

Standard library only (and huggingface_hub for the reachability probe): the config and the CLIs
import it before anything heavy.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from uptrain.errors import UsageError

# File suffix -> the `datasets` builder that reads it.
FILE_TYPES = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}

# What one document of a text file is -> the `sample_by` of datasets' text builder that reads it so.
TEXT_UNITS = {"line": "line", "paragraph": "paragraph", "file": "document"}


@dataclass
class TeacherSamples:
    """Training text written by the distillation teacher itself (when its pre-training data is not at hand).

    The teacher samples documents until `tokens` new tokens are generated: each from the BOS token,
    or from a prompt (a non-empty line of the `prompts` .txt file, drawn with the seed), up to
    `max_new_tokens` new tokens or EOS, `batch` sequences at a time with a static KV cache
    (uptrain.train.model.sampling).
    """

    tokens: int = 0  # new tokens to generate in all (e.g. a little over the budget, or use repeat_data)
    # longest document (new tokens; capped at the teacher's context): on stories260K 512 beat 256 (-0.003 nats,
    # -0.006 KL, two seeds; with temperature 1.2 -0.009 and -0.009 together) for 4% more CPU (results/quality-curve.md)
    max_new_tokens: int = 512
    # a little hotter than the teacher's own distribution (the targets stay the teacher's at T=1): on stories260K
    # 1.2 beat 1.0 as training text (-0.007 nats, two seeds) and as calibration text (results/quality-curve.md)
    temperature: float = 1.2
    top_p: float = 1.0  # the teacher's own distribution: lower KL than 0.95 on stories260K (results/quality-curve.md)
    batch: int = 0  # sequences generated together; 0 (auto): as many as a 1 GiB KV cache holds, at most 1024
    seed: int = 0
    prompts: str | None = None  # optional .txt file, one short prompt per line

    def validate(self) -> None:
        """Raise UsageError on values that cannot work."""
        if self.tokens < 1 or self.max_new_tokens < 1 or self.batch < 0:
            raise UsageError("data.train.teacher_samples: tokens and max_new_tokens must be at least 1, batch at "
                             "least 0 (0: auto)")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise UsageError("data.train.teacher_samples: temperature must be > 0 and top_p in (0, 1]")
        if self.prompts is not None and not Path(self.prompts).is_file():
            raise UsageError(f"data.train.teacher_samples.prompts file not found: {self.prompts}; check the path")


@dataclass
class DataSource:
    """A text source: a Hub dataset (`dataset`, `config`, `split`) or local `files`.

    Local `.txt` files are cut into documents by `text_unit`: `paragraph` (the default; documents
    separated by a blank line, so hard-wrapped prose and multi-paragraph stories stay whole if a
    blank line separates them from the next), `line` (one document per line) or `file` (each file
    one document, e.g. a book). `.jsonl`/`.json`/`.parquet` files give one document per record,
    read from `text_field`. `streaming` reads the source lazily (a Hub dataset or local files) as
    an IterableDataset, for corpora too large to download whole.
    """

    dataset: str | None = None
    config: str | None = None
    split: str = "train"
    files: list[str] = field(default_factory=list)
    text_field: str = "text"
    text_unit: str = "paragraph"  # .txt files: line, paragraph or file (see TEXT_UNITS)
    streaming: bool = False
    teacher_samples: TeacherSamples | None = None  # data.train only: the teacher's own text (needs distill.teacher)

    def validate(self) -> None:
        """Raise UsageError when the source is not usable as given."""
        if self.teacher_samples is not None:
            if self.dataset or self.files or self.streaming:
                raise UsageError("teacher_samples is a data source of its own: give no dataset, files or streaming with it")
            self.teacher_samples.validate()
            return
        if bool(self.dataset) == bool(self.files):
            raise UsageError("give either a Hub dataset name or local files as the data source, not both or neither")
        if self.text_unit not in TEXT_UNITS:
            raise UsageError(f"unknown text_unit {self.text_unit!r}; use one of {', '.join(TEXT_UNITS)}")
        if self.files:
            for f in self.files:
                path = Path(f)
                if not path.exists():
                    raise UsageError(f"data file not found: {f}; check the path")
                if path.is_dir():
                    raise UsageError(f"data file {f} is a directory; name the files in it (e.g. {path / '*.txt'})")
                if path.stat().st_size == 0:
                    raise UsageError(f"data file {f} is empty; give a file with text in it")
            suffixes = {Path(f).suffix.lower() for f in self.files}
            unknown = suffixes - set(FILE_TYPES)
            if unknown:
                raise UsageError(
                    f"unsupported data file type(s) {sorted(unknown)}; use one of {sorted(FILE_TYPES)}"
                )
            builders = {FILE_TYPES[s] for s in suffixes}
            if len(builders) > 1:
                raise UsageError(f"mixed data file types {sorted(suffixes)}; give files of one type per source")


def check_hub_reachable(dataset: str, timeout_s: float = 10.0) -> None:
    """Fail in seconds, not after datasets' retries, when the Hub cannot be reached.

    One metadata request; with HF_HUB_OFFLINE=1 nothing is asked and datasets reads its cache.
    """
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.HF_HUB_OFFLINE:
        return
    try:
        HfApi().dataset_info(dataset, timeout=timeout_s)
    except HfHubHTTPError:
        return  # the Hub answered (not found, gated, ...): datasets' own error says what
    except Exception as err:  # noqa: BLE001 - connection errors differ between HTTP backends
        raise UsageError(
            f"cannot reach the Hugging Face Hub to load dataset {dataset!r} ({str(err).splitlines()[0]}); "
            "use local files (data.train.files / data.val.files), or HF_HUB_OFFLINE=1 to read a cached copy"
        ) from None


_WHOLE_HASH_BYTES = 64 << 20  # a file up to this size is hashed whole
_SAMPLES, _SAMPLE_BYTES = 64, 1 << 20  # a larger one: its size and 64 pieces of 1 MiB at fixed strides


def files_fingerprint(paths: list[str]) -> str:
    """sha256 of the content of `paths` (in order): what a run's data was, whatever its mtime.

    Content, not modification times: a data set copied to a node's local disk at every (re)start
    of a job is the same data. Files up to 64 MiB are hashed whole; a larger one by its size and
    64 pieces of 1 MiB spread over it (an edit that keeps the size and misses every piece is not
    seen; an append or a truncation always is). A 100 GB corpus costs 64 MiB of reads."""
    import hashlib

    h = hashlib.sha256()
    for name in paths:
        path = Path(name)
        size = path.stat().st_size
        h.update(f"{path.name}|{size}|".encode())
        with open(path, "rb") as f:
            if size <= _WHOLE_HASH_BYTES:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
                continue
            for i in range(_SAMPLES):
                f.seek((size - _SAMPLE_BYTES) * i // (_SAMPLES - 1))
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()
