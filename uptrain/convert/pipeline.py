"""The conversion pipeline: plan (read headers only), then stream tensors into a new folder.

Streams the source one tensor at a time into new safetensors shards inside a temporary folder
beside DIR, which is renamed to DIR only when everything is written.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from uptrain.convert.architectures import family_for
from uptrain.convert.calibrate import Calibration
from uptrain.convert.layerwise import describe_layerwise, layerwise_settings
from uptrain.convert.source import SourceCheckpoint, auxiliary_files, open_checkpoint, resolve_source
from uptrain.errors import UsageError
from uptrain.convert.hfconfig import attention_dims, load_hf_config, target_config
from uptrain.convert.modelcard import render_model_card
from uptrain.convert.plan import ConversionPlan, plan_conversion
from uptrain.convert.heads import divisors
from uptrain.convert.shards import ShardWriter, atomic_output_dir, check_output_path
from uptrain.units import parse_size
from uptrain.convert.tensors import HeadChange, OutputTensor, plan_outputs

RECORD_FILE = "uptrain_conversion.json"


def prepare(checkpoint: str, kv_heads: int, method: str = "mean", seed: int = 0,
            revision: str | None = None, dtype: torch.dtype | None = None, allow_expand: bool = False,
            grouping: str = "contiguous", calibration: Calibration | None = None
            ) -> tuple[SourceCheckpoint, ConversionPlan, list[OutputTensor], dict]:
    """Resolve and inspect the source and plan the conversion; reads no tensor data.

    grouping / calibration: see `layerwise` (`--grouping similar`, `--method fit`) and `calibrate`;
    the calibration runs lazily, when the first attention layer is written.

    allow_expand: also accept more K/V heads than the source has (each head repeated in place,
    the same function): how GQA checkpoints become the MHA test fixtures. Not offered on the CLI.
    """
    source = open_checkpoint(resolve_source(checkpoint, revision))
    family = family_for(load_hf_config(source.config).to_dict() | source.config)
    cfg = load_hf_config(source.config)
    dims = attention_dims(cfg, family)
    valid = [1, dims.kv_heads] if family.mqa_only else divisors(dims.kv_heads)
    if allow_expand and not family.mqa_only:
        valid = sorted(set(valid) | {k for k in divisors(dims.heads) if k % dims.kv_heads == 0})
    if kv_heads not in valid:
        if kv_heads <= 0:
            problem = f"--kv-heads must be positive, got {kv_heads}"
        elif kv_heads > dims.kv_heads:
            problem = (f"the checkpoint has {dims.kv_heads} K/V heads ({dims.heads} query heads); "
                       f"pooling cannot make {kv_heads}")
        elif family.mqa_only:
            problem = f"{source.config['model_type']} can only be multi-query (one K/V head)"
        else:
            problem = f"{kv_heads} does not divide the {dims.kv_heads} K/V heads"
        raise UsageError(f"{problem}; valid --kv-heads: {', '.join(map(str, valid))}")
    layerwise = layerwise_settings(cfg.to_dict() | source.config, dims.heads, dims.kv_heads, dims.head_dim,
                                   kv_heads, method, grouping, calibration and calibration.bind(source.path))
    change = HeadChange(family, dims, kv_heads, method, float(getattr(cfg, "initializer_range", 0.02) or 0.02), seed,
                        layerwise)
    outputs = plan_outputs(source.tensors, change, dtype)
    kv_names = {o.spec.name for o in outputs if any(r.match(o.spec.name) for r in family.tensors)}
    kv_dtype = next((o.spec.dtype for o in outputs if o.spec.name in kv_names and o.spec.dtype.is_floating_point),
                    dtype or torch.float32)
    plan = plan_conversion(checkpoint, revision, source.config, family, dims, kv_heads, method, seed,
                     sum(i.numel for i in source.tensors), outputs, kv_dtype)
    describe_layerwise(plan, layerwise, calibration, sum(i.numel for i in source.tensors))
    new_config = target_config(source.config, cfg, family, kv_heads, dtype)
    return source, plan, outputs, new_config


def write_converted(source: SourceCheckpoint, plan: ConversionPlan, outputs: list[OutputTensor],
                    new_config: dict, out: Path, max_shard_bytes: int) -> None:
    """Stream the outputs into `out` (all or nothing) with config, tokenizer files, card and record."""
    with atomic_output_dir(out) as tmp:
        writer = ShardWriter(tmp, [o.spec for o in outputs], max_shard_bytes)
        for output in outputs:
            tensor = output.make([source.read(s) for s in output.sources])
            writer.write(output.spec.name, tensor.to(output.spec.dtype))
        writer.close()
        for path in auxiliary_files(source.path):
            shutil.copyfile(path, tmp / path.name)
        (tmp / "config.json").write_text(json.dumps(new_config, indent=2) + "\n")
        (tmp / "README.md").write_text(render_model_card(plan))
        (tmp / RECORD_FILE).write_text(json.dumps(plan.record(), indent=2, default=str) + "\n")


def convert(checkpoint: str, out: Path, kv_heads: int, method: str = "mean", *, seed: int = 0,
            revision: str | None = None, dtype: torch.dtype | None = None, max_shard_size: str = "5GB",
            force: bool = False, allow_expand: bool = False, grouping: str = "contiguous",
            calibration: Calibration | None = None) -> ConversionPlan:
    """Convert `checkpoint` into `out` with `kv_heads` K/V heads; the Python API behind the CLI."""
    max_shard = parse_size(max_shard_size)
    source, plan, outputs, new_config = prepare(checkpoint, kv_heads, method, seed, revision, dtype, allow_expand,
                                                grouping, calibration)
    check_output_path(out, source.path, force)
    write_converted(source, plan, outputs, new_config, out, max_shard)
    return plan
