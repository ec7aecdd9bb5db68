"""Plots are valid PNGs holding the expected series."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image as mpimg
import pytest

from uptrain.measure import plots
from uptrain.errors import UsageError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = mpimg.imread(path)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def write_run(run_dir: Path, final_loss: float) -> Path:
    """A metrics.jsonl shaped like the trainer's: train records with tokens, val records without."""
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"step": 0, "val_loss": 5.0, "val_ppl": 148.4, "val_tokens": 1000})]
    for step in (10, 20, 30):
        lines.append(json.dumps({"step": step, "loss": final_loss + 3.0 / step, "lr": 1e-3, "tokens": step * 256}))
    lines += [json.dumps({"step": 30, "val_loss": final_loss}), "", "not json", '{"step": 40, "lo']  # torn last line
    (run_dir / "metrics.jsonl").write_text("\n".join(lines))
    return run_dir


def test_training_runs_plot(tmp_path: Path) -> None:
    runs = {name: plots.read_metrics(write_run(tmp_path / name, loss)) for name, loss in (("kv4", 1.8), ("kv2", 2.4))}
    fig = plots.plot_training_runs(runs, tmp_path / "loss.png")
    assert_png(tmp_path / "loss.png")
    lines = fig.axes[0].get_lines()
    assert [line.get_label() for line in lines] == ["kv4 loss", "kv4 val_loss", "kv2 loss", "kv2 val_loss"]
    assert list(lines[1].get_xdata()) == [0, 30 * 256]  # val records placed at step x tokens/step
    assert fig.axes[0].get_xlabel() == "tokens"


def test_training_runs_cli_writes_into_run_folder(tmp_path: Path) -> None:
    run = write_run(tmp_path / "run", 2.0)
    assert plots.main(["runs", str(run)]) == 0
    assert_png(run / "loss.png")
    assert plots.main(["runs", str(tmp_path / "nowhere")]) == 2


def test_quality_vs_alpha_from_csv(tmp_path: Path) -> None:
    rows = ["kv,method,alpha,val_loss"] + [f"{kv},mean,{a},{1.7 + (8 / kv) * 0.3 / (1 + 20 * a)}"
                                           for kv in (4, 2, 1) for a in (0.0, 0.05, 0.1)]
    (tmp_path / "alpha.csv").write_text("\n".join(rows))
    table = plots.read_alpha_table(tmp_path / "alpha.csv")
    fig = plots.plot_quality_vs_alpha(table, tmp_path / "alpha.png", reference=1.746)
    assert_png(tmp_path / "alpha.png")
    lines = fig.axes[0].get_lines()
    assert sorted(line.get_label() for line in lines) == [
        "1 KV heads, mean", "2 KV heads, mean", "4 KV heads, mean", "source model"]
    assert all(len(line.get_xdata()) == 3 for line in lines if line.get_label() != "source model")
    (tmp_path / "bad.csv").write_text("kv,alpha\n4,0.1\n")
    with pytest.raises(UsageError):
        plots.read_alpha_table(tmp_path / "bad.csv")


def test_bench_plots_from_json(tmp_path: Path) -> None:
    """Rows as `uptrain.bench --json` writes them (context keys become strings in JSON)."""
    rows = [{"model": f"m/kv{kv}", "kv_heads": kv,
             "kv_bytes": {str(c): 320 * kv * c for c in (64, 256)},
             "decode": [{"batch": b, "context": c, "decode_tokens_per_s": 100.0 * b / kv} for b in (1, 8) for c in (64, 256)]}
            for kv in (8, 4)]
    (tmp_path / "bench.json").write_text(json.dumps(rows))
    fig = plots.plot_kv_bytes(rows, tmp_path / "kv.png")
    assert [line.get_label() for line in fig.axes[0].get_lines()] == ["kv8 (8 kv)", "kv4 (4 kv)"]
    assert list(fig.axes[0].get_lines()[0].get_ydata()) == [320 * 8 * 64, 320 * 8 * 256]
    fig = plots.plot_decode_speed(rows, tmp_path / "speed.png")
    assert len(fig.axes[0].get_lines()) == 4  # 2 models x 2 batch sizes
    assert plots.main(["bench", str(tmp_path / "bench.json"), "--out", str(tmp_path / "out"), "--prefix", "x-"]) == 0
    for name in ("kv.png", "speed.png", "out/x-kv-bytes.png", "out/x-decode-speed.png"):
        assert_png(tmp_path / name)


