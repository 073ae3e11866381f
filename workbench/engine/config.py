"""The settings that define an engine, and those that define one model on it.

`EngineConfig` is fixed for the engine's life: the base model, where and in what precision it runs (and
how its frozen weights are quantized, `QuantizationConfig`), the micro-batch budget and the sampler. `ModelConfig` is what a state checkpoint records about the model it
saves (the engine's settings plus the model's adapters and seed), and what rebuilds that model elsewhere.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass
from typing import Any, Literal

from workbench.types import LoraConfig

# The most padded tokens one forward pass may take. Training micro-batches stay far below it: the planner
# groups datums past the model's full-activation limit (1,024 tokens here) only where the recomputation costs less than another pass,
# so on SmolLM2-135M its training plans for 64 datums of 256 tokens and of 16..512 tokens are the same at
# every budget from 2,048 to 32,768 (largest micro-batch 1,024 and 1,098 padded tokens), and a longer datum
# goes alone whatever the budget. What the budget bounds is a pass without gradients (`forward`, reference
# and prompt logprobs), which keeps nothing: measured there (64 × 256 tokens, SmolLM2-135M fp32, CPU) 345
# MB above the loaded model at 2,048 and 534 MB at 8,192 (31 KB per token), at the same tokens/s. 16,384
# (about 0.8 GB) keeps such a pass below what one 2,048-token training step holds (2.8 GB) with
# half as many passes as 8,192; on a CPU it gains no speed, on a GPU fewer, larger passes do.
DEFAULT_MAX_TOKENS_PER_MICROBATCH = 16384
DEFAULT_MAX_MODELS = 8


QuantizationMethod = Literal["nf4", "fp4", "int8"]
QUANTIZATION_METHODS: tuple[QuantizationMethod, ...] = ("nf4", "fp4", "int8")
_COMPUTE_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class QuantizationConfig:
    """How the frozen base's linear layers are stored (QLoRA, Dettmers et al. 2023), through bitsandbytes.

    Attributes:
        method: `"nf4"` (4-bit NormalFloat, the QLoRA paper's), `"fp4"` (4-bit float) or `"int8"`
            (LLM.int8(): 8-bit rows with outlier columns kept in fp16).
        double_quant: 4-bit only: quantize the per-block scales too (about 0.37 bits per weight saved).
        compute_dtype: 4-bit only: the dtype a quantized layer dequantizes into for its matmul; None is
            the session's dtype. int8 layers always compute in fp16 (bitsandbytes' kernel).
    """

    method: QuantizationMethod
    double_quant: bool = True
    compute_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.method not in QUANTIZATION_METHODS:
            raise ValueError(f"quantize must be one of {QUANTIZATION_METHODS} or None, got {self.method!r}")
        if self.compute_dtype is not None and self.compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(
                f"compute_dtype must be one of {_COMPUTE_DTYPES} or None, got {self.compute_dtype!r}"
            )
        if self.method == "int8" and self.compute_dtype is not None:
            raise ValueError("compute_dtype applies to 4-bit quantization; int8 layers compute in fp16")

    def describe(self) -> str:
        """`nf4`, `nf4+dq/bfloat16`, `int8`: what the panel and the repr show."""
        if self.method == "int8":
            return "int8"
        double = "+dq" if self.double_quant else ""
        compute = f"/{self.compute_dtype}" if self.compute_dtype is not None else ""
        return f"{self.method}{double}{compute}"


def to_quantization_config(
    quantize: str | QuantizationConfig | dict[str, Any] | None,
) -> QuantizationConfig | None:
    """A `QuantizationConfig` from what a caller may give: a method name, a config, its dict, or None."""
    if quantize is None or isinstance(quantize, QuantizationConfig):
        return quantize
    if isinstance(quantize, str):
        return QuantizationConfig(quantize)  # type: ignore[arg-type]  # checked in __post_init__
    if isinstance(quantize, dict):
        return QuantizationConfig(**quantize)
    raise TypeError(
        f"quantize must be one of {QUANTIZATION_METHODS}, a QuantizationConfig or None, got {quantize!r}"
    )


@dataclass(frozen=True)
class EngineConfig:
    """One base model on one device.

    Attributes:
        base_model: A built-in alias, a local HF folder or an HF hub id.
        seed: Seeds the engine's sampling generator (the seeds of requests that give none).
        device, dtype: Where the base model lives and in what precision (resolved: `cpu`, `float32`).
        quantization: How the frozen base's linear layers are quantized at load; None for not at all.
        max_tokens_per_microbatch: Padded tokens per forward pass; bounds activation memory.
        sampler: the backend chosen (a key of `workbench.engine.samplers.factory.SAMPLERS`, never
            `"auto"`).
        max_samples_per_request: The largest `num_samples` one sample call may ask for.
        max_models: How many LoRA models may share the base at once.
        threads: torch CPU threads for every operation; None chooses them before each operation from
            the cores other processes leave free (`workbench.engine.threads`).
    """

    base_model: str
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH
    sampler: str = "hf"
    max_samples_per_request: int = 128
    max_models: int = DEFAULT_MAX_MODELS
    threads: int | None = None
    quantization: QuantizationConfig | None = None

    def __post_init__(self) -> None:
        for name in ("max_tokens_per_microbatch", "max_samples_per_request", "max_models"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.threads is not None and (
            isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 1
        ):
            raise ValueError(f"threads must be an integer >= 1 or None (adaptive), got {self.threads!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Everything that defines a model (a LoRA policy and optional critic on a base model) on an engine;
    saved with every state checkpoint and logged to W&B."""

    base_model: str
    lora: LoraConfig
    critic: LoraConfig | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    max_tokens_per_microbatch: int = DEFAULT_MAX_TOKENS_PER_MICROBATCH
    sampler: str = "hf"
    max_samples_per_request: int = 128
    quantization: QuantizationConfig | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


_DEPRECATED = {"SessionConfig": "ModelConfig"}


def __getattr__(name: str) -> Any:
    """The deprecated names of this module's classes, with a DeprecationWarning."""
    if name in _DEPRECATED:
        warnings.warn(f"{name} is now {_DEPRECATED[name]}", DeprecationWarning, stacklevel=2)
        return globals()[_DEPRECATED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
