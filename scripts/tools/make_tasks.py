"""Write the bundled offline lm-eval tasks (JSONL) from examples/data/tinystories-valid-sample.txt.

    python scripts/tools/make_tasks.py [--text FILE] [--out uptrain/measure/task_data] [--seed 0]

Four tasks over the held-out TinyStories sample (the YAML beside the JSONL says how lm-eval
scores them; `uptrain/measure/task_data/loader.py` reads the JSONL offline):
- stories_ppl.jsonl     {"text"}: one story per line, the documents `uptrain.eval --data FILE`
                        reads from the same file (paragraphs), for the rolling-perplexity task.
- stories_cloze.jsonl   {"context", "target"}: a story cut before the last word of one of its
                        sentences (from the second sentence on); target = " word" (LAMBADA-style).
- stories_ending.jsonl  {"context", "choices", "label"}: a story cut after sentence k (k >= 1);
                        choices = the true sentence k+1 and three sentences drawn (seeded) from
                        other stories, in a seeded order; label = index of the true one.
- stories_name.jsonl    {"context", "target", "names"}: generated, not scored by likelihood. A
                        story's names are its capitalised words that occur at least once inside a
                        sentence (not after . ! ? or a quote: so "Lily", "Mom", never "The"). An
                        item is the story cut just before a later occurrence of a name met
                        earlier, so the story itself says who comes next: inside a sentence only
                        ("Sara and" -> "Tom"; a sentence start could as well be "She"), at most
                        NAME_CONTEXT_CHARS characters of context (whole sentences from the end:
                        with max_gen_toks it fits stories260K's 512 tokens), which must still hold
                        an earlier occurrence; duplicates dropped. target = the name (no space);
                        names = the distinct names in the context, sorted: a guess among them is
                        right with chance 1/len(names), and the mean of that over the items is
                        the task's chance level (printed; in stories_name.yaml).
Deterministic: the same text and seed give byte-identical files.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from uptrain.data import read_documents  # noqa: E402
from uptrain.data.source import DataSource  # noqa: E402

# a sentence ends at . ! or ? (optionally inside a closing quote) followed by white space
SENTENCE_END = re.compile(r'(?:(?<=[.!?])|(?<=[.!?]"))\s+')
WORD = re.compile(r"^([A-Za-z]+)([.!?,\"']*)$")
N_CHOICES = 4
MAX_ITEMS = 200  # per task: small files, seconds to score
CAPITALISED = re.compile(r"\b[A-Z][a-z]+\b")
NAME_CONTEXT_CHARS = 850  # <= 850 characters: at most ~470 stories260K tokens (1.8+ characters a token)


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


def _inside_sentence(story: str, start: int) -> bool:
    """Whether the word at `start` follows another word of its sentence (not . ! ? or a quote)."""
    before = story[:start].rstrip()
    return bool(before) and before[-1] not in ".!?\"'"


def story_names(story: str) -> set[str]:
    """Capitalised words that occur at least once inside a sentence: the story's names."""
    return {m.group() for m in CAPITALISED.finditer(story) if _inside_sentence(story, m.start())}


def _last_sentences(text: str, max_chars: int) -> str:
    """The longest run of whole sentences ending `text` within max_chars (all of it when it fits)."""
    if len(text) <= max_chars:
        return text
    starts = [m.end() for m in SENTENCE_END.finditer(text)]
    return next((text[i:] for i in starts if len(text) - i <= max_chars), "")


def name_items(stories: list[str], max_chars: int = NAME_CONTEXT_CHARS) -> list[dict]:
    """Every later occurrence of a name inside a sentence, with the story before it (module docstring)."""
    items, seen = [], set()
    for story in stories:
        names = story_names(story)
        for m in CAPITALISED.finditer(story):
            name = m.group()
            if name not in names or not _inside_sentence(story, m.start()):
                continue
            context = _last_sentences(story[:m.start()].rstrip(), max_chars)
            in_context = sorted(n for n in names if re.search(rf"\b{n}\b", context))
            if name not in in_context or (context, name) in seen:
                continue
            seen.add((context, name))
            items.append({"context": context, "target": name, "names": in_context})
    return items


def name_chance(items: list[dict]) -> float:
    """The mean over name items of 1/k, k the distinct names in the context: a guess among them."""
    return sum(1 / len(i["names"]) for i in items) / max(len(items), 1)


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
    names = name_items(stories)
    if len(names) > MAX_ITEMS:  # its own generator: the other tasks' files do not depend on this one
        pick = random.Random(args.seed)
        names = [names[i] for i in sorted(pick.sample(range(len(names)), MAX_ITEMS))]
    write_jsonl(out / "stories_name.jsonl", names)
    chance, (common, most) = name_chance(names), Counter(i["target"] for i in names).most_common(1)[0]
    print(f"{len(stories)} stories -> {len(cloze)} cloze items, {len(ending)} ending items, {len(names)} name items "
          f"(chance {chance:.3f}: a guess among the names in the context; always {common}: {most / len(names):.3f}) "
          f"in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
