"""A frozen base bigger than one device: its weights sharded across the ranks of a process group with
FSDP2 (`torch.distributed.fsdp.fully_shard`), the LoRA adapters on it whole on every rank.

`shard_base` gives each decoder layer its own FSDP group, then one group for the weights around the
layers (the input embeddings, the final norm and the output layer: one group, since a model with tied
embeddings holds one tensor in two of them), then makes the model itself the root. Each rank keeps
1/N of every base weight (`resident_base_bytes` counts it from the local shards' storage); a pass
all-gathers a group's weights just before the group runs (the next layer's while one runs) and frees
them after it, so a rank holds whole weights for a layer or two at a time, plus the group around the
layers while its pass runs. Backward all-gathers each layer again for the gradient of its input.

The adapters stay out of FSDP (`ignored_params`): plain, whole tensors on every rank, never sharded,
their gradients never reduced by FSDP. That keeps their optimizer steps those of the unsharded model,
bit for bit in what the step computes: the same tensors go through the same AdamW
(`trainable_adapter.TrainableAdapter`, `foreach=False`), the same global-norm clipping
(`torch.nn.utils.get_total_norm` over whole tensors) and the same checkpoint files, with the same
gradient each rank, once the data-parallel engine has summed the ranks' gradients with one
`all_reduce(SUM)` (Tinker's losses are sums), exactly as it does over an unsharded base. Sharding the
adapters too would save next to nothing (a rank-16 adapter of an 8B model is 0.5% of its base) and
change every one of those: FSDP reduce-scatters averaged gradients (a divide factor to undo), the
clipping norm would need a collective over DTensor shards, and saving would all-gather them.

The frozen base has no gradients, so nothing is reduce-scattered at all: a training step moves the
base's weights (two all-gathers per layer) and the adapters' gradients (one all-reduce), nothing else.

How the engine calls it, on every rank of the group, in the same order (every pass is collective):

    mesh = init_device_mesh(device_type, (world_size,))     # after torch.distributed.init_process_group
    sharded = shard_base(adapted.base, mesh)                  # after the adapters are attached
    resident_base_bytes(adapted.base)                         # this rank's share, for the status bar

and, before loading, `fits_one_device(unsharded_base_bytes(config, dtype), device)` decides whether
to shard (`sharding_notice` says so). A base that does not fit a device is loaded on the CPU (in the
dtype of the device it will run on): transformers maps its safetensors files, so the ranks share one
copy of the weights in the page cache where the file's dtype is the one asked for. `shard_base` moves
each group to the mesh's device as it shards it (FSDP copies the rank's rows there and the whole
weights are dropped), and the adapters whole, so a device holds 1/N of the base and a group's whole
weights at most while it loads. The passes then run as on an unsharded base: the decoder
(`get_decoder()`) and the output layer chunk by chunk, or the whole model; FSDP's hooks gather what
each module needs, whichever of them is called. Every rank must run the same passes: a rank that
skips one (no datums of its own, a generation that ended sooner: HF `generate(synced_gpus=True)`
keeps every rank stepping) leaves the others waiting on its all-gather. One thread at a time runs a
pass (FSDP keeps per-pass state on the model).

Not sharded: a quantized base (bitsandbytes' layers hold their own packed tensors) and expert
adapters on fused expert stacks (peft's `ParamWrapper` parametrizes the weight during each forward
call, under FSDP's gathered one); `shard_base` refuses the second by name.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import peft
import psutil
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from workbench.engine.model.activation_checkpointing import decoder_layers

ADAPTER_MARKER = "lora_"  # in the name of every peft LoRA tensor (lora_A, lora_B, lora_magnitude_vector, ...)

# The part of a device's free memory the frozen base may take and still count as fitting: the rest
# holds the adapters and their Adam moments, a micro-batch's activations
# (`activation_checkpointing.FULL_ACTIVATION_BYTES`, 1.24 GiB) and a chunk of logits.
BASE_SHARE_OF_FREE_MEMORY = 0.75


@dataclass(frozen=True)
class ShardedBase:
    """A base sharded in place by `shard_base`: the model (FSDP's root) and what it is sharded over."""

    model: PreTrainedModel
    mesh: DeviceMesh
    groups: int  # FSDP groups: one per decoder layer, the one around them, the root

    def reshard(self) -> None:
        """Free every all-gathered weight now. A pass with gradients frees them by its backward; one
        without gradients leaves the group around the layers gathered (its output layer may be called
        again, chunk by chunk), until the next pass or this call. Collective-free."""
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()


@contextlib.contextmanager
def resharding(sharded: ShardedBase | None) -> Iterator[None]:
    """A rank's part of a call, after which a sharded base (if any) frees every weight it gathered."""
    try:
        yield
    finally:
        if sharded is not None:
            sharded.reshard()


def base_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The base model's own weights: every parameter but the adapters', by name (a tied weight once)."""
    return {name: param for name, param in model.named_parameters() if ADAPTER_MARKER not in name}


def adapter_parameter_set(model: nn.Module) -> set[nn.Parameter]:
    """Every adapter tensor on `model`, trainable or not: what FSDP leaves alone."""
    return {param for name, param in model.named_parameters() if ADAPTER_MARKER in name}


def shard_base(model: PreTrainedModel, mesh: DeviceMesh) -> ShardedBase:
    """Shard `model`'s frozen base weights in place across `mesh` (1-D: the ranks of the process
    group), leaving every adapter on it whole; collective, so every rank calls it with the same model.

    `model` is the causal LM the engine runs (`AdaptedModel.base`) with its adapters attached: those
    attached later stay whole too (FSDP manages only the weights it was given), but the base must not
    be unwrapped (`PeftModel.unload`) once sharded. Ends with one token's forward pass through the
    model, without gradients, so that FSDP takes the model as its root whichever module a pass calls
    first (the engine calls the decoder and the output layer on their own)."""
    wrapped = [
        name for name, module in model.named_modules() if isinstance(module, peft.tuners.lora.ParamWrapper)
    ]
    if wrapped:
        raise ValueError(
            f"cannot shard a base whose adapters parametrize its weights (peft ParamWrapper: {wrapped[:3]}"
            f"{' ...' if len(wrapped) > 3 else ''}); a LoRA on fused expert stacks is not sharded: leave the "
            "experts out (train_mlp=False) or load the base whole"
        )
    adapters = adapter_parameter_set(model)
    device = mesh_device(mesh)
    for param in adapters:  # the same Parameter objects: an optimizer made for them still holds them
        param.data = param.data.to(device)
    layers = decoder_layers(model.get_decoder())
    for layer in layers:
        fully_shard(layer, mesh=mesh, ignored_params=adapters)
    fully_shard([model.get_decoder(), model.get_output_embeddings()], mesh=mesh, ignored_params=adapters)
    fully_shard(model, mesh=mesh, ignored_params=adapters)
    sharded = ShardedBase(model=model, mesh=mesh, groups=len(layers) + 2)
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
    sharded.reshard()
    return sharded


def mesh_device(mesh: DeviceMesh) -> torch.device:
    """The device this rank's shards live on: the CPU, or the accelerator this process has made current
    (as FSDP takes it)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    return torch.device(mesh.device_type, torch.accelerator.current_device_index())


