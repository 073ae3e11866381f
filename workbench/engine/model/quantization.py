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

Everything here that can refuse runs before the weights are read (`check_quantizable`), so a refused
load leaves nothing behind.
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

from workbench.engine.config import QuantizationConfig

# bitsandbytes' own kernels for these device types run 4-bit and 8-bit layers forward and backward
# (its `backends/`); elsewhere (mps, hpu) some of them are missing.
SUPPORTED_DEVICE_TYPES = ("cpu", "cuda", "xpu")


def check_quantizable(path: str, device: torch.device, quantization: QuantizationConfig) -> None:
    """Refuse, before anything is loaded, a base that cannot be quantized as asked: a device
    bitsandbytes has no kernels for, or a base already quantized another way (its `config.json` names
    a `quantization_config`: GPTQ, AWQ, FP8, ...), which transformers would load as it is."""
    if device.type not in SUPPORTED_DEVICE_TYPES:
        raise ValueError(
            f"quantize={quantization.method!r} runs on {SUPPORTED_DEVICE_TYPES} (bitsandbytes' kernels), "
            f"not on {device.type!r}; choose another device or quantize=None"
        )
    config_file = Path(path) / "config.json"
    if config_file.is_file():
        existing = json.loads(config_file.read_text()).get("quantization_config")
        if existing is not None:
            method = existing.get("quant_method", "unknown") if isinstance(existing, dict) else existing
            raise ValueError(
                f"{path} is already quantized ({method!r}); quantize={quantization.method!r} needs a "
                "full-precision base: load this one with quantize=None, or give its unquantized folder"
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


def _scale_tensors(param: nn.Parameter) -> Iterator[torch.Tensor]:
    """The tensors a quantized weight keeps beside its data: a 4-bit weight's block scales (absmax) and
    code book, with double quantization the scales' own; an int8 weight's row scales (SCB)."""
    if isinstance(param, bnb.nn.Int8Params) and param.SCB is not None:
        yield param.SCB
    if isinstance(param, bnb.nn.Params4bit) and param.quant_state is not None:
        state = param.quant_state
        yield from (state.absmax, state.code)
        if state.nested:  # the absmax above is 8-bit; its own scales, code book and offset
            yield from (state.state2.absmax, state.state2.code, state.offset)


def base_memory_bytes(model: nn.Module) -> int:
    """The memory a base model's tensors hold: every parameter and buffer (a 4-bit weight counted as
    its packed bytes) and the scales of its quantized weights; LoRA adapters (`lora_` parameters of a
    peft model) are not the base's."""
    tensors = [
        *(param for name, param in model.named_parameters() if "lora_" not in name),
        *model.buffers(),
    ]
    scales = [t for param in model.parameters() for t in _scale_tensors(param)]
    unique = {id(t): t for t in [*tensors, *scales]}
    return sum(t.numel() * t.element_size() for t in unique.values())


# bitsandbytes' 4-bit layout: blocks of 64 weights, one absmax each (fp32, or with double quantization
# uint8 with one fp32 scale per 256 blocks) and a code book of 16 fp32 values, with double quantization
# 256; int8 keeps one fp32 scale per output row.
_BLOCK_4BIT = 64
_BLOCK_DOUBLE_QUANT = 256
_CODE_BOOK_BYTES = 4 * 16
_DOUBLE_QUANT_CODE_BOOK_BYTES = 4 * 256


def _quantized_weight_bytes(weight: torch.Tensor, quantization: QuantizationConfig) -> int:
    """What one linear weight holds once quantized, its scales and code book included."""
    count = weight.numel()
    if quantization.method == "int8":
        return count + 4 * weight.shape[0]
    blocks = -(-count // _BLOCK_4BIT)
    if quantization.double_quant:
        scales = blocks + 4 * -(-blocks // _BLOCK_DOUBLE_QUANT) + _DOUBLE_QUANT_CODE_BOOK_BYTES
    else:
        scales = 4 * blocks + _CODE_BOOK_BYTES
    return -(-count // 2) + scales


def quantized_model_bytes(model: nn.Module, quantization: QuantizationConfig, dtype: torch.dtype) -> int:
    """The memory an unloaded model (on the meta device) will hold once loaded quantized in `dtype`: the
    weights of its linear layers as bitsandbytes stores them, every other parameter (embeddings, the
    output layer, which transformers keeps unquantized, norms, biases, fused expert stacks) in `dtype`.
    A tied parameter is counted once."""
    element = torch.empty((), dtype=dtype).element_size()
    output_layer = model.get_output_embeddings()
    counted: dict[int, int] = {}
    for module in model.modules():
        quantized = isinstance(module, nn.Linear) and module is not output_layer
        for name, param in module.named_parameters(recurse=False):
            if quantized and name == "weight":
                counted[id(param)] = _quantized_weight_bytes(param, quantization)
            else:
                counted.setdefault(id(param), param.numel() * element)
    return sum(counted.values())