def test_distillation_runs_plot_lm_loss_and_kd_apart(tmp_path: Path) -> None:
    """A KD run's `loss` mixes KD and LM: the curve that compares with plain runs is lm_loss."""
    plain = plots.read_metrics(write_run(tmp_path / "plain", 2.0))
    kd_run = tmp_path / "kd"
    kd_run.mkdir()
    (kd_run / "metrics.jsonl").write_text("\n".join(json.dumps(
        {"step": s, "loss": 9.0, "lm_loss": 2.0 + 1.0 / s, "kd_loss": 0.5, "tokens": s * 256}) for s in (10, 20)))
    fig = plots.plot_training_runs({"plain": plain, "kd": plots.read_metrics(kd_run)}, tmp_path / "loss.png")
    lines = {line.get_label(): line for line in fig.axes[0].get_lines()}
    assert set(lines) == {"plain loss", "plain val_loss", "kd lm_loss", "kd kd_loss"}
    assert 9.0 not in list(lines["kd lm_loss"].get_ydata())


def test_bench_labels_tell_same_named_folders_apart(tmp_path: Path) -> None:
    rows = [{"model": f"runs/{name}/model", "kv_heads": 2, "kv_bytes": {"64": 1}, "decode": []} for name in ("a", "b")]
    fig = plots.plot_kv_bytes(rows, tmp_path / "kv.png")  # one context: a bar per model, named below it
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["a/model (2 kv)", "b/model (2 kv)"]


def test_one_context_gives_bars_not_single_points_and_kv_axis_in_binary_units(tmp_path: Path) -> None:
    """Issue 22: `compare --context 256` drew a lone dot per line; the KV axis was in raw bytes."""
    rows = [{"model": f"runs/{name}/model", "kv_heads": kv, "kv_bytes": {"256": 2560 * kv * 256},
             "decode": [{"batch": b, "context": 256, "decode_tokens_per_s": 100.0 * b / kv} for b in (1, 8)]}
            for name, kv in (("mha", 8), ("gqa", 2))]
    fig = plots.plot_kv_bytes(rows, tmp_path / "kv.png")
    ax = fig.axes[0]
    assert not ax.get_lines() and len(ax.patches) == 2  # one bar per model
    assert "256" in ax.get_xlabel() or "256" in ax.get_title()
    fig.canvas.draw()
    ticks = [t.get_text() for t in ax.get_yticklabels() if t.get_text()]
    assert any(t.endswith(("KiB", "MiB")) for t in ticks), ticks
    fig = plots.plot_decode_speed(rows, tmp_path / "speed.png")
    assert not fig.axes[0].get_lines() and len(fig.axes[0].patches) == 4  # 2 models x 2 batch sizes


def test_kv_axis_of_a_line_plot_is_in_binary_units(tmp_path: Path) -> None:
    rows = [{"model": "m", "kv_heads": 8, "kv_bytes": {"64": 2 * 2**20, "256": 8 * 2**20}, "decode": []}]
    fig = plots.plot_kv_bytes(rows, tmp_path / "kv.png")
    fig.canvas.draw()
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels() if t.get_text()]
    assert ticks and all(t.endswith((" B", "KiB", "MiB", "GiB")) for t in ticks) and "8 MiB" in ticks, ticks


def test_every_positional_argument_of_plots_has_help(capsys) -> None:
    for what, name in (("runs", "RUN"), ("alpha", "table"), ("bench", "json")):
        with pytest.raises(SystemExit):
            plots.main([what, "--help"])
        usage = capsys.readouterr().out
        block = usage.split("positional arguments:")[1].split("options:")[0]
        names = [line.split(None, 1) for line in block.splitlines() if line.startswith("  ") and not line.startswith("    ")]
        assert names and all(len(n) == 2 for n in names), usage  # "  NAME  help", not a bare "  NAME"
