"""The one reader of text (step 2 of `uptrain.data`): a source's documents, through `datasets`.

The trainer, eval, the demo, the method bake-off and calibration all read text here, so a file
means the same documents everywhere. A file `datasets` cannot read (binary, not UTF-8, not JSON
Lines, a record without the text field) is a one-line UsageError naming the file and the fix,
not a traceback.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from uptrain.data.source import FILE_TYPES, TEXT_UNITS, DataSource, check_hub_reachable
from uptrain.errors import UsageError

if TYPE_CHECKING:
    import datasets

_CHUNK = 1 << 20  # bytes read at a time when looking for what makes a file unreadable


def documents(source: DataSource, field_option: str | None = "text_field") -> datasets.Dataset | datasets.IterableDataset:
    """The documents of `source`: a dataset with one column, "text", empty documents dropped.

    Whole (a `datasets.Dataset`, cached on disk) or, with `source.streaming`, lazy (an
    `IterableDataset`). UsageError when the source is unusable or holds no text. field_option:
    how the command that reads it names `text_field` in its errors (the trainer's config key,
    eval's `--text-field`; None: the command has none and reads "text" only).
    """
    source.validate()
    if source.files:
        return _file_documents(source, field_option)
    return _hub_documents(source, field_option)


def _set_the_field(field_option: str | None, field: str) -> str:
    """How to point the command that failed at the field that holds the text."""
    if field_option is None:
        return f"this command reads the {field!r} field only: name the field so, or give a .txt file"
    return f"set {field_option} to the field that holds the text"


def read_documents(source: DataSource, max_documents: int | None = None,
                   field_option: str | None = "text_field") -> list[str]:
    """The first `max_documents` (default all) documents of `source` as strings (field_option: `documents`)."""
    texts: list[str] = []
    for row in documents(source, field_option):
        if max_documents is not None and len(texts) >= max_documents:
            break
        texts.append(row["text"])
    return texts


def split_documents(
    texts: datasets.Dataset, val_fraction: float, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, val) documents: a seeded `val_fraction` of the documents held out, each one whole.

    Splitting documents, not packed blocks, keeps every document on one side: a block split
    would put the two halves of a document that straddles a block edge into train and validation.
    """
    if len(texts) < 2:
        raise UsageError("too little data to hold out a validation set: fewer than 2 documents; give data.val")
    parts = texts.train_test_split(test_size=max(1, round(val_fraction * len(texts))), seed=seed)
    return parts["train"], parts["test"]


# ---------------------------------------------------------------- local files


def _file_documents(source: DataSource, field_option: str | None) -> datasets.Dataset | datasets.IterableDataset:
    import datasets  # here, not at the top: the config imports this package and --help needs no datasets

    builder = FILE_TYPES[Path(source.files[0]).suffix.lower()]
    files = [str(Path(f).resolve()) for f in source.files]
    options = {"sample_by": TEXT_UNITS[source.text_unit]} if builder == "text" else {}
    with _quiet(), _read_errors(source.files, builder):
        ds = datasets.load_dataset(builder, data_files=files, split="train", streaming=source.streaming, **options)
        if builder == "text" and source.text_unit != "line":
            # Runs of 3+ newlines and a file's last newline are left on the edges of a paragraph or
            # file: they separate documents, they are not part of one.
            ds = ds.map(_strip_newlines)
        ds = _text_column(ds, source, field_option)
        # A record without the field reads as null: say so, do not drop it. (A filter writes only
        # an index, no copy of the text.)
        ds = ds.filter(_has_text_or_fail(_names(source.files), source.text_field, field_option), with_indices=True)
        first = next(iter(ds), None)  # a stream reads its first documents only
    if first is None:
        names = _names(source.files)
        raise UsageError(f"{names} {'is' if len(source.files) == 1 else 'are'} empty (whitespace only, no text); "
                         "give a file with text in it")
    return ds


def _strip_newlines(row: dict[str, str]) -> dict[str, str]:
    """The row with newlines removed from both ends of its text."""
    return {"text": row["text"].strip("\n")}


def _has_text(row: dict[str, str]) -> bool:
    return bool(row["text"] and row["text"].strip())


def _has_text_or_fail(names: str, field: str, field_option: str | None):
    """`_has_text` as a filter of rows with indices, raising UsageError on a record without the field."""
    def keep(row: dict[str, str | None], index: int) -> bool:
        if row["text"] is None:
            raise UsageError(f"{names}: record {index + 1} has no {field!r} field; give every record "
                             f"a {field!r} string ({_set_the_field(field_option, field)})")
        return _has_text(row)
    return keep


def _names(files: list[str]) -> str:
    return f"data file {files[0]}" if len(files) == 1 else f"data files {', '.join(files)}"


@contextmanager
def _quiet() -> Iterator[None]:
    """No progress bars or log lines from `datasets` while reading (errors become one line)."""
    import datasets

    bars = not datasets.are_progress_bars_disabled()
    level = datasets.logging.get_verbosity()
    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    try:
        yield
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


@contextmanager
def _read_errors(files: list[str], builder: str) -> Iterator[None]:
    """Turn `datasets`' errors for an unreadable file into a UsageError naming the file."""
    import pyarrow
    from datasets.exceptions import DatasetsError

    try:
        yield
    except (DatasetsError, UnicodeDecodeError, pyarrow.ArrowException, ValueError, OSError, StopIteration) as err:
        for f in files:
            problem = file_problem(Path(f), builder)
            if problem:
                raise UsageError(f"data file {f} {problem}") from None
        cause = err
        while cause.__cause__ or cause.__context__:
            cause = cause.__cause__ or cause.__context__
        what = f"{type(cause).__name__}: {str(cause).splitlines()[0]}" if str(cause) else type(cause).__name__
        kind = f"it is a {builder} file" if len(files) == 1 else f"they are {builder} files"
        raise UsageError(f"cannot read {_names(files)} ({what}); check that {kind}") from None


def file_problem(path: Path, builder: str) -> str | None:
    """Why `path` cannot be read by `builder` ("text", "json", "parquet"), or None if it can.

    Read in chunks; only called after a read failed, so a good corpus is never read twice.
    """
    if builder == "parquet":
        return None  # a binary format: pyarrow's message says what is wrong
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset, blank = 0, True
    with path.open("rb") as fh:
        while chunk := fh.read(_CHUNK):
            blank = blank and not chunk.strip()
            nul = chunk.find(b"\0")
            if nul >= 0:
                return f"is binary, not text (a NUL byte at byte {offset + nul}); give a UTF-8 text file"
            try:
                decoder.decode(chunk)
            except UnicodeDecodeError as err:
                return (f"is not UTF-8 text (byte {offset + err.start} is {chunk[err.start:err.start + 1]!r}); "
                        "convert it to UTF-8, e.g. iconv -f latin1 -t utf-8")
            offset += len(chunk)
    if blank:
        return "is empty (whitespace only, no text); give a file with text in it"
    if builder == "json":
        text = path.read_text(encoding="utf-8")
        try:
            json.loads(text)
            return None  # one JSON document (a .json file): readable as such
        except ValueError:
            pass
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    json.loads(line)
                except ValueError as err:
                    return f"is not JSON Lines: line {n} is not one JSON value ({err}); write one JSON object per line"
    return None


# ---------------------------------------------------------------- Hub datasets


def _hub_documents(source: DataSource, field_option: str | None) -> datasets.Dataset | datasets.IterableDataset:
    import datasets

    check_hub_reachable(source.dataset)
    try:
        ds = datasets.load_dataset(source.dataset, source.config, split=source.split, streaming=source.streaming)
    except (FileNotFoundError, ConnectionError, ValueError) as err:
        raise UsageError(
            f"cannot load dataset {source.dataset!r} (split {source.split!r}): "
            f"{str(err).splitlines()[0]}; check the name or use local files"
        ) from err
    ds = _text_column(ds, source, field_option)
    ds = ds.filter(_has_text)
    if not source.streaming and len(ds) == 0:
        raise UsageError(f"dataset {source.dataset!r} (split {source.split!r}) holds no text in its "
                         f"{source.text_field!r} column; {_set_the_field(field_option, source.text_field)}")
    return ds


def _text_column(ds, source: DataSource, field_option: str | None):
    """`ds` with only the text column, named "text"."""
    columns = ds.column_names  # None for some streaming Hub datasets: checked when read
    if columns is not None and source.text_field not in columns:
        raise UsageError(f"data has no {source.text_field!r} column (columns: {columns}); "
                         f"{_set_the_field(field_option, source.text_field)}")
    ds = ds.select_columns([source.text_field])
    if source.text_field != "text":
        ds = ds.rename_column(source.text_field, "text")
    return ds
