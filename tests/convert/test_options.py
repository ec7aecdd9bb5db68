"""`convert/options.py`: what a conversion is made with, and what its output says about it.

A conversion or a sweep run without the quality path says, beside its result, that these are not
the best start and what the quality path closed (before: the README's sweep command reported mean
pooling's +59.6% / +100.6% on an outside model where the quality path gives +1.9% / +4.7%, and
nothing pointed to the better flags)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from conftest import EXAMPLE_MHA8, TRAIN_TXT, VALID_TXT
from uptrain.convert.options import QUALITY_PATH, ConversionOptions


def test_every_option_combination_but_the_quality_path_gets_a_note():
    for method, grouping, calib, refine in itertools.product(["mean", "first", "random", "fit"], ["contiguous", "similar"],
                                                             [None, TRAIN_TXT], [False, True]):
        options = ConversionOptions(method=method, grouping=grouping, calib=calib, refine=refine)
        note = options.start_note()
        quality = method == "fit" and options.calibrated and refine
        assert (note is None) == quality, (method, grouping, calib, refine, note)
        if note:
            assert "not the best one" in note and "results/refine.md" in note
            assert QUALITY_PATH in note or "--refine" in note


def test_a_mean_pooling_conversion_says_what_the_quality_path_closes(tmp_path, capsys):
    from uptrain.convert.__main__ import main

    assert main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--out", str(tmp_path / "mean")]) == 0
    out = capsys.readouterr().out
    assert f"note: {tmp_path / 'mean'} is a mean-pooling start, not the best one: the quality path ({QUALITY_PATH})" in out


@pytest.mark.parametrize("quality", [False, True])
def test_the_sweep_says_whose_numbers_its_table_and_recommendation_are(tmp_path, capsys, quality):
    from uptrain.sweep.run import main

    flags = ["--method", "fit", "--grouping", "similar", "--calib", str(TRAIN_TXT), "--calib-tokens", "1024", "--refine",
             "--refine-steps", "5"] if quality else []
    assert main([str(EXAMPLE_MHA8), "--data", str(VALID_TXT), "--stories", "2", "--kv-heads", "4", "--threads", "1",
                 *flags, "--out", str(tmp_path / "sweep")]) == 0
    out = capsys.readouterr().out
    said = "note: these are the numbers of a mean-pooling start, not the best one" in out
    assert said != quality, out[-2000:]
    recommendation = next(line for line in out.splitlines() if "recommended" in line or "none of the counts" in line)
    assert ("(mean start: see the note)" in recommendation) != quality, recommendation


def test_group_candidates_is_refused_wherever_no_grouping_is_measured():
    """`--group-candidates` does something only with --grouping similar and calibration text: given
    anywhere else it is refused (it was accepted and ignored), in the check both commands share."""
    from uptrain.convert.options import GROUP_CANDIDATES_UNUSED
    from uptrain.errors import UsageError

    checked = 0
    for method, grouping, calib, refine in itertools.product(["mean", "first", "random", "fit"], ["contiguous", "similar"],
                                                             [None, TRAIN_TXT], [False, True]):
        plain = ConversionOptions(method=method, grouping=grouping, calib=calib, refine=refine)
        try:
            plain.check()
        except UsageError:
            continue  # refused for another reason already
        given = ConversionOptions(method=method, grouping=grouping, calib=calib, refine=refine, group_candidates=2)
        applies = grouping == "similar" and plain.calibrated
        if applies:
            given.check()
            assert given.record()["group_candidates"] == 2 and plain.record()["group_candidates"] == 3
        else:
            with pytest.raises(UsageError, match="applies only with --grouping similar and --calib"):
                given.check()
            assert str(UsageError(GROUP_CANDIDATES_UNUSED)).count("\n") == 0
        checked += 1
    assert checked >= 10


@pytest.mark.parametrize("command", ["convert", "sweep"])
def test_both_commands_refuse_group_candidates_without_a_measured_grouping(command, tmp_path, capsys):
    """At each entry point: one line naming the option, exit 2, nothing written."""
    if command == "convert":
        from uptrain.convert.__main__ import main
        argv = [str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--calib", str(TRAIN_TXT)]
    else:
        from uptrain.sweep.run import main
        argv = [str(EXAMPLE_MHA8), "--data", str(VALID_TXT), "--kv-heads", "4", "--method", "fit", "--calib",
                str(TRAIN_TXT)]
    assert main([*argv, "--group-candidates", "2", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--group-candidates applies only with --grouping similar and --calib" in err, err
    assert not (tmp_path / "out").exists()
