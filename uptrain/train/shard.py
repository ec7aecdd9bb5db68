"""FSDP2 by the trainer itself (config `shard: fsdp2`): `torch.distributed.fsdp.fully_shard`.

accelerate's own FSDP2 path does not run on CPU: under `--use_fsdp --fsdp_version 2` with
`Accelerator(cpu=True)` it reports MULTI_CPU and wraps the model in DDP (FSDP dropped), and
without cpu=True each rank trains alone. `fully_shard` itself runs on CPU under gloo, so with
`shard: fsdp2` the trainer shards the model (each decoder layer, then the root) in the process
group that `accelerate launch --multi_gpu` / torchrun set up, and accelerate prepares only the
data loader. The loop is otherwise the same: FSDP2 averages gradients over processes like DDP
(so the loop's x world still gives sum / global tokens), `set_requires_gradient_sync(False)`
replaces no_sync, clipping is torch's (DTensor-aware), checkpoints of weights and optimizer are
torch.distributed.checkpoint folders (each rank writes its shards; RNG and data position stay
accelerate's), and the final model is gathered into a full state dict for save_pretrained.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType

from uptrain.errors import UsageError

SHARDED_STATE = "sharded_state"  # the torch.distributed.checkpoint folder inside a checkpoint


def check_fsdp2(config, accelerator: Accelerator) -> None:
    """Refuse the launches and settings that `shard: fsdp2` does not cover (UsageError)."""
    kind = accelerator.distributed_type
    if kind not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        raise UsageError(f"shard=fsdp2 needs a plain multi-process launch (accelerate launch --multi_gpu "
                         f"--num_processes N, or torchrun), got {kind.value}; for accelerate's own FSDP/DeepSpeed "
                         "leave shard unset")
    if accelerator.mixed_precision != "no":
        raise UsageError("shard=fsdp2 trains in fp32 only (mixed precision policies are not wired); "
                         "set mixed_precision=no")
    if config.compile:
        raise UsageError("shard=fsdp2 with compile=true is not supported; set compile=false")


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of a Hugging Face causal LM (`_no_split_modules` classes)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UsageError(f"shard=fsdp2: found no decoder layers in {type(model).__name__} (no _no_split_modules)")
    return layers


def shard_model(model: torch.nn.Module, accelerator: Accelerator) -> torch.nn.Module:
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, head) over all processes."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model.to(accelerator.device)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    layers = decoder_layers(model)
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    accelerator.print(f"shard: fsdp2, fully_shard on {len(layers)} decoder layers + root over "
                      f"{accelerator.num_processes} processes; rank 0 holds {local:,} of {total:,} parameters")
    return model


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def no_grad_sync(model: torch.nn.Module):
    """A context in which backward accumulates gradients locally (no reduce-scatter)."""
    @contextlib.contextmanager
    def context():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    return context()


def clip_grad_norm(parameters, max_norm: float) -> torch.Tensor:
    """torch's clipping on DTensor gradients; the global norm as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The whole model's weights on CPU, gathered on rank 0 (empty elsewhere); call on every rank."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    # A tied weight (lm_head = embed_tokens) is one parameter under two names: keep the first
    # name only, as save_pretrained does for an unsharded model.
    seen, tied = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        (tied if id(param) in seen else seen).add(name if id(param) in seen else id(param))
    return {k: v for k, v in full.items() if k not in tied}


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Weights and optimizer state as a torch.distributed.checkpoint folder; call on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(folder / SHARDED_STATE))


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """Restore what save_sharded wrote, on any number of processes (DCP reshards on load); call on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(folder / SHARDED_STATE))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
