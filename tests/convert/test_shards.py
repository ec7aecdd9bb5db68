"""The streaming shard writer against safetensors' own reader, and the all-or-nothing output folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from uptrain.errors import UsageError
from uptrain.convert.source import TensorSpec
from uptrain.convert.shards import ShardWriter, atomic_output_dir, finish_shards, plan_shards
from uptrain.units import parse_size


def test_written_shards_read_back_with_safetensors(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b.bf16": torch.randn(7).bfloat16(), "c.int": torch.arange(6).view(2, 3),
               "d.scalar": torch.tensor(2.5), "e.bool": torch.tensor([True, False, True]),
               "f.half": torch.randn(4, 4).half(), "g.empty": torch.zeros(0, 3)}
    specs = [TensorSpec(n, tuple(t.shape), t.dtype).stored() for n, t in tensors.items()]
    writer = ShardWriter(tmp_path, specs, max_shard_bytes=64)
    for name, t in tensors.items():
        writer.write(name, t)
    writer.close()
    finish_shards(tmp_path, [writer])
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == len(writer.shards) > 1
    read = {}
    for shard in set(index["weight_map"].values()):
        read.update(load_file(tmp_path / shard))
        with safe_open(tmp_path / shard, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    assert read.keys() == tensors.keys()
    for name, t in tensors.items():
        assert read[name].dtype == t.dtype and torch.equal(read[name], t), name


def test_writer_refuses_tensors_off_plan(tmp_path):
    writer = ShardWriter(tmp_path, [TensorSpec("a", (2,), torch.float32).stored()], 100)
    with pytest.raises(RuntimeError, match="does not match the plan"):
        writer.write("a", torch.zeros(3))
    with pytest.raises(RuntimeError, match="wrote 0 of 1"):
        writer.close()


def test_plan_shards_keeps_order_and_limit():
    specs = [TensorSpec(str(i), (n,), torch.float32).stored() for i, n in enumerate([10, 10, 30, 5, 5])]
    shards = plan_shards(specs, max_shard_bytes=80)
    assert [[s.name for s in shard] for shard in shards] == [["0", "1"], ["2"], ["3", "4"]]


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9 and parse_size("2GiB") == 2 * 2**30 and parse_size("100") == 100
    assert parse_size("0.5MB") == 500_000
    for bad in ("lots", "5XB", "0", "-1GB"):
        with pytest.raises(UsageError):
            parse_size(bad)


def test_atomic_output_dir_leaves_nothing_on_failure_and_keeps_the_old_output(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(OSError):
        with atomic_output_dir(out) as tmp:
            (tmp / "half.safetensors").write_bytes(b"x")
            raise OSError(28, "No space left on device")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"] and (out / "old.txt").exists()
    with atomic_output_dir(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


MEMORY_CFG = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                  num_key_value_heads=16, vocab_size=2048)
LARGEST = 2816 * 1024 * 4  # one float32 MLP weight


def peak_growth(src: Path, tmp_path: Path) -> int:
    """Convert `src` in a fresh process; how far its peak RSS (VmHWM) rises over a warmed-up baseline."""
    from transformers import LlamaConfig

    from tiny import random_model, save
    small = save(random_model(LlamaConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=16, vocab_size=64)), tmp_path / "small")
    # VmHWM is this process's own peak: ru_maxrss of a forked child would start at pytest's RSS
    script = textwrap.dedent(f"""
        from pathlib import Path
        from uptrain.convert import convert
        def peak():
            return int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) * 1024
        # warm up on a tiny model: first-use imports are not the conversion's working set
        convert("{small}", Path("{tmp_path / 'warm'}"), 4)
        base = peak()
        convert("{src}", Path("{tmp_path / 'out'}"), 4, max_shard_size="100MB")
        print(peak() - base)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return int(proc.stdout.strip().splitlines()[-1])


