"""`--grouping similar`: the equal-group search (a property test over many matrices) and the
similarity it searches on (aligned for `fit`, plain for `mean`)."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import EXAMPLE_MHA8, TRAIN_TXT
from uptrain.convert.math import grouping
from uptrain.convert.math.fit import rotary_planes
from uptrain.convert.math.grouping import equal_groups, head_similarity
from uptrain.convert import RECORD_FILE
from uptrain.convert.__main__ import main


def objective(s: torch.Tensor, parts: list[list[int]]) -> float:
    """Total within-group similarity, summed in plain Python (an oracle independent of grouping.py)."""
    rows = s.double().tolist()
    return sum(rows[a][b] + rows[b][a] for p in parts for a, b in itertools.combinations(p, 2)) / 2


def best_swap_gain(s: torch.Tensor, parts: list[list[int]]) -> float:
    """The largest objective gain of exchanging two heads of different groups (plain Python)."""
    rows = s.double().tolist()
    sym = [[(rows[i][j] + rows[j][i]) / 2 for j in range(len(rows))] for i in range(len(rows))]
    best = float("-inf")
    for px, py in itertools.combinations(parts, 2):
        for a in px:
            for b in py:
                gain = (sum(sym[b][m] - sym[a][m] for m in px if m != a)
                        + sum(sym[a][m] - sym[b][m] for m in py if m != b))
                best = max(best, gain)
    return best


def check_partition(parts: list[list[int]], heads: int, groups: int, ordered: bool = True) -> None:
    assert len(parts) == groups and all(len(p) == heads // groups for p in parts), parts
    assert sorted(h for p in parts for h in p) == list(range(heads)), parts
    if ordered:  # the documented deterministic order of equal_groups
        assert parts == sorted(sorted(p) for p in parts)


def random_symmetric(n: int, gen: torch.Generator) -> torch.Tensor:
    a = torch.randn(n, n, generator=gen, dtype=torch.float64)
    return (a + a.T) / 2


def planted(n: int, groups: int, gen: torch.Generator, noise: float) -> tuple[torch.Tensor, list[list[int]]]:
    """Shuffled blocks of alike heads plus noise: block b holds heads perm[b*size:(b+1)*size]."""
    perm = torch.randperm(n, generator=gen).tolist()
    size = n // groups
    truth = sorted(sorted(perm[b * size:(b + 1) * size]) for b in range(groups))
    s = noise * random_symmetric(n, gen)
    for part in truth:
        s[torch.tensor(part)[:, None], torch.tensor(part)[None, :]] += 1.0
    return s, truth


def from_heads(n: int, gen: torch.Generator, aligned: bool) -> torch.Tensor:
    """The real use: head_similarity of random (low-dimensional, so correlated) heads."""
    hd, d = 8, 12
    basis = torch.randn(3, hd, d, generator=gen)
    mix = torch.randn(n, 3, generator=gen)
    wk = torch.einsum("nc,chd->nhd", mix, basis) + 0.3 * torch.randn(n, hd, d, generator=gen)
    wv = torch.einsum("nc,chd->nhd", mix.flip(1), basis) + 0.3 * torch.randn(n, hd, d, generator=gen)
    return head_similarity(wk, wv, torch.eye(d), aligned, rotary_planes(hd, False))


CASES = [(n, g) for n in (8, 16, 32, 40, 64) for g in (2, 4, 5, 8, 16) if n % g == 0 and n // g >= 2]


@pytest.mark.parametrize("heads,groups", CASES)
def test_search_returns_equal_groups_never_worse_than_greedy_and_locally_optimal(heads, groups):
    """Random symmetric, uniform, planted-block and real head-similarity matrices: always a partition
    into equal groups, at least the greedy start's objective, and no exchange of two heads helps."""
    gen = torch.Generator().manual_seed(heads * 100 + groups)
    matrices = [random_symmetric(heads, gen) for _ in range(4)]
    matrices += [torch.rand(heads, heads, generator=gen, dtype=torch.float64) for _ in range(2)]  # not symmetric
    matrices += [planted(heads, groups, gen, noise)[0] for noise in (0.1, 0.5)]
    matrices += [from_heads(heads, gen, aligned) for aligned in (False, True)]
    matrices += [torch.ones(heads, heads), torch.zeros(heads, heads)]  # all ties
    improved = 0
    for s in matrices:
        parts = equal_groups(s, groups)
        check_partition(parts, heads, groups)
        start = grouping.greedy_groups(s, groups)
        check_partition(start, heads, groups, ordered=False)
        assert objective(s, parts) >= objective(s, start) - 1e-9
        assert best_swap_gain(s, parts) <= 1e-9 * max(1.0, s.abs().max().item())
        improved += objective(s, parts) > objective(s, start) + 1e-9
        assert equal_groups(s, groups) == parts  # deterministic
    if heads >= 16:
        assert improved > 0  # the swap pass does something on these matrices


