"""The teacher's outputs kept for blocks read again (uptrain/train/model/teacher_cache.py): the cache on
random and structured batches, its automatic budget, and the trainer with it: the same losses as without
(to float16's rounding of the targets), and a resumed run (its cache empty) the same as one that never stopped."""

from __future__ import annotations

import random
import shutil

import pytest
import torch

from train_helpers import fresh_accelerate_state  # noqa: F401 (autouse fixture)
from train_helpers import DEMO, GQA4, MHA8, need_models, tiny_overrides, train_losses
from conftest import VALID_TXT
from uptrain.train import train
from uptrain.train.config import load_config
from uptrain.train.model.losses import kd_loss_sum
from uptrain.train.model.teacher_cache import AUTO_MEMORY_SHARE, TeacherCache, cache_budget
from uptrain.train.state.run_files import complete_checkpoints


class _Teacher:
    """A fixed random function of the block: logits [batch, seq, vocab] from each row's tokens (seeded by
    them, so a row's logits do not depend on its batch), and a count of the forwards asked for."""

    def __init__(self, vocab: int, scale: float):
        self.vocab, self.scale, self.calls = vocab, scale, 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        rows = [torch.randn(ids.size(1), self.vocab, generator=torch.Generator().manual_seed(hash(tuple(r.tolist()))))
                for r in ids]
        return torch.stack(rows) * self.scale


def _cases():
    rng = random.Random(0)
    for vocab, seq, batch in ((512, 128, 8), (32000, 16, 4), (50, 64, 2), (2, 3, 1)):  # structured: real vocabularies
        yield rng, vocab, seq, batch, 10.0
    for _ in range(25):  # random shapes, logit scales from flat to peaked
        yield rng, rng.choice([7, 64, 512, 4096]), rng.randint(1, 40), rng.randint(1, 6), rng.choice([0.1, 3.0, 30.0])


@pytest.mark.parametrize("case", range(29))
def test_a_block_read_again_gets_the_same_rounded_targets_without_a_forward(case):
    rng, vocab, seq, batch, scale = list(_cases())[case]
    teacher, same = _Teacher(vocab, scale), _Teacher(vocab, scale)
    pool = torch.randint(0, vocab, (3 * batch, seq), generator=torch.Generator().manual_seed(case))
    cache, seen, first = TeacherCache(max_bytes=10**12), set(), {}
    for _ in range(12):
        rows = [rng.randrange(len(pool)) for _ in range(batch)]
        if rng.random() < 0.2:  # a block that differs from a kept one in a single token is another block
            pool[rows[0], rng.randrange(seq)] = (pool[rows[0], 0] + 1) % vocab
        ids = pool[rows].clone()
        calls, all_seen = teacher.calls, all(tuple(r.tolist()) in seen for r in ids)
        out = cache.log_probs(ids, lambda: teacher(ids))
        assert teacher.calls == calls + (not all_seen)  # a forward exactly when some row is new
        expect = torch.log_softmax(same(ids).float(), -1).half().float()
        assert out.dtype == torch.float32 and out.shape == (batch, seq, vocab)
        assert torch.equal(out, expect)  # whether from memory or not: float16-rounded log-probabilities
        for r, row in zip(ids, out):
            key = tuple(r.tolist())
            assert torch.equal(first.setdefault(key, row), row)  # every reading of a block: the same targets
            seen.add(key)
    assert cache.bytes == len(cache.blocks) * seq * vocab * 2 and len(cache.blocks) == len(seen)


def test_the_targets_keep_the_kl_to_float16_rounding():
    """The cached log-probabilities give the KL of the teacher's logits (the shift by log Z cancels) to
    float16's rounding, at temperatures 1 and 2, on the bundled vocabulary and a real one's."""
    gen = torch.Generator().manual_seed(0)
    for vocab in (512, 32000):
        student, logits = torch.randn(4, 32, vocab, generator=gen) * 3, torch.randn(4, 32, vocab, generator=gen) * 8
        cached = TeacherCache(10**12).log_probs(torch.zeros(4, 32, dtype=torch.long), lambda: logits)
        for t in (1.0, 2.0):
            exact = kd_loss_sum(student, logits, t).item()
            assert kd_loss_sum(student, cached, t).item() == pytest.approx(exact, rel=2e-4)


