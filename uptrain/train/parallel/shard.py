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

GPU-ready options, applied per decoder layer in torchtitan's order (activation checkpointing,
then compile, then fully_shard): `mixed_precision: bf16` gives each fully_shard a
MixedPrecisionPolicy (parameters cast to bf16 for forward and backward, gradients reduced in
fp32, the sharded fp32 parameters stay the master weights the optimizer updates);
`gradient_checkpointing: true` wraps each layer in torch's non-reentrant checkpoint_wrapper;
`compile: true` compiles each layer (nn.Module.compile, in place: parameter names unchanged).
One process is allowed too (a one-process group is created), e.g. to measure on one GPU.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from accelerate import Accelerator

from uptrain.errors import UsageError

SHARDED_STATE = "sharded_state"  # the torch.distributed.checkpoint folder inside a checkpoint


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder blocks of a Hugging Face causal LM (`_no_split_modules` classes)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise UsageError(f"shard=fsdp2: found no decoder layers in {type(model).__name__} (no _no_split_modules)")
    return layers


def shard_model(model: torch.nn.Module, accelerator: Accelerator, checkpointing: bool = False,
                compile: bool = False) -> torch.nn.Module:
    """`fully_shard` each decoder layer, then the root (embeddings, final norm, head) over all processes.

    `model`: fp32 (the master weights). Under accelerate's mixed_precision bf16 each fully_shard
    gets a bf16-compute / fp32-reduce policy; `checkpointing` and `compile` wrap each decoder
    layer before it is sharded.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():  # one process (no launcher): a one-process group to shard over
        backend = "nccl" if accelerator.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    model.to(accelerator.device)
    mesh = init_device_mesh(accelerator.device.type, (accelerator.num_processes,))
    bf16 = accelerator.mixed_precision == "bf16"
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
              else MixedPrecisionPolicy())
    layers = decoder_layers(model)
    notes = []
    if checkpointing:
        layers = [_checkpointed(model, layer) for layer in layers]
        notes.append(f"activation checkpointing on {len(layers)} decoder layers")
    for layer in layers:
        if compile:
            layer.compile()  # in place: the module (and its parameter names) stays as it is
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    if compile:
        notes.append(f"torch.compile per decoder layer ({len(layers)})")
    if bf16:
        notes.append("mixed precision bf16 (parameters and compute bf16; gradients reduced and master weights fp32)")
    local = sum(p.to_local().numel() for p in model.parameters())
    total = sum(p.numel() for p in model.parameters())
    accelerator.print(f"shard: fsdp2, fully_shard on {len(layers)} decoder layers + root over "
                      f"{accelerator.num_processes} processes; rank 0 holds {local:,} of {total:,} parameters"
                      + "".join(f"; {n}" for n in notes))
    return model


def _checkpointed(model: torch.nn.Module, layer: torch.nn.Module) -> torch.nn.Module:
    """Replace `layer` inside `model` by torch's non-reentrant checkpoint_wrapper of it (its
    activations are recomputed in backward); return the wrapper. State-dict names are unchanged:
    torch.distributed.checkpoint's state-dict functions drop the wrapper's prefix."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if child is layer:
                wrapped = checkpoint_wrapper(layer)
                setattr(module, child_name, wrapped)
                return wrapped
    raise UsageError(f"shard=fsdp2: decoder layer {type(layer).__name__} not found in the model")


def is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def sharded_io(model: torch.nn.Module, optimizer: torch.optim.Optimizer, io):
    """folder -> io(model, optimizer, folder) for a sharded model (its weights and optimizer are
    not accelerate's to save), else None."""
    if not is_sharded(model):
        return None
    return lambda folder: io(model, optimizer, folder)


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
