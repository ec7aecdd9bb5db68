"""The streaming shard writer against safetensors' own reader, its memory bound and its copy paths."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from uptrain.errors import UsageError
from uptrain.convert.io.source import TensorSpec
from uptrain.convert.io.shards import ShardWriter, finish_shards, plan_shards
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


def test_a_written_tensor_is_overwritten_in_place_and_nothing_else_changes(tmp_path):
    """`ShardWriter.overwrite` (the whole-model check writing mean pooling's start over the chosen one):
    every tensor of several shards, of every dtype, overwritten in turn reads back as the new value
    while every other tensor keeps its bytes; off-plan tensors and an open writer are refused."""
    gen = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(3, 5, generator=gen), "b.bf16": torch.randn(7, generator=gen).bfloat16(),
               "c.int": torch.arange(6).view(2, 3), "d.half": torch.randn(4, 4, generator=gen).half(),
               "e.big": torch.randn(300, generator=gen)}
    specs = [TensorSpec(n, tuple(t.shape), t.dtype).stored() for n, t in tensors.items()]
    writer = ShardWriter(tmp_path, specs, max_shard_bytes=64)
    for name, t in tensors.items():
        writer.write(name, t)
    with pytest.raises(RuntimeError, match="writer closed"):
        writer.overwrite("a", torch.zeros(3, 5))
    writer.close()
    want = dict(tensors)
    for name, t in tensors.items():
        new = (t.float() * -3 + 1).to(t.dtype)
        writer.overwrite(name, new)
        want[name] = new
        read = {k: v for f in writer.files for k, v in load_file(f).items()}
        assert all(torch.equal(read[k], want[k]) for k in want), name
    with pytest.raises(RuntimeError, match="does not match a planned tensor"):
        writer.overwrite("a", torch.zeros(5, 3))
    with pytest.raises(RuntimeError, match="does not match a planned tensor"):
        writer.overwrite("zz", torch.zeros(1))


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

    from uptrain.convert.io import shards
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




@pytest.mark.parametrize("write_behind", [True, False])
def test_runs_and_write_behind_write_the_same_bytes(tmp_path, monkeypatch, write_behind):
    """Tensors copied as runs (one kernel copy for several, split where the output shard changes)
    in small copy steps, with write-behind (its helper starting writeback and dropping cached
    windows) on or off, give the files that writing each tensor on its own gives."""
    from uptrain.convert.io import shards
    from uptrain.convert.io.passthrough import StoredRange, contiguous_runs, copy_tensors, stored_tensors

    tensors = {f"t{i}": torch.randn(n) for i, n in enumerate([3000, 1, 5000, 2048, 4096, 700, 9000])}
    src = tmp_path / "src"
    src.mkdir()
    ref = ShardWriter(src, [TensorSpec(n, tuple(t.shape), t.dtype).stored() for n, t in tensors.items()], 10**9)
    for name, t in tensors.items():
        ref.write(name, t)
    ref.close()
    finish_shards(src, [ref])
    listed = stored_tensors(src)
    kept = [t for t in listed if t.name != "t3"]  # a hole: two runs
    assert [len(r) for r in contiguous_runs(kept)] == [3, 3]

    monkeypatch.setattr(shards, "_COPY_STEP", 4096)
    monkeypatch.setattr(shards, "_WRITE_BEHIND", 8192)
    monkeypatch.setattr(shards, "_WRITE_BEHIND_LAG", 2)
    if not write_behind:
        monkeypatch.setattr(shards, "_SYNC_FILE_RANGE", None)
    specs = [StoredRange(t.name, t.shape, t.dtype) for t in kept]
    outs = {}
    for how in ("runs", "one by one"):
        out = tmp_path / how
        out.mkdir()
        writer = ShardWriter(out, specs, 30_000)  # shards end inside both runs
        if how == "runs":
            assert copy_tensors(kept, lambda run, fd: writer.copy_run(run, fd, run[0].offset))
        else:
            for t in kept:
                with open(t.file, "rb") as f:
                    writer.write(t.name, torch.frombuffer(bytearray(f.read()[t.offset:t.offset + t.nbytes]),
                                                          dtype=torch.float32))
        writer.close()
        assert len(writer.files) > 2
        outs[how] = [f.read_bytes() for f in writer.files]
    assert outs["runs"] == outs["one by one"]
    read = {}
    for f in (tmp_path / "runs").glob("*.safetensors"):
        read.update(load_file(f))
    assert read.keys() == {t.name for t in kept} and all(torch.equal(read[n], tensors[n]) for n in read)
