"""The README's main job runs on what ships in the repository (no ../shared needed)."""

import re

from conftest import EXAMPLE_MHA8
from uptrain.demo import main
from uptrain.measure.eval import evaluate_paths


def test_demo_converts_uptrains_and_reports(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "demo"), "--stories", "3", "budget.tokens=16384", "optim.warmup_steps=2",
                 "log.progress_bar=false"]) == 0
    out, _, tasks = capsys.readouterr().out.partition("lm-eval task scores")  # loss table, then task table
    losses = {name: float(loss) for name, loss in
              re.findall(r"\| (MHA source|GQA-2, converted|GQA-2, uptrained)[^|]*\| ([0-9.]+)", out)}
    assert set(losses) == {"MHA source", "GQA-2, converted", "GQA-2, uptrained"}
    assert losses["MHA source"] < losses["GQA-2, uptrained"] < losses["GQA-2, converted"]
    assert "| 4x " in out and (tmp_path / "demo" / "uptrain" / "model" / "config.json").is_file()
    # the bundled lm-eval tasks, scored on all three models (accuracies in [0, 1] with stderrs)
    rows = re.findall(r"\| (MHA source|GQA-2, converted|GQA-2, uptrained)[^|]*\| ([0-9.]+) ± ([0-9.]+)", tasks)
    assert [r[0] for r in rows] == ["MHA source", "GQA-2, converted", "GQA-2, uptrained"]
    assert all(0.0 <= float(acc) <= 1.0 for _, acc, _ in rows)


def test_stories_counts_whole_stories_not_lines(tmp_path, capsys):
    # Stories of two paragraphs each, one line per paragraph, a blank line between stories.
    stories = ["Tom had a red ball.\nHe threw it to his dog, and the dog ran fast to get it.",
               "Lily saw a big tree.\nShe sat under it and read a book about a little bird.",
               "The sun was hot.\nSam and Mia went to the lake to swim with their mom."]
    valid = tmp_path / "valid.txt"
    valid.write_text("\n\n".join(stories) + "\n")
    assert main(["--out", str(tmp_path / "demo"), "--skip-uptrain", "--valid", str(valid), "--stories", "2",
                 "--tasks", "none"]) == 0
    out = capsys.readouterr().out
    assert "(2 stories," in out
    shown = float(re.search(r"\| MHA source[^|]*\| ([0-9.]+)", out).group(1))
    (whole,) = evaluate_paths([str(EXAMPLE_MHA8)], stories[:2], max_length=512, stride=256)
    assert shown == round(whole.loss, 3)  # the first two stories, each scored whole
