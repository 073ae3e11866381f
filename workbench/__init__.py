"""workbench: a Jupyter-first research workbench for LLM post-training.

One kernel-resident `Session` holds a base model with a LoRA policy, and speaks the Tinker training API
(`forward_backward`, `forward`, `optim_step`, ...) on the local GPU or CPU.
"""

from workbench.advantages import broadcast_to_tokens, completion_mask, gae, group_relative_advantages, kl_penalty
from workbench.clients import ModelInfo, ServiceClient, TrainingClient
from workbench.futures import APIFuture
from workbench.losses import LOSSES
from workbench.metrics import MetricsHistory
from workbench.session import Session, SessionConfig
from workbench.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    LoraConfig,
    ModelInput,
    OptimStepResponse,
    SampledSequence,
    SampleResponse,
    SamplingParams,
    TensorData,
)
from workbench.worker import SessionClosedError

__all__ = [
    "LOSSES",
    "APIFuture",
    "AdamParams",
    "Datum",
    "EncodedTextChunk",
    "ForwardBackwardOutput",
    "LoraConfig",
    "MetricsHistory",
    "ModelInfo",
    "ModelInput",
    "OptimStepResponse",
    "SampleResponse",
    "SampledSequence",
    "SamplingParams",
    "ServiceClient",
    "Session",
    "SessionClosedError",
    "SessionConfig",
    "TensorData",
    "TrainingClient",
    "broadcast_to_tokens",
    "completion_mask",
    "gae",
    "group_relative_advantages",
    "kl_penalty",
]