def resident_base_bytes(model: nn.Module) -> int:
    """The bytes this rank's base weights hold, read from their storage: a sharded weight's local shard
    (padding included), a whole weight's tensor; a storage shared by several weights counted once."""
    storages: dict[int, int] = {}
    for param in base_parameters(model).values():
        local = param.to_local() if isinstance(param, DTensor) else param
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def unsharded_base_bytes(config: PretrainedConfig, dtype: torch.dtype) -> int:
    """What the whole base of `config` holds in `dtype`, counted on the meta device (nothing is
    allocated; a tied weight once): what `fits_one_device` is asked about before the base is loaded."""
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return sum(param.numel() for param in skeleton.parameters()) * dtype.itemsize


def free_device_memory(device: torch.device) -> int:
    """Bytes free on `device` now: CUDA's free memory, or the host's available memory for the CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    return psutil.virtual_memory().available


def fits_one_device(base_bytes: int, device: torch.device) -> bool:
    """Whether a whole base of `base_bytes` fits `device` with room to train
    (`BASE_SHARE_OF_FREE_MEMORY` of what is free). CPU ranks share the host's memory, so for N
    unsharded CPU ranks ask about N × `base_bytes`."""
    return base_bytes <= BASE_SHARE_OF_FREE_MEMORY * free_device_memory(device)


def sharding_notice(base_bytes: int, device: torch.device, ranks: int) -> str:
    """What the session says when it shards a base because the base does not fit one device."""
    free = free_device_memory(device)
    return (
        f"the base model's weights ({base_bytes / 2**30:.1f} GiB) do not fit one {device.type} device "
        f"({free / 2**30:.1f} GiB free, {BASE_SHARE_OF_FREE_MEMORY:.0%} of it for the base): sharding "
        f"them across {ranks} ranks with FSDP2, about {base_bytes / ranks / 2**30:.1f} GiB each "
        "(shard_base=True)"
    )
