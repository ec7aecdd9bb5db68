"""uptrain.sweep converts as uptrain.convert does, for every option combination: one rule
(`uptrain.convert.options`) for what a conversion is, on a model whose heads all differ."""

from __future__ import annotations

import itertools

import pytest
import torch
from safetensors.torch import load_file

from conftest import EXAMPLE_MHA8, TRAIN_TXT, VALID_TXT, perturbed_copy
from uptrain.convert.__main__ import main as convert_main
from uptrain.sweep.run import main as sweep_main

pytestmark = pytest.mark.usefixtures("one_torch_thread")
CALIB = ["--calib", str(TRAIN_TXT), "--calib-tokens", "512"]
REFINE = ["--refine", "--refine-steps", "3"]
COUNT_PAIRS = [(4, 2), (2, 1), (4, 1)]
# every method x grouping x calibration x refinement; each combination sweeps two counts (rotating)
COMBINATIONS = list(itertools.product(["mean", "first", "random", "fit"], ["contiguous", "similar"],
                                      [False, True], [False, True]))


@pytest.fixture(scope="module")
def differing(tmp_path_factory):
    return perturbed_copy(EXAMPLE_MHA8, tmp_path_factory.mktemp("differing") / "model", seed=1)


def _tensors(folder) -> dict[str, torch.Tensor]:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def _options(method: str, grouping: str, calib: bool, refine: bool) -> list[str]:
    return ["--method", method, "--grouping", grouping, *(CALIB if calib else []), *(REFINE if refine else [])]


@pytest.mark.parametrize("index", range(len(COMBINATIONS)),
                         ids=["-".join(map(str, c)) for c in COMBINATIONS])
def test_each_sweep_folder_is_the_plain_conversion_or_both_refuse_with_one_line(index, differing, tmp_path, capsys):
    options = _options(*COMBINATIONS[index])
    counts = COUNT_PAIRS[index % len(COUNT_PAIRS)]
    plain = {n: convert_main([str(differing), "--kv-heads", str(n), "--out", str(tmp_path / f"plain{n}"),
                              "--threads", "1", *options]) for n in counts}
    refused = capsys.readouterr().err
    out = tmp_path / "sweep"
    code = sweep_main([str(differing), "--data", str(VALID_TXT), "--stories", "1", "--threads", "1",
                       "--kv-heads", ",".join(map(str, counts)), "--out", str(out), *options])
    said = capsys.readouterr().err
    if set(plain.values()) == {2}:  # convert refuses: the sweep refuses with the same line, writes nothing
        assert code == 2 and said.count("\n") == 1 and said == refused.splitlines(keepends=True)[0], (said, refused)
        assert not out.exists()
        return
    assert set(plain.values()) == {0} and code == 0, (plain, code, refused, said)
    for n in counts:
        ours, theirs = _tensors(out / f"kv{n}"), _tensors(tmp_path / f"plain{n}")
        assert ours.keys() == theirs.keys()
        for key in ours:
            torch.testing.assert_close(ours[key], theirs[key], rtol=1e-6, atol=1e-7, msg=f"kv{n} {key} {options}")
    calibrated = "--calib" in options
    record = _record(out / f"kv{counts[0]}")
    assert (record.get("calibration") is not None) == (calibrated and _applies(*COMBINATIONS[index])), record
    for n in counts:  # --grouping similar --calib: each count's groupings measured as uptrain.convert measures them
        choice, plain_choice = _record(out / f"kv{n}")["grouping_choice"], _record(tmp_path / f"plain{n}")["grouping_choice"]
        assert choice == plain_choice
        assert (choice is not None) == (calibrated and "similar" in options), (n, choice)


def _applies(method: str, grouping: str, calib: bool, refine: bool) -> bool:
    return method == "fit" or grouping == "similar" or refine


def _record(folder) -> dict:
    import json

    return json.loads((folder / "uptrain_conversion.json").read_text())
