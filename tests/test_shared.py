"""The modules shared by all rooms: errors, cli helpers, units."""

from __future__ import annotations

import pytest

from uptrain.cli import distinct_names
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.units import kv_cache_bytes_per_token, parse_size


@exit_on_usage_error
def _failing_main() -> int:
    raise UsageError("bad input; do this instead")


def test_usage_error_is_one_line_from_the_main_process_only(monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert _failing_main() == 2
    assert capsys.readouterr().err == "error: bad input; do this instead\n"
    monkeypatch.setenv("RANK", "1")  # another process of `accelerate launch`: same exit code, silent
    assert _failing_main() == 2
    assert capsys.readouterr().err == ""


def test_distinct_names_use_the_shortest_telling_suffix() -> None:
    assert distinct_names(["runs/a/model", "runs/b/model"]) == ["a/model", "b/model"]
    assert distinct_names(["x/kv4", "y/kv2"]) == ["kv4", "kv2"]
    assert distinct_names(["same", "same"]) == ["same", "same"]


def test_sizes_and_kv_formula() -> None:
    assert parse_size("5GB") == 5 * 10**9 and parse_size("1.5 GiB") == 3 * 2**29 and parse_size("100") == 100
    for bad in ("", "5XB", "-1GB", "0"):
        with pytest.raises(UsageError):
            parse_size(bad)
    assert kv_cache_bytes_per_token(32, 8, 128, 2) == 2 * 32 * 8 * 128 * 2


def test_usage_lines_name_the_command_the_user_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    from uptrain.cli import prog_name

    monkeypatch.setattr("sys.argv", ["/venv/bin/uptrain-eval", "--help"])
    assert prog_name("uptrain.eval") == "uptrain-eval"
    monkeypatch.setattr("sys.argv", ["/repo/uptrain/eval.py", "--help"])  # python -m uptrain.eval
    assert prog_name("uptrain.eval") == "python -m uptrain.eval"


@pytest.mark.parametrize("module,entry", [
    ("uptrain.convert", "uptrain.convert.__main__"), ("uptrain.train", "uptrain.train.__main__"),
    ("uptrain.eval", "uptrain.measure.eval"), ("uptrain.bench", "uptrain.measure.bench"),
    ("uptrain.compare", "uptrain.measure.compare"), ("uptrain.plots", "uptrain.measure.plots"),
    ("uptrain.demo", "uptrain.demo"), ("uptrain.measure.methods", "uptrain.measure.methods"),
    ("uptrain.convert.registry.architectures", "uptrain.convert.registry.architectures")])
def test_every_command_has_help_with_its_own_name(module: str, entry: str, capsys: pytest.CaptureFixture[str]) -> None:
    import importlib

    with pytest.raises(SystemExit) as done:
        importlib.import_module(entry).main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: python -m {module}") and "-h, --help" in out


def test_module_entry_points_run_without_import_warnings() -> None:
    """`python -m uptrain.convert.registry.architectures` must not import itself twice (runpy's warning)."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m", "uptrain.convert.registry.architectures"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("| model type(s)"), proc.stderr[-2000:]


def test_a_run_folders_final_model_is_named_by_its_run() -> None:
    """Issue 22: an uptrained model showed up as "model" in tables and legends."""
    assert distinct_names(["examples/stories260K-mha8", "runs/demo-cpu/model"]) == ["stories260K-mha8", "demo-cpu/model"]
    assert distinct_names(["runs/demo-cpu/model"]) == ["demo-cpu/model"]
    assert distinct_names(["model"]) == ["model"]