@pytest.mark.parametrize("heads,groups", [(16, 2), (32, 4), (40, 8), (64, 8), (64, 16)])
def test_planted_groups_come_back(heads, groups):
    gen = torch.Generator().manual_seed(heads + groups)
    s, truth = planted(heads, groups, gen, noise=0.1)
    assert equal_groups(s, groups) == truth


def hubs(blocks: int) -> tuple[torch.Tensor, float]:
    """Blocks of 4 heads (a, b, c, d), groups of 2: s(a, ·) = 3, s(b, c) = 5, zero elsewhere.

    Greedy seeds the hub a (row sum 9) and pairs it with b (first of a three-way tie), leaving
    {c, d} at 0: 3 per block. The best pairing per block is {a, d}, {b, c}: 8, and pairs across
    blocks score 0, so the optimum is 8 per block; one exchange (b <-> d) gets there.
    """
    s = torch.zeros(4 * blocks, 4 * blocks, dtype=torch.float64)
    for k in range(blocks):
        a, b, c, d = range(4 * k, 4 * k + 4)
        s[a, [b, c, d]] = s[[b, c, d], a] = 3.0
        s[b, c] = s[c, b] = 5.0
    return s, 8.0 * blocks


@pytest.mark.parametrize("blocks", [2, 4, 8, 16])
def test_the_swap_pass_reaches_the_optimum_where_greedy_does_not(blocks):
    s, optimum = hubs(blocks)
    parts = equal_groups(s, 2 * blocks)
    check_partition(parts, 4 * blocks, 2 * blocks)
    assert objective(s, parts) == optimum
    assert objective(s, grouping.greedy_groups(s, 2 * blocks)) < optimum


def test_brute_force_optimum_on_small_structured_matrices():
    """8 heads in 2 groups: 35 partitions. Planted structure is found exactly."""
    gen = torch.Generator().manual_seed(7)
    for _ in range(20):
        s, truth = planted(8, 2, gen, noise=0.2)
        best = max((objective(s, [list(c), [h for h in range(8) if h not in c]]), sorted(c))
                   for c in itertools.combinations(range(8), 4) if 0 in c)
        assert objective(s, equal_groups(s, 2)) == pytest.approx(best[0])


def all_partitions(heads: int, groups: int) -> list[list[list[int]]]:
    """Every split of range(heads) into `groups` equal groups, in `equal_groups`' form (brute force)."""
    size = heads // groups

    def rest(left: list[int]):
        if not left:
            yield []
            return
        for others in itertools.combinations(left[1:], size - 1):
            part = [left[0], *others]
            for tail in rest([h for h in left if h not in part]):
                yield [part, *tail]
    return list(rest(list(range(heads))))


@pytest.mark.parametrize("heads,groups", CASES)
def test_candidates_are_distinct_local_optima_the_similarity_best_first(heads, groups):
    """At real head counts (32, 40, 64) and small ones, on random, planted, real-head and all-tie
    matrices: every candidate is an equal partition in `equal_groups`' form, none repeats, the first is
    `equal_groups`', the others come by objective (highest first) and no single exchange improves any."""
    gen = torch.Generator().manual_seed(heads * 7 + groups)
    matrices = [random_symmetric(heads, gen) for _ in range(2)]
    matrices += [torch.rand(heads, heads, generator=gen, dtype=torch.float64)]  # not symmetric
    matrices += [planted(heads, groups, gen, 0.5)[0], from_heads(heads, gen, True), torch.ones(heads, heads)]
    several = 0
    for s in matrices:
        tol = 1e-9 * max(1.0, s.abs().max().item())
        found = grouping.candidate_groups(s, groups, 4)
        assert 1 <= len(found) <= 4
        assert found[0] == equal_groups(s, groups)
        assert len({repr(p) for p in found}) == len(found)
        for parts in found:
            check_partition(parts, heads, groups)
            assert best_swap_gain(s, parts) <= tol
        scores = [objective(s, p) for p in found[1:]]
        assert scores == sorted(scores, reverse=True)
        assert grouping.candidate_groups(s, groups, 4) == found  # deterministic
        assert grouping.candidate_groups(s, groups, 1) == [found[0]]
        several += len(found) > 1
    assert several > 0  # the random matrices have more than one local optimum: the case is a real test


