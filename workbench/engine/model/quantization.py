"""Quantized bases (QLoRA, Dettmers et al. 2023): the frozen linear layers stored in 4 or 8 bits.

bitsandbytes does the storage and the kernels, through transformers' `BitsAndBytesConfig` at
`from_pretrained`: every `nn.Linear` of the decoder becomes a `bnb.nn.Linear4bit` (NF4 or FP4, blocks of
64 weights with one absmax scale each, the scales themselves 8-bit with `double_quant`) or a
`bnb.nn.Linear8bitLt` (LLM.int8(): one scale per row, outlier columns in fp16). A 4-bit layer
dequantizes its block into the compute dtype for each matmul, y = x · dequant(W_q)ᵀ; peft's LoRA layers
for bitsandbytes add (alpha/r)·B·A·x in the adapters' own dtype. What stays in the session's dtype: the
embeddings, the output layer (transformers keeps it unquantized), the norms, and a mixture of experts'
fused expert stacks (3-D parameters, not linear layers: bitsandbytes does not quantize them; the load
says how much memory they keep).

Everything here that can refuse runs before the weights are read (`check_quantizable` on the folder's
config, `check_quantizable_layers` on the model built on the meta device), so a refused load leaves
nothing behind.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import bitsandbytes as bnb
import torch
from peft.utils.integrations import dequantize_bnb_weight
from torch import nn
from transformers import BitsAndBytesConfig
from transformers.pytorch_utils import Conv1D
from transformers.quantizers.base import HfQuantizer
from transformers.quantizers.quantizers_utils import should_convert_module

from workbench.engine.config import QuantizationConfig

# bitsandbytes' own kernels for these device types run 4-bit and 8-bit layers forward and backward
# (its `backends/`); elsewhere (mps, hpu) some of them are missing.
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda", "xpu")


def check_quantizable(path: str, device: torch.device, quantization: QuantizationConfig) -> None:
    """Refuse, before anything is loaded, a base that cannot be quantized as asked: a device
    bitsandbytes has no kernels for; a base already quantized another way (its `config.json` names a
    `quantization_config`: GPTQ, AWQ, FP8, ...), which transformers would load as it is; int8 on
    multi-head latent attention (DeepSeek-V2/V3's, named by `kv_lora_rank`), whose `kv_b_proj` is fed
    (batch, 1, tokens, rank) latents: LLM.int8()'s row scales take inputs of at most 3 dimensions, so the
    first pass would fail after the whole load."""
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"quantize={quantization.method!r} runs on {SUPPORTED_DEVICE_TYPES} (bitsandbytes' kernels), "
            f"not on {device.type!r}; choose another device or quantize=None"
        )
    config_file = Path(path) / "config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    existing = config.get("quantization_config")
    if existing is not None:
        method = existing.get("quant_method", "unknown") if isinstance(existing, dict) else existing
        raise ValueError(
            f"{path} is already quantized ({method!r}); quantize={quantization.method!r} needs a "
            "full-precision base: load this one with quantize=None, or give its unquantized folder"
        )
    if quantization.method == "int8" and config.get("kv_lora_rank") is not None:
        raise ValueError(
            f"quantize='int8' cannot run {path} ({config.get('model_type')!r}): its multi-head latent "
            "attention feeds kv_b_proj 4-D inputs, which bitsandbytes' int8 matmul does not take; use "
            "quantize='nf4' or 'fp4'"
        )


def bitsandbytes_config(quantization: QuantizationConfig, dtype: torch.dtype) -> BitsAndBytesConfig:
    """transformers' config for `quantization`, computing in `dtype` unless it names another."""
    if quantization.method == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    compute = getattr(torch, quantization.compute_dtype) if quantization.compute_dtype else dtype
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quantization.method,
        bnb_4bit_use_double_quant=quantization.double_quant,
        bnb_4bit_compute_dtype=compute,
    )


def quantized_layers(model: nn.Module) -> Iterator[tuple[str, nn.Linear]]:
    """The model's bitsandbytes linear layers, by name (none on an unquantized model)."""
    for name, module in model.named_modules():
        if isinstance(module, bnb.nn.Linear4bit | bnb.nn.Linear8bitLt):
            yield name, module


def keep_one_cpu_kernel(model: nn.Module) -> None:
    """Make every 4-bit layer compute the same way in every pass. On a CPU with AVX-512 BF16,
    bitsandbytes repacks a layer's weight at its first pass without gradients (in eval mode, as
    workbench's models always are) and from then on runs such passes with another kernel, whose scales
    are bf16: `forward`, reference logprobs and the sampler would then differ from `forward_backward`
    (by 0.3 nats on the tiny model). Off, every pass dequantizes into the compute dtype and multiplies."""
    for _, layer in quantized_layers(model):
        if isinstance(layer, bnb.nn.Linear4bit):
            layer.support_avx512bf16_for_cpu = False


def dequantized_weight(layer: nn.Linear) -> torch.Tensor:
    """A bitsandbytes layer's weight as its matmul sees it, dequant(W_q), in fp32."""
    state = layer.state if isinstance(layer, bnb.nn.Linear8bitLt) else None  # int8 row scales live there
    return dequantize_bnb_weight(layer.weight, state=state).to(torch.float32)


