"""Sampling engines: HF `generate` in-process (`hf.py`), or vLLM with LoRA hot-swap on a GPU (`vllm.py`).

`resolve_sampler` picks one for a session: `"hf"` always works; `"vllm"` needs the vllm package, a CUDA
device and a successful import, and says which is missing otherwise; `"auto"` takes vLLM when it can
and HF otherwise, with a one-line notice.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Literal

import torch

from workbench.types import LoraConfig

SamplerChoice = Literal["auto", "hf", "vllm"]
_fallback_noticed: set[str] = set()  # the notice is shown once per process and reason


def vllm_unavailable_reason(device: torch.device) -> str | None:
    """Why vLLM cannot sample here, or None when it can."""
    if importlib.util.find_spec("vllm") is None:
        return "the vllm package is not installed (pip install 'workbench[vllm]')"
    if device.type != "cuda" or not torch.cuda.is_available():
        return "vLLM needs a CUDA device"
    try:
        importlib.import_module("vllm")
    except Exception as error:  # a broken install: report it and fall back
        return f"importing vllm failed: {error!r}"
    return None


def resolve_sampler(choice: str, device: torch.device, lora: LoraConfig | None) -> Literal["hf", "vllm"]:
    """The sampler for an engine. vLLM does not load LoRA weights on the output embedding, so with
    `"auto"` an engine made for a policy with `train_unembed=True` samples with HF."""
    if choice not in ("auto", "hf", "vllm"):
        raise ValueError(f"sampler must be 'auto', 'hf' or 'vllm', got {choice!r}")
    if choice == "hf":
        return "hf"
    reason = vllm_unavailable_reason(device)
    if reason is None and lora is not None and lora.train_unembed:
        reason = (
            "vLLM does not load LoRA weights on the output embedding: use LoraConfig(train_unembed=False)"
        )
    if reason is None:
        return "vllm"
    if choice == "vllm":
        raise ValueError(f"sampler='vllm' is not available: {reason}")
    if reason not in _fallback_noticed:
        _fallback_noticed.add(reason)
        print(f"workbench: sampling with HF generate ({reason})")
    return "hf"