@pytest.mark.parametrize("heads,groups", [(8, 2), (8, 4), (9, 3), (12, 2), (12, 3)])
def test_candidates_hold_the_brute_force_optimum_that_the_search_alone_misses(heads, groups):
    """Brute force over every equal partition (35 to 5,775) of 40 random matrices: the best partition
    is always among 3 candidates, while `equal_groups` alone misses it on some (so the extra searches
    are what finds it)."""
    every = all_partitions(heads, groups)
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    missed = 0
    for _ in range(40):
        s = random_symmetric(heads, gen)
        best = max(every, key=lambda p: objective(s, p))
        found = grouping.candidate_groups(s, groups, 3)
        assert objective(s, best) == pytest.approx(max(objective(s, p) for p in found))
        missed += objective(s, equal_groups(s, groups)) < objective(s, best) - 1e-9
    assert missed > 0


def test_candidates_of_paired_heads_are_the_pairings():
    """stories260K-mha8's case: 8 heads made from 4 K/V heads (each repeated twice) into 2 groups. The
    partitions no exchange improves keep the copies together; the candidates are such pairings."""
    gen = torch.Generator().manual_seed(11)
    pairs = [[0, 1], [2, 3], [4, 5], [6, 7]]
    for _ in range(20):
        between = 0.6 + 0.3 * torch.rand(4, 4, generator=gen, dtype=torch.float64)
        s = (between + between.T)[torch.arange(8) // 2][:, torch.arange(8) // 2] / 2
        s[torch.arange(8), torch.arange(8) ^ 1] = 2.0  # a head and its copy: the maximum
        for parts in grouping.candidate_groups(s, 2, 3):
            assert all(sorted(p) == sorted(sum((pair for pair in pairs if pair[0] in p), [])) for p in parts)


def test_candidate_count_must_be_positive():
    with pytest.raises(ValueError, match="at least 1"):
        grouping.candidate_groups(torch.zeros(8, 8), 2, 0)


def test_uneven_split_is_refused():
    with pytest.raises(ValueError, match="do not split"):
        equal_groups(torch.zeros(6, 6), 4)


# ------------------------------------------------------------------ the similarity: aligned for fit


def transformed(k: torch.Tensor, v: torch.Tensor, planes: tuple[torch.Tensor, torch.Tensor],
                gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """What `fit` aligns away: key rows [hd, D] rotated and scaled within each rotary plane (a complex
    scale per plane), value rows [hd, D] mixed by a random invertible matrix."""
    first, second = planes
    scale = torch.polar(0.3 + 2.7 * torch.rand(len(first), generator=gen, dtype=torch.float64),
                        2 * torch.pi * torch.rand(len(first), generator=gen, dtype=torch.float64))
    plane = torch.complex(k[first].double(), k[second].double()) * scale[:, None]
    k2 = k.double().clone()
    k2[first], k2[second] = plane.real, plane.imag
    mix = torch.randn(len(v), len(v), generator=gen, dtype=torch.float64) + 2 * torch.eye(len(v), dtype=torch.float64)
    return k2, mix @ v.double()


@pytest.mark.parametrize("interleaved", [False, True])
def test_aligned_similarity_sees_through_what_fit_aligns(interleaved):
    """A head transformed within its rotary planes (keys) and by a value mix is, for `fit`, as alike
    to its original as the original to itself (the maximum, 2); plain cosine (for mean) says it is not."""
    gen = torch.Generator().manual_seed(3)
    hd, d = 8, 12
    planes = rotary_planes(hd, interleaved)
    k, v = torch.randn(2, hd, d, generator=gen, dtype=torch.float64), torch.randn(2, hd, d, generator=gen,
                                                                                 dtype=torch.float64)
    k1, v1 = transformed(k[0], v[0], planes, gen)
    wk, wv = torch.stack([k[0], k1, k[1]]), torch.stack([v[0], v1, v[1]])
    x = torch.randn(200, d, generator=gen, dtype=torch.float64)
    for sigma in (torch.eye(d, dtype=torch.float64), x.T @ x / len(x)):  # without and with calibration
        aligned = head_similarity(wk, wv, sigma, True, planes)
        plain = head_similarity(wk, wv, sigma, False, planes)
        torch.testing.assert_close(aligned[0, 0], torch.tensor(2.0, dtype=torch.float64))
        torch.testing.assert_close(aligned[0, 1], aligned[0, 0])  # the transformed copy: as alike as itself
        torch.testing.assert_close(aligned, aligned.T)
        assert aligned[0, 2] < 1.9  # a different head is not
        assert plain[0, 1] < 1.5  # as-is, the copy does not look alike: the case is a real test


def planted_transformed(heads: int, groups: int, hd: int, d: int, interleaved: bool, gen: torch.Generator
                        ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """[heads, hd, d] keys and values: `groups` random heads, each copied heads/groups times with a
    different `transformed`, shuffled; returns them and the true groups."""
    planes = rotary_planes(hd, interleaved)
    owner = torch.randperm(heads, generator=gen) % groups
    base_k, base_v = torch.randn(2, groups, hd, d, generator=gen, dtype=torch.float64)
    pairs = [transformed(base_k[o], base_v[o], planes, gen) for o in owner.tolist()]
    truth = sorted(sorted(torch.nonzero(owner == o)[:, 0].tolist()) for o in range(groups))
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs]), truth


@pytest.mark.parametrize("heads,groups", [(8, 2), (32, 8), (64, 4)])
def test_fit_grouping_puts_transformed_copies_together(heads, groups):
    gen = torch.Generator().manual_seed(heads)
    for interleaved in (False, True):
        wk, wv, truth = planted_transformed(heads, groups, 8, 24, interleaved, gen)
        sim = head_similarity(wk, wv, torch.eye(24), True, rotary_planes(8, interleaved))
        assert equal_groups(sim, groups) == truth


@pytest.mark.parametrize("model_type,interleaved", [("llama", False), ("cohere", True)])
def test_convert_fit_similar_groups_planted_heads(tmp_path, model_type, interleaved):
    """Through a conversion: a model whose K/V heads are transformed copies of 2 heads per layer
    (shuffled) is grouped by `--method fit --grouping similar` into exactly those copies."""
    from transformers import AutoConfig

    from tiny import random_model, save
    heads, hd = 8, 8
    cfg = AutoConfig.for_model(model_type, hidden_size=heads * hd, head_dim=hd, num_attention_heads=heads,
                               num_key_value_heads=heads, num_hidden_layers=2, intermediate_size=32,
                               vocab_size=128, max_position_embeddings=64)
    model = random_model(cfg)
    gen = torch.Generator().manual_seed(5)
    truths = {}
    for i, layer in enumerate(model.model.layers):
        attn = layer.self_attn
        wk, wv, truths[f"model.layers.{i}.self_attn."] = planted_transformed(heads, 2, hd, heads * hd,
                                                                              interleaved, gen)
        with torch.no_grad():
            attn.k_proj.weight.copy_(wk.reshape(heads * hd, -1))
            attn.v_proj.weight.copy_(wv.reshape(heads * hd, -1))
    src = save(model, tmp_path / "src")
    from uptrain.convert import convert
    convert(str(src), tmp_path / "out", 2, "fit", grouping="similar")
    orders = json.loads((tmp_path / "out" / RECORD_FILE).read_text())["head_order"]
    assert {name: sorted([sorted(o[:4]), sorted(o[4:])]) for name, o in orders.items()} == truths


# ------------------------------------------------------------------ the real reference model, end to end

REFERENCE = Path(__file__).resolve().parents[2] / "results" / "paper" / "reference-mha8"


@pytest.mark.parametrize("kv", [4, 2])
def test_cli_groups_the_reference_model_by_similarity(tmp_path, capsys, kv):
    """The paper-reproduction model (8 heads, 4 layers) whose head similarities made the old swap pass
    crash ('3 is not in list' at kv 4, '6 is not in list' at kv 2): kv 4 in a real process."""
    out = tmp_path / "out"
    argv = [str(REFERENCE), "--kv-heads", str(kv), "--method", "mean", "--grouping", "similar", "--out", str(out)]
    if kv == 4:
        proc = subprocess.run([sys.executable, "-m", "uptrain.convert", *argv], capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr[-2000:]
    else:
        assert main(argv) == 0, capsys.readouterr().err[-2000:]
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["grouping"] == "similar"
    orders = record["head_order"]
    assert len(orders) == 4 and all(sorted(o) == list(range(8)) for o in orders.values())
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == kv


# ------------------------------------------------------------------ with --calib: the grouping measured among candidates

def _stories_similar(out: Path, *extra: str) -> int:
    return main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--grouping", "similar", "--calib",
                 str(TRAIN_TXT), "--calib-tokens", "16384", "--threads", "1", "--out", str(out), *extra])


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_convert_writes_each_layers_candidate_grouping_of_lowest_measured_error(tmp_path, monkeypatch):
    """stories260K-mha8 -> 2 K/V heads on the shipped stories: every layer's candidates are measured and the
    one of lowest output error is written (layers 0 and 4 leave the similarity's best,
    results/grouping-choice.md); the written tensors are bit for bit the start made in the recorded
    head orders with nothing else measured, so the record says what was written."""
    from uptrain.convert.layers import layer_outputs
    assert _stories_similar(tmp_path / "chosen") == 0
    record = json.loads((tmp_path / "chosen" / RECORD_FILE).read_text())
    choice = record["grouping_choice"]
    assert sorted(map(int, choice)) == list(range(5))
    for c in choice.values():
        if c["errors"] is not None:
            assert len(c["errors"]) > 1 and c["chosen"] == c["errors"].index(min(c["errors"]))
    assert sorted(int(i) for i, c in choice.items() if c["chosen"]) == [0, 4]  # the choice did something
    assert any(n.startswith("head grouping chosen per layer") and "layers 0, 4" in n for n in record["notes"])
    orders = record["head_order"]
    monkeypatch.setattr(layer_outputs, "candidate_orders", lambda *a: [orders[a[6]]])  # a[6]: the layer prefix
    assert _stories_similar(tmp_path / "forced") == 0
    ours, forced = _weights(tmp_path / "chosen"), _weights(tmp_path / "forced")
    assert ours.keys() == forced.keys() and all(torch.equal(ours[k], forced[k]) for k in ours)
    assert json.loads((tmp_path / "forced" / RECORD_FILE).read_text())["head_order"] == orders


