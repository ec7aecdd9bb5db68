"""Applying a registry `Family` to a checkpoint's tensor list: what each output tensor is made of.

`plan_outputs` turns source tensor metadata into an ordered list of `OutputTensor`s (name, shape,
dtype, the source tensors it needs and a function that makes it), validating every K/V tensor
against the config first. Nothing here reads files; the converter feeds tensors in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from uptrain.convert.registry.architectures import Family, KVTensor
from uptrain.convert.io.hfconfig import AttentionDims
from uptrain.convert.io.source import TensorInfo, TensorSpec
from uptrain.errors import UsageError
from uptrain.convert.math.heads import Method, merge_qkv, pool_heads, random_heads, repeat_heads, split_qkv


@dataclass(frozen=True)
class HeadChange:
    """What to do: go from `dims.kv_heads` to `new_kv_heads` with `method` (fewer: pool; more: repeat)."""

    family: Family
    dims: AttentionDims
    new_kv_heads: int
    method: Method = "mean"
    init_std: float = 0.02
    seed: int = 0
    layerwise: Any = None  # a layerwise.Layerwise: --method fit / --grouping similar (whole layers at once)


@dataclass(frozen=True)
class OutputTensor:
    """One output tensor: its spec, the source tensors it is made from, and how.

    unchanged: the output is its one source, byte for byte (same name, shape and dtype), so a
    writer may copy the bytes without building a tensor.
    sources may be empty where `make` takes from what an earlier output of the plan computed (the
    layer-at-a-time conversions: only a layer's first output reads its tensors), so outputs are
    built in plan order.
    """

    spec: TensorSpec
    sources: tuple[TensorInfo, ...]
    make: Callable[[list[torch.Tensor]], torch.Tensor]
    unchanged: bool = False


def _change_rows(t: torch.Tensor, old: int, new: int, method: Method, dtype: torch.dtype) -> torch.Tensor:
    """[old * u, *rest] -> [new * u, *rest] in `dtype`: pool runs of heads, or repeat heads in place."""
    if new == old:
        return t.to(dtype)
    if new > old:
        return repeat_heads(t, old, new).to(dtype)
    return pool_heads(t, old, new, "first" if method == "first" else "mean", dtype)


class _Maker:
    """Builds the `make` functions; holds the generator so random init is seeded and ordered."""

    def __init__(self, change: HeadChange):
        self.change = change
        self.generator = torch.Generator().manual_seed(change.seed)

    def _kv(self, t: torch.Tensor, is_norm: bool, is_bias: bool, dtype: torch.dtype) -> torch.Tensor:
        """The changed K/V rows, computed from `t` and cast once, to the output `dtype`."""
        c = self.change
        old, new = c.dims.kv_heads, c.new_kv_heads
        if c.method == "random" and not is_norm and new < old:
            shape = (t.shape[0] * new // old, *t.shape[1:])
            return random_heads(shape, dtype, c.init_std, self.generator, is_bias)
        return _change_rows(t, old, new, c.method, dtype)

    def heads(self, rule: KVTensor, name: str, dtype: torch.dtype) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        return lambda ts: self._kv(ts[0], rule.is_norm, name.endswith(".bias"), dtype)

    def qkv(self, name: str, dtype: torch.dtype) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        d, c = self.change.dims, self.change
        src_layout, dst_layout = c.family.qkv_layout

        def make(ts: list[torch.Tensor]) -> torch.Tensor:
            if c.new_kv_heads == d.kv_heads:  # identity: keep the source layout as it is
                return ts[0]
            q, k, v = split_qkv(ts[0], src_layout, d.heads, d.kv_heads, d.head_dim)
            is_bias = name.endswith(".bias")
            return merge_qkv(q.to(dtype), self._kv(k, False, is_bias, dtype), self._kv(v, False, is_bias, dtype),
                             dst_layout, d.head_dim)
        return make

    def head_list(self, dtype: torch.dtype) -> Callable[[list[torch.Tensor]], torch.Tensor]:
        # Sources are the g norms of one group (pool) or the one norm a new head copies (repeat).
        method = "first" if self.change.method == "first" else "mean"
        return lambda ts: (ts[0].to(dtype, copy=True) if len(ts) == 1
                           else pool_heads(torch.stack(ts), len(ts), 1, method, dtype)[0])


def _expected_rows(rule: KVTensor, info: TensorInfo, change: HeadChange) -> list[int]:
    d = change.dims
    if rule.kind == "qkv":
        return [(d.heads + 2 * d.kv_heads) * d.head_dim]
    if rule.is_norm:  # a per-head norm holds head_dim values or a single row per head
        return [d.kv_heads * d.head_dim, d.kv_heads]
    return [d.kv_heads * d.head_dim]


def _layer_of(name: str) -> str:
    parts = name.split(".")
    return next((p for p in parts if p.isdigit()), "")


def plan_outputs(infos: list[TensorInfo], change: HeadChange, dtype: torch.dtype | None = None
                 ) -> list[OutputTensor]:
    """The ordered output tensors of a conversion; UsageError where weights contradict the config.

    dtype: cast floating-point outputs to it (None keeps each tensor's dtype).
    """
    d, new = change.dims, change.new_kv_heads
    maker = _Maker(change)
    by_name = {i.name: i for i in infos}
    outputs: list[OutputTensor] = []
    projection_layers: set[str] = set()
    for info in infos:
        found = next(((r, m) for r in change.family.tensors if (m := r.match(info.name))), None)
        out_dtype = dtype if dtype is not None and info.dtype.is_floating_point else info.dtype
        spec = TensorSpec(info.name, info.shape, out_dtype)
        if found is None:
            outputs.append(OutputTensor(spec, (info,), lambda ts: ts[0], unchanged=out_dtype == info.dtype))
            continue
        rule, match = found
        if rule.kind == "head_list":
            outputs.extend(_head_list_outputs(info, match, change, by_name, maker, out_dtype))
            continue
        rows = info.shape[0] if info.shape else 0
        if rows not in _expected_rows(rule, info, change):
            raise UsageError(
                f"weights contradict config.json: {info.name} has shape {list(info.shape)}, but the config "
                f"({d.heads} heads, {d.kv_heads} K/V heads, head_dim {d.head_dim}) implies "
                f"{_expected_rows(rule, info, change)[0]} rows; the checkpoint's config does not match its weights")
        if not rule.is_norm:
            projection_layers.add(_layer_of(info.name))
        if rule.kind == "qkv":
            new_rows = (d.heads + 2 * new) * d.head_dim
            make = maker.qkv(info.name, out_dtype)
        else:
            new_rows = rows * new // d.kv_heads
            make = maker.heads(rule, info.name, out_dtype)
        outputs.append(OutputTensor(replace(spec, shape=(new_rows, *info.shape[1:])), (info,), make,
                                    unchanged=new == d.kv_heads and out_dtype == info.dtype))
    if len(projection_layers) != d.layers:
        raise UsageError(
            f"found K/V projections in {len(projection_layers)} of {d.layers} layers for model type "
            f"{change.family.model_types[0]!r}-like weights; the checkpoint's tensor names are not the "
            f"ones this architecture uses")
    if change.layerwise is not None:
        from uptrain.convert.layers.layer_outputs import rewrite_outputs
        outputs = rewrite_outputs(outputs, infos, change)
    return outputs


def _head_list_outputs(info: TensorInfo, match, change: HeadChange, by_name: dict[str, TensorInfo],
                       maker: _Maker, out_dtype: torch.dtype) -> list[OutputTensor]:
    """One module per K/V head (StableLM's k_layernorm.norms.{j}): outputs for source head j."""
    old, new = change.dims.kv_heads, change.new_kv_heads
    j = int(match.group(1))
    if j >= old:
        raise UsageError(f"weights contradict config.json: {info.name} is K/V head {j}, but the config "
                         f"has {old} K/V heads")
    start, end = match.span(1)

    def named(k: int) -> str:
        return f"{info.name[:start]}{k}{info.name[end:]}"
    if new >= old:  # repeat: source head j becomes heads j*r ... (j+1)*r - 1
        r = new // old
        return [OutputTensor(TensorSpec(named(j * r + i), info.shape, out_dtype), (info,), maker.head_list(out_dtype))
                for i in range(r)]
    g = old // new
    if j % g:  # not the first head of its group: produced with the group's first member
        return []
    try:
        members = tuple(by_name[named(k)] for k in range(j, j + g))
    except KeyError as err:
        raise UsageError(f"per-head tensor {err.args[0]} is missing; the checkpoint is incomplete") from None
    return [OutputTensor(TensorSpec(named(j // g), info.shape, out_dtype), members, maker.head_list(out_dtype))]