def _scale_tensors(layer: nn.Linear) -> Iterator[torch.Tensor]:
    """The tensors a quantized layer keeps beside its weight's data: a 4-bit weight's block scales
    (absmax) and code book, with double quantization the scales' own absmax, code book and offset; an
    int8 layer's row scales (SCB), which bitsandbytes moves from the weight to the layer's state at load."""
    if isinstance(layer, bnb.nn.Linear8bitLt):
        yield from (t for t in (layer.weight.SCB, layer.state.SCB) if t is not None)
    if isinstance(layer, bnb.nn.Linear4bit) and layer.weight.quant_state is not None:
        state = layer.weight.quant_state
        yield from (state.absmax, state.code)
        if state.nested:  # the absmax above is 8-bit; its own scales, code book and offset
            yield from (state.state2.absmax, state.state2.code, state.offset)


def base_memory_bytes(model: nn.Module) -> int:
    """The memory a base model's tensors hold: every parameter and buffer (a 4-bit weight counted as
    its packed bytes) and the scales of its quantized layers; LoRA adapters (`lora_` parameters of a
    peft model) are not the base's."""
    tensors = [
        *(param for name, param in model.named_parameters() if "lora_" not in name),
        *model.buffers(),
    ]
    scales = [t for _, layer in quantized_layers(model) for t in _scale_tensors(layer)]
    unique = {id(t): t for t in [*tensors, *scales]}
    return sum(t.numel() * t.element_size() for t in unique.values())


# bitsandbytes' 4-bit layout: blocks of 64 weights, one absmax each, and a code book of 16 fp32 values.
# With double quantization the absmax are uint8, in blocks of 256 with one fp32 scale each, a code book
# of 256 fp32 values and one fp32 offset. int8 keeps one fp32 scale per output row.
_BLOCK_4BIT = 64
_BLOCK_DOUBLE_QUANT = 256
_CODE_BOOK_BYTES = 4 * 16
_DOUBLE_QUANT_CODE_BOOK_BYTES = 4 * 256
_DOUBLE_QUANT_OFFSET_BYTES = 4


def _quantized_weight_bytes(count: int, rows: int, quantization: QuantizationConfig) -> int:
    """What one linear weight of `count` weights and `rows` output rows holds once quantized, its scales
    and code books included."""
    if quantization.method == "int8":
        return count + 4 * rows
    blocks = -(-count // _BLOCK_4BIT)
    scales = _CODE_BOOK_BYTES
    if quantization.double_quant:
        scales += blocks + 4 * -(-blocks // _BLOCK_DOUBLE_QUANT)
        scales += _DOUBLE_QUANT_CODE_BOOK_BYTES + _DOUBLE_QUANT_OFFSET_BYTES
    else:
        scales += 4 * blocks
    return -(-count // 2) + scales


def check_quantizable_layers(model: nn.Module, path: str, quantization: QuantizationConfig) -> None:
    """Refuse, on an unloaded model (the meta device), a base whose projections are GPT-2 style `Conv1D`
    layers: bitsandbytes would load them as transposed linear layers, which LoRA then adapts where the
    same base in full precision refuses to (`check_lora_fits`), and which the merged export could not
    write back into the `Conv1D` layout."""
    conv1d = [name for name, module in model.named_modules() if isinstance(module, Conv1D)]
    if conv1d:
        raise ValueError(
            f"quantize={quantization.method!r} cannot load {path}: its projections are GPT-2 style Conv1D "
            f"layers ({', '.join(conv1d[:3])}, ...), which bitsandbytes transposes into linear layers that "
            "the full-precision base's adapters and the merged export do not match; use quantize=None"
        )


def converted_layers(model: nn.Module) -> dict[str, nn.Linear]:
    """The layers of an unloaded model that bitsandbytes will replace, by name, by transformers' own rule
    (`replace_with_bnb_linear`): every layer of exact type `nn.Linear` (a subclass is left as it is),
    except the output layer, the last parameter's module, tied weights and the model's
    `_keep_in_fp32_modules`. (transformers converts GPT-2 style `Conv1D` layers too; such bases are
    refused, `check_quantizable_layers`.)"""
    skipped = HfQuantizer.get_modules_to_not_convert(
        model,
        None,
        model._keep_in_fp32_modules,  # noqa: SLF001  (the model class's own list, as transformers reads it)
    )
    return {
        name: module
        for name, module in model.named_modules()
        if type(module) is nn.Linear and should_convert_module(name, skipped)
    }


def quantized_model_bytes(model: nn.Module, quantization: QuantizationConfig, dtype: torch.dtype) -> int:
    """The memory an unloaded model (on the meta device) will hold once loaded quantized in `dtype`,
    what `base_memory_bytes` counts once it is loaded: the weights of the layers bitsandbytes replaces
    (`converted_layers`) as it stores them, scales and code books included; every other parameter
    (embeddings, the output layer, norms, biases, fused expert stacks) in `dtype`; the buffers (rotary
    frequencies) in their own dtype. A tied parameter is counted once."""
    element = torch.empty((), dtype=dtype).element_size()
    counted: dict[int, int] = {}
    for layer in converted_layers(model).values():
        counted[id(layer.weight)] = _quantized_weight_bytes(
            layer.weight.numel(), layer.out_features, quantization
        )
    for param in model.parameters():
        counted.setdefault(id(param), param.numel() * element)
    for buffer in model.buffers():
        counted.setdefault(id(buffer), buffer.numel() * buffer.element_size())
    return sum(counted.values())
