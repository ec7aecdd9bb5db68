"""The README's main job runs on what ships in the repository (no ../shared needed)."""

import re

from uptrain.demo import main


def test_demo_converts_uptrains_and_reports(tmp_path, capsys):
    assert main(["--out", str(tmp_path / "demo"), "--stories", "3", "budget.tokens=16384", "optim.warmup_steps=2",
                 "log.progress_bar=false"]) == 0
    out = capsys.readouterr().out
    losses = {name: float(loss) for name, loss in
              re.findall(r"\| (MHA source|GQA-2, converted|GQA-2, uptrained)[^|]*\| ([0-9.]+)", out)}
    assert set(losses) == {"MHA source", "GQA-2, converted", "GQA-2, uptrained"}
    assert losses["MHA source"] < losses["GQA-2, uptrained"] < losses["GQA-2, converted"]
    assert "| 4x " in out and (tmp_path / "demo" / "uptrain" / "model" / "config.json").is_file()