def test_conversion_memory_stays_near_the_largest_tensor(tmp_path):
    """Convert a 420 MB, 5-shard checkpoint; the converter's peak RSS grows by about one tensor."""
    from transformers import LlamaConfig

    from tiny import random_model, save
    src = save(random_model(LlamaConfig(**MEMORY_CFG)), tmp_path / "src", max_shard_size="100MB")
    total = sum(f.stat().st_size for f in src.glob("*.safetensors"))
    growth = peak_growth(src, tmp_path)
    assert total > 400e6 and len(list((tmp_path / "out").glob("*.safetensors"))) > 3
    assert growth < 3 * LARGEST + 32 * 2**20, f"peak RSS grew {growth / 2**20:.0f} MiB; largest tensor " \
                                              f"{LARGEST / 2**20:.0f} MiB, checkpoint {total / 2**20:.0f} MiB"


def test_bin_conversion_memory_stays_near_the_largest_tensor(tmp_path):
    """The same bound for a 420 MB checkpoint in 5 `.bin` files (pytorch_model.bin.index.json)."""
    from transformers import LlamaConfig

    from tiny import random_model
    model = random_model(LlamaConfig(**MEMORY_CFG))
    src = tmp_path / "src"
    src.mkdir()
    model.config.save_pretrained(src)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    del model
    names = list(state)
    files, weight_map = 5, {}
    for i in range(files):
        file = f"pytorch_model-{i + 1:05d}-of-{files:05d}.bin"
        part = {n: state[n] for n in names[i * len(names) // files:(i + 1) * len(names) // files]}
        torch.save(part, src / file)
        weight_map |= dict.fromkeys(part, file)
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    total = sum(f.stat().st_size for f in src.glob("*.bin"))
    del state, part
    growth = peak_growth(src, tmp_path)
    assert total > 400e6 and len(list((tmp_path / "out").glob("*.safetensors"))) > 3
    assert growth < 3 * LARGEST + 32 * 2**20, f"peak RSS grew {growth / 2**20:.0f} MiB; largest tensor " \
                                              f"{LARGEST / 2**20:.0f} MiB, checkpoint {total / 2**20:.0f} MiB"


@pytest.mark.parametrize("available", [("copy_file_range", "sendfile"), ("sendfile",), ()])
def test_copy_range_by_every_path(tmp_path, monkeypatch, available):
    """The kernel copy, sendfile and the portable read/write loop append the same bytes."""
    import os

    from uptrain.convert import shards
    for name in ("copy_file_range", "sendfile"):
        if name not in available and hasattr(os, name):
            monkeypatch.delattr(os, name)
    monkeypatch.setattr(shards, "_CHUNK", 4096)  # several calls per range
    monkeypatch.setattr(shards, "_COPY_CHUNK", 4096)
    data = os.urandom(50_000)
    (tmp_path / "src").write_bytes(data)
    src = os.open(tmp_path / "src", os.O_RDONLY)
    dst = os.open(tmp_path / "dst", os.O_WRONLY | os.O_CREAT)
    try:
        os.write(dst, b"head")
        shards.copy_range(src, dst, 123, 30_000)
        shards.copy_range(src, dst, 0, 5)
        with pytest.raises(OSError, match="early"):
            shards.copy_range(src, dst, 49_990, 20)
    finally:
        os.close(src)
        os.close(dst)
    assert (tmp_path / "dst").read_bytes()[:30_009] == b"head" + data[123:30_123] + data[:5]


# ------------------------------------------------------------------ --force killed in the middle of the swap

SWAP_SCRIPT = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from uptrain.convert import shards
    out, mode = Path(sys.argv[1]).resolve(), sys.argv[2]
    if mode.startswith("two-step"):  # as where the OS or filesystem has no atomic exchange
        shards.exchange_paths = lambda a, b: False

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    real_rename, real_rmtree = os.rename, shutil.rmtree

    def rename(a, b, *args, **kwargs):  # Path.rename calls os.rename
        if (mode == "two-step-between" and Path(b) == out) or (mode == "two-step-first" and Path(a) == out):
            die()  # two-step-between: the old output is already moved aside, the new one not yet in place
        if mode == "exchange" and Path(a) == out:
            sys.exit(3)  # the two-step fallback was taken: not what this mode tests
        return real_rename(a, b, *args, **kwargs)

    def rmtree(path, *args, **kwargs):
        if mode in ("exchange", "two-step-last"):
            die()  # the new output is in place; the old one is not removed yet
        return real_rmtree(path, *args, **kwargs)
    os.rename, shutil.rmtree = rename, rmtree
    with shards.atomic_output_dir(out) as tmp:
        (tmp / "model.txt").write_text("new")
        if mode == "writing":
            die()
""")


def killed_swap(tmp_path: Path, mode: str) -> Path:
    """An existing output `out` (old.txt), replaced by a process SIGKILLed at `mode`."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    proc = subprocess.run([sys.executable, "-c", SWAP_SCRIPT, str(out), mode], capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr  # it died where it was told to
    return out


def contents(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def exchange_supported(tmp_path: Path) -> bool:
    from uptrain.convert import shards
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir()
    b.mkdir()
    try:  # (before the fix there was no exchange_paths: run the test, it must fail)
        return bool(getattr(shards, "exchange_paths", lambda a, b: True)(a, b))
    finally:
        a.rmdir()
        b.rmdir()


@pytest.mark.parametrize("mode,expect", [("two-step-between", "new"), ("two-step-first", "old"),
                                         ("two-step-last", "new"), ("exchange", "new"), ("writing", "old")])
def test_a_kill_during_the_swap_leaves_old_or_new_and_the_next_run_cleans_up(tmp_path, mode, expect):
    """SIGKILL at each step of replacing an existing output: the next run (here its first step,
    check_output_path, which refuses to replace without --force) finds `out` whole, old or new, and
    no hidden leftovers; a run after that replaces it normally."""
    from uptrain.convert.shards import check_output_path
    if mode == "exchange" and sys.platform.startswith("linux") and not exchange_supported(tmp_path):
        pytest.skip("this filesystem has no renameat2(RENAME_EXCHANGE)")
    out = killed_swap(tmp_path, mode)
    src = tmp_path / "src"
    src.mkdir()
    with pytest.raises(UsageError, match="already exists"):
        check_output_path(out, src, force=False)
    assert contents(out) == ({"model.txt": "new"} if expect == "new" else {"old.txt": "old"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]
    with atomic_output_dir(out) as tmp:
        (tmp / "again.txt").write_text("again")
    assert contents(out) == {"again.txt": "again"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_recovery_restores_an_old_output_alone_and_leaves_live_runs_alone(tmp_path):
    """No `out` and only the moved-aside old output (a name without PID, as older versions wrote it):
    it is put back. Folders of a live process (here this one) are not touched."""
    from uptrain.convert.shards import recover_output
    out = tmp_path / "out"
    old = tmp_path / ".out.old-deadbeef"
    old.mkdir()
    (old / "old.txt").write_text("old")
    recover_output(out)
    assert contents(out) == {"old.txt": "old"} and sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    out.rename(tmp_path / "elsewhere")
    live = tmp_path / f".out.complete-{os.getpid()}-0000abcd"
    live.mkdir()
    recover_output(out)
    assert not out.exists() and live.is_dir()


def test_exchange_paths_swaps_two_folders(tmp_path):
    from uptrain.convert.shards import exchange_paths
    a, b = tmp_path / "a", tmp_path / "b"
    for folder in (a, b):
        folder.mkdir()
        (folder / "name.txt").write_text(folder.name)
    if not exchange_paths(a, b):
        pytest.skip("no renameat2(RENAME_EXCHANGE) here: the two-step path is used (tested above)")
    assert (a / "name.txt").read_text() == "b" and (b / "name.txt").read_text() == "a"
