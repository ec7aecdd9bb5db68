"""`python -m uptrain.convert CKPT --kv-heads N --out DIR`: MHA (or GQA) -> GQA with fewer K/V heads.

Streams the source one tensor at a time into new safetensors shards inside a temporary folder
beside DIR, which is renamed to DIR only when everything is written.
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import sys
from pathlib import Path

import torch

from uptrain.architectures import family_for
from uptrain.checkpoint import SourceCheckpoint, auxiliary_files, open_checkpoint, resolve_source
from uptrain.errors import UsageError, exit_on_usage_error
from uptrain.hfconfig import attention_dims, load_hf_config, target_config
from uptrain.modelcard import render_model_card
from uptrain.plan import ConversionPlan, format_plan, make_plan
from uptrain.pooling import METHODS, divisors
from uptrain.shards import ShardWriter, atomic_output_dir, check_output_path, parse_size
from uptrain.transform import HeadChange, OutputTensor, plan_outputs

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
RECORD_FILE = "uptrain_conversion.json"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m uptrain.convert", description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", help="local checkpoint folder or Hugging Face Hub model id")
    p.add_argument("--kv-heads", type=int, required=True, help="K/V heads per layer after conversion")
    p.add_argument("--out", type=Path, help="output folder (required unless --dry-run)")
    p.add_argument("--method", choices=METHODS, default="mean",
                   help="mean: the paper's mean pooling (default); first / random: the paper's ablations")
    p.add_argument("--seed", type=int, default=0, help="seed of --method random")
    p.add_argument("--revision", help="Hub branch, tag or commit")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="output dtype (default: keep the source's)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output shard (default 5GB)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder")
    p.add_argument("--dry-run", action="store_true", help="print the plan and write nothing")
    return p


def prepare(checkpoint: str, kv_heads: int, method: str = "mean", seed: int = 0,
            revision: str | None = None, dtype: torch.dtype | None = None, allow_expand: bool = False
            ) -> tuple[SourceCheckpoint, ConversionPlan, list[OutputTensor], dict]:
    """Resolve and inspect the source and plan the conversion; reads no tensor data.

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
    change = HeadChange(family, dims, kv_heads, method, float(getattr(cfg, "initializer_range", 0.02) or 0.02), seed)
    outputs = plan_outputs(source.tensors, change, dtype)
    kv_names = {o.spec.name for o in outputs if any(r.match(o.spec.name) for r in family.tensors)}
    kv_dtype = next((o.spec.dtype for o in outputs if o.spec.name in kv_names and o.spec.dtype.is_floating_point),
                    dtype or torch.float32)
    plan = make_plan(checkpoint, revision, source.config, family, dims, kv_heads, method, seed,
                     sum(i.numel for i in source.tensors), outputs, kv_dtype)
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
            force: bool = False, allow_expand: bool = False) -> ConversionPlan:
    """Convert `checkpoint` into `out` with `kv_heads` K/V heads; the Python API behind the CLI."""
    max_shard = parse_size(max_shard_size)
    source, plan, outputs, new_config = prepare(checkpoint, kv_heads, method, seed, revision, dtype, allow_expand)
    check_output_path(out, source.path, force)
    write_converted(source, plan, outputs, new_config, out, max_shard)
    return plan


@exit_on_usage_error
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.dry_run and args.out is None:
        raise UsageError("--out is required (or pass --dry-run to only print the plan)")
    max_shard = parse_size(args.max_shard_size)
    source, plan, outputs, new_config = prepare(args.checkpoint, args.kv_heads, args.method, args.seed,
                                                args.revision, DTYPES.get(args.dtype))
    print(format_plan(plan))
    if args.dry_run:
        print("dry run: nothing written")
        return 0
    check_output_path(args.out, source.path, args.force)
    try:
        write_converted(source, plan, outputs, new_config, args.out, max_shard)
    except OSError as err:
        if err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise UsageError(f"cannot write {args.out}: {err.strerror}; free space and run again "
                             f"(nothing was left behind)") from err
        raise
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