def test_one_candidate_is_the_similaritys_best_alone_and_none_is_refused(tmp_path, capsys):
    """`--group-candidates 1`: nothing measured, the similarity's best written (layer 0 as the search
    alone groups it, not as the measured choice does); 0 is refused in one line, nothing written."""
    from uptrain.convert.layers.layerwise import GROUP_CANDIDATES
    from uptrain.convert.options import DEFAULT_GROUP_CANDIDATES
    assert GROUP_CANDIDATES == DEFAULT_GROUP_CANDIDATES
    assert _stories_similar(tmp_path / "one", "--group-candidates", "1") == 0
    record = json.loads((tmp_path / "one" / RECORD_FILE).read_text())
    assert record["grouping_choice"] is None
    assert record["head_order"]["model.layers.0.self_attn."] == [0, 1, 4, 5, 2, 3, 6, 7]  # the search's partition
    capsys.readouterr()
    assert _stories_similar(tmp_path / "none", "--group-candidates", "0") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--group-candidates must be at least 1" in err
    assert not (tmp_path / "none").exists()


def test_without_calibration_the_similarity_alone_groups(tmp_path):
    """No --calib: nothing to measure on, so no choice is recorded (the similarity's best, as before)."""
    out = tmp_path / "out"
    assert main([str(EXAMPLE_MHA8), "--kv-heads", "2", "--method", "fit", "--grouping", "similar", "--threads", "1",
                 "--out", str(out)]) == 0
    record = json.loads((out / RECORD_FILE).read_text())
    assert record["grouping_choice"] is None and len(record["head_order"]) == 5
