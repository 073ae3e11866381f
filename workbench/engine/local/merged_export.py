"""Export the policy as one ordinary HF model: base weights with the LoRA update merged in, plus tokenizer.

For serving stacks that take a plain model folder (`AutoModelForCausalLM.from_pretrained`, vLLM without
LoRA, llama.cpp converters). The session's model is never modified: a second copy of the base is loaded
on the CPU and each adapted weight gets `W + ΔW`, with ΔW computed by peft from the live adapter
(`get_delta_weight`, which reads and does not merge): a linear layer's weight, or a mixture of experts'
fused expert stack (peft's `ParamWrapper`, whose ΔW is one (experts, ·, ·) stack laid out as the
parameter is, each expert's `B_e A_e` scaled). When the policy adapts the output layer of a model
whose input and output embeddings are tied (SmolLM2), the copy is untied first: the merged output layer
is saved as its own tensor and the config says `tie_word_embeddings=False`, while the input embedding
keeps the base weights, as in the session.

On a quantized base (`Session(quantize=...)`) the adapters were trained against the quantized weights
W_q, so the merged weight is dequant(W_q) + ΔW (the function the session computes, up to rounding),
saved in the session's dtype: a full-precision model, larger than the quantized one. It differs from
the original full-precision base W by the quantization error W − dequant(W_q); the export measures it
(the largest relative error ‖W − dequant(W_q)‖_F / ‖W‖_F over the quantized layers) and says it in a
warning.

The export runs on the worker thread (it reads the adapter between operations) and is written under a
temporary name, then renamed.
"""

from __future__ import annotations

import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from peft.tuners.lora import LoraLayer, ParamWrapper
from torch import nn
from tqdm.auto import tqdm

from workbench.engine.local.state import EngineState
from workbench.engine.model.base_model import load_base_model
from workbench.engine.model.quantization import dequantized_weight, quantized_layers
from workbench.futures import APIFuture
from workbench.storage.checkpoint_store import CheckpointError


def _adapted_weight(model: nn.Module, name: str, layer: LoraLayer) -> nn.Parameter:
    """The weight of the clean base `model` that the peft layer `name` adapts: a linear layer's weight,
    or, for a `ParamWrapper` (nested ones sit under `.base_layer`), the expert stack it targets."""
    if isinstance(layer, ParamWrapper):
        module = model.get_submodule(name.replace(".base_layer", ""))
        return getattr(module, layer.parameter_name)
    return model.get_submodule(name).weight


def _export(state: EngineState, model_id: str, target: Path) -> Path:
    adapter = state.lora_model(model_id).policy.adapter
    assert state.model.peft_model is not None
    adapted = [
        (name, module)
        for name, module in state.model.peft_model.get_base_model().named_modules()
        if isinstance(module, LoraLayer) and adapter in module.lora_A
    ]
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        with tqdm(
            total=len(adapted) + 2, desc=f"Exporting merged model to {target.name}", unit="step"
        ) as progress:
            merged, tokenizer, _ = load_base_model(state.config.base_model, torch.device("cpu"), state.dtype)
            progress.update()
            output = merged.get_output_embeddings()
            tied = output.weight is merged.get_input_embeddings().weight
            if tied and any(
                _adapted_weight(merged, name, module) is output.weight for name, module in adapted
            ):
                output.weight = nn.Parameter(output.weight.detach().clone(), requires_grad=False)
                merged.config.tie_word_embeddings = False
            with torch.no_grad():
                error = _put_dequantized_weights(state, merged)
                for name, module in adapted:
                    weight = _adapted_weight(merged, name, module)
                    weight += module.get_delta_weight(adapter).to(device="cpu", dtype=weight.dtype)
                    progress.update()
            merged.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            progress.update()
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if error is not None:
        quantization = state.config.quantization
        assert quantization is not None
        warnings.warn(
            f"{target.name}: merged onto the dequantized {quantization.describe()} base; it differs from "
            f"the full-precision base plus the adapter by the quantization error (largest relative "
            f"weight error {error:.3g})",
            UserWarning,
            stacklevel=1,
        )
    return target


def _put_dequantized_weights(state: EngineState, merged: nn.Module) -> float | None:
    """Replace each weight of the full-precision copy `merged` that the session holds quantized by the
    dequantized one; the largest relative error ‖W − dequant(W_q)‖_F / ‖W‖_F, None on an unquantized base."""
    assert state.model.peft_model is not None
    errors = []
    for name, layer in quantized_layers(state.model.peft_model.get_base_model()):
        target = merged.get_submodule(name.replace(".base_layer", "")).weight
        dequantized = dequantized_weight(layer).to(device="cpu")
        errors.append(
            float(torch.linalg.norm(target.float() - dequantized) / torch.linalg.norm(target.float()))
        )
        target.copy_(dequantized.to(target.dtype))
    return max(errors) if errors else None


def export_merged(state: EngineState, model_id: str, path: str | Path) -> APIFuture[Path]:
    """Queue the export of the run's merged policy to the new folder `path` (see the module docstring)."""
    state.check_open()
    state.lora_model(model_id)
    target = Path(path).expanduser().absolute()
    if target.exists():
        raise CheckpointError(f"{target} already exists; export_merged writes a new folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    return state.submit(lambda: _export(state, model_id, target))
