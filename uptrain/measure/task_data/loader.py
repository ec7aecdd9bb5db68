"""Offline loader for the bundled lm-eval tasks: a JSONL file beside this one as a `test` split.

lm-eval calls `load(**metadata, **dataset_kwargs)` for a task whose YAML names it as
`custom_dataset`; the YAML's `dataset_kwargs: {file: NAME.jsonl}` picks the file. Reading it
here (not through `datasets.load_dataset("json", data_files=...)`) keeps the path relative to
the package, wherever uptrain is installed, and never touches the network or the Hub cache.
"""

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(file: str, **_metadata) -> datasets.DatasetDict:
    rows = [json.loads(line) for line in (HERE / file).read_text(encoding="utf-8").splitlines() if line.strip()]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})
