"""Write the bundled offline lm-eval tasks (JSONL) from examples/data/tinystories-valid-sample.txt.

    python scripts/make_tasks.py [--text FILE] [--out uptrain/measure/task_data] [--seed 0]

Three tasks over the held-out TinyStories sample (the YAML beside the JSONL says how lm-eval
scores them; `uptrain/measure/task_data/loader.py` reads the JSONL offline):
- stories_ppl.jsonl     {"text"}: one story per line, the documents `uptrain.eval --data FILE`
                        reads from the same file (paragraphs), for the rolling-perplexity task.
- stories_cloze.jsonl   {"context", "target"}: a story cut before the last word of one of its
                        sentences (from the second sentence on); target = " word" (LAMBADA-style).
- stories_ending.jsonl  {"context", "choices", "label"}: a story cut after sentence k (k >= 1);
                        choices = the true sentence k+1 and three sentences drawn (seeded) from
                        other stories, in a seeded order; label = index of the true one.
Deterministic: the same text and seed give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from uptrain.data import read_documents  # noqa: E402
from uptrain.data.source import DataSource  # noqa: E402

# a sentence ends at . ! or ? (optionally inside a closing quote) followed by white space
SENTENCE_END = re.compile(r'(?:(?<=[.!?])|(?<=[.!?]"))\s+')
WORD = re.compile(r"^([A-Za-z]+)([.!?,\"']*)$")
N_CHOICES = 4
MAX_ITEMS = 200  # per task: small files, seconds to score


def sentences(story: str) -> list[str]:
    return [s for s in SENTENCE_END.split(story.strip()) if s]


def cloze_items(stories: list[str]) -> list[dict]:
    items = []
    for story in stories:
        sents = sentences(story)
        for k in range(1, len(sents)):
            head, _, last = sents[k].rpartition(" ")
            m = WORD.match(last)
            if not head or not m:
                continue
            context = " ".join(sents[:k] + [head])
            items.append({"context": context, "target": " " + m.group(1)})
    return items


def ending_items(stories: list[str], rng: random.Random) -> list[dict]:
    per_story = [sentences(s) for s in stories]
    items = []
    for i, sents in enumerate(per_story):
        others = sorted({s for j, o in enumerate(per_story) if j != i for s in o} - set(sents))
        for k in range(1, len(sents)):
            true = sents[k]
            choices = rng.sample(others, N_CHOICES - 1) + [true]
            rng.shuffle(choices)
            items.append({"context": " ".join(sents[:k]), "choices": choices, "label": choices.index(true)})
    return items


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--text", default=str(ROOT / "examples/data/tinystories-valid-sample.txt"))
    p.add_argument("--out", default=str(ROOT / "uptrain/measure/task_data"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    stories = read_documents(DataSource(files=[args.text]))
    rng = random.Random(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cloze = cloze_items(stories)
    ending = ending_items(stories, rng)
    # a seeded, spread-out subset rather than the first stories' sentences only
    cloze = [cloze[i] for i in sorted(rng.sample(range(len(cloze)), min(MAX_ITEMS, len(cloze))))]
    ending = [ending[i] for i in sorted(rng.sample(range(len(ending)), min(MAX_ITEMS, len(ending))))]
    write_jsonl(out / "stories_ppl.jsonl", [{"text": s} for s in stories])
    write_jsonl(out / "stories_cloze.jsonl", cloze)
    write_jsonl(out / "stories_ending.jsonl", ending)
    print(f"{len(stories)} stories -> {len(cloze)} cloze items, {len(ending)} ending items in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
