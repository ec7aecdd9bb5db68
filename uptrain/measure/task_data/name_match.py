"""Scoring for the bundled generating task stories_name: exact match of the generation's first word.

lm-eval calls `process_results(doc, results)` with `results = [generation]` (the text the model
generated after the context, cut at the task's `until` strings). The first word of it (a run of
letters, so " Tom", "Tom's" and "Tom went" all give "Tom") is compared with the target name,
case included: "exact_match" is 1.0 or 0.0 per item, and lm-eval reports their mean ± stderr.
"""

import re

WORD = re.compile(r"[A-Za-z]+")


def first_word(text: str) -> str:
    m = WORD.search(text)
    return m.group() if m else ""


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    return {"exact_match": float(first_word(results[0]) == doc["target"])}