def test_the_cache_keeps_blocks_only_while_its_budget_lasts():
    block = 16 * 100 * 2  # bytes of one block's float16 log-probabilities
    cache, teacher = TeacherCache(max_bytes=5 * block + block // 2), _Teacher(100, 1.0)
    for start in range(0, 12, 3):
        ids = torch.arange(start, start + 3).repeat_interleave(16).view(3, 16)
        cache.log_probs(ids, lambda: teacher(ids))
    assert len(cache.blocks) == 5 and cache.bytes == 5 * block <= cache.max_bytes
    ids = torch.arange(0, 3).repeat_interleave(16).view(3, 16)  # kept: no forward
    calls = teacher.calls
    cache.log_probs(ids, lambda: teacher(ids))
    assert teacher.calls == calls and cache.hits == 3
    assert TeacherCache(0).log_probs(ids, lambda: teacher(ids)).shape == (3, 16, 100)  # a budget of 0 keeps none


def test_the_automatic_budget():
    gb = 10**9
    assert cache_budget(None, on_cpu=True, reads_again=True, available_bytes=20 * gb) == int(20 * gb * AUTO_MEMORY_SHARE)
    assert cache_budget(None, True, True, 20 * gb, processes=2) == int(20 * gb * AUTO_MEMORY_SHARE / 2)
    assert cache_budget(None, on_cpu=False, reads_again=True, available_bytes=20 * gb) == 0  # a GPU's teacher is cheap
    assert cache_budget(None, on_cpu=True, reads_again=False, available_bytes=20 * gb) == 0  # nothing read twice
    assert cache_budget(None, True, True, None) == 0  # memory unknown
    assert cache_budget(1.5, on_cpu=False, reads_again=False, available_bytes=None) == int(1.5 * gb)  # asked for
    assert cache_budget(0.0, True, True, 20 * gb) == 0


def _runs_overrides(run_dir, **extra):
    # 242 blocks of 64 tokens read 2.6 times (80 steps x 8 blocks), distilled at alpha_kd 0.5
    return tiny_overrides(run_dir, steps=80, **{"data.train.files": f"[{VALID_TXT}]", "data.repeat_data": "true",
                                                "distill.teacher": MHA8, "distill.alpha_kd": 0.5, "threads": 1,
                                                "checkpoint.every": 16, "checkpoint.keep": 5, **extra})


def test_the_trainer_reads_blocks_again_from_the_cache_and_resumes_to_the_same_losses(tmp_path, capsys):
    need_models()
    cached_dir, off_dir = tmp_path / "cached", tmp_path / "off"
    train(load_config(DEMO, _runs_overrides(cached_dir)))
    out = capsys.readouterr().out
    assert "teacher cache: the source's log-probabilities of each block kept" in out
    hits = int(out.split("teacher cache: ")[-1].split("%")[0])
    assert hits == round(100 * (640 - 242) / 640), out  # every block's second and third readings
    train(load_config(DEMO, _runs_overrides(off_dir, **{"distill.teacher_cache_gb": 0})))
    assert "teacher cache" not in capsys.readouterr().out
    cached, off = train_losses(cached_dir), train_losses(off_dir)
    assert sorted(cached) == sorted(off) == list(range(1, 81))
    for step in cached:  # the same run, to float16's rounding of the targets
        assert cached[step] == pytest.approx(off[step], abs=2e-4), step

    # Stopped after step 16 (in the first reading) or 48 (in the second), its later checkpoints and end removed:
    # the rerun's cache starts empty, so the blocks read again after that are the teacher's once more, rounded the
    # same way, whichever reading the stop fell in.
    for kept, stop in ((1, 16), (3, 48)):
        resumed_dir = tmp_path / f"resumed-{stop}"
        shutil.copytree(cached_dir, resumed_dir)
        for later in complete_checkpoints(resumed_dir)[kept:]:
            shutil.rmtree(later)
        shutil.rmtree(resumed_dir / "model")
        (resumed_dir / "finished.json").unlink()
        train(load_config(DEMO, _runs_overrides(resumed_dir, **{"resume": "latest"})))
        assert f"at step {stop}" in capsys.readouterr().out
        resumed = train_losses(resumed_dir)
        assert sorted(resumed) == list(range(1, 81))
        for step in range(stop + 1, 81):
            assert resumed[step] == pytest.approx(cached[step], abs=1e-6), (stop, step)
