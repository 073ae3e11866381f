"""workbench: a Jupyter-first research workbench for LLM post-training.

One kernel-resident `Session` holds a base model with a LoRA policy, and speaks the Tinker training API
(`forward_backward`, `forward`, `optim_step`, ...) on the local GPU or CPU, or, with `Session.connect`,
on a Tinker-compatible service elsewhere.
"""

from workbench import datasets
from workbench.advantages import (
    broadcast_to_tokens,
    completion_mask,
    gae,
    group_relative_advantages,
    kl_penalty,
)
from workbench.archive import UnsafeArchiveError, export_archive, import_archive
from workbench.chat import chat_datum, chat_prompt
from workbench.checkpoint_store import CheckpointError, CheckpointInfo, CorruptCheckpointError
from workbench.clients import ClientFuture, SamplingClient, TrainingClient
from workbench.engine import Engine, ModelTensors, Restore, Role, RunStatus, SessionConfig
from workbench.engine_interface import EngineInterface
from workbench.futures import APIFuture, ReentrantWaitError
from workbench.losses import LOSSES
from workbench.metrics import MetricsHistory
from workbench.panel import Panel
from workbench.probes import AgreementReport, check_logprob_agreement
from workbench.remote_engine import EngineUnreachableError, RemoteEngine, RemoteUnsupportedError
from workbench.rest_client import RestClient
from workbench.rollouts import completion_positions, critic_datum, policy_datum, sequence_datum
from workbench.run import Run, RunActiveError, RunState, train_step
from workbench.service_client import ServiceClient
from workbench.session import Session
from workbench.token_view import TokenView, render_datum, render_sample, render_tokens
from workbench.training import NonFiniteGradientError
from workbench.types import (
    AdamParams,
    Datum,
    EncodedTextChunk,
    ForwardBackwardOutput,
    GetInfoResponse,
    LoraConfig,
    ModelData,
    ModelInput,
    OptimStepResponse,
    PromptProvenanceSpan,
    SampledProvenanceSpan,
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
    "AgreementReport",
    "CheckpointError",
    "CheckpointInfo",
    "ClientFuture",
    "CorruptCheckpointError",
    "Datum",
    "EncodedTextChunk",
    "Engine",
    "EngineInterface",
    "EngineUnreachableError",
    "ForwardBackwardOutput",
    "GetInfoResponse",
    "LoraConfig",
    "MetricsHistory",
    "ModelData",
    "ModelInput",
    "ModelTensors",
    "NonFiniteGradientError",
    "OptimStepResponse",
    "Panel",
    "PromptProvenanceSpan",
    "ReentrantWaitError",
    "RemoteEngine",
    "RemoteUnsupportedError",
    "RestClient",
    "Restore",
    "Role",
    "Run",
    "RunActiveError",
    "RunState",
    "RunStatus",
    "SampleResponse",
    "SampledProvenanceSpan",
    "SampledSequence",
    "SamplingClient",
    "SamplingParams",
    "ServiceClient",
    "Session",
    "SessionClosedError",
    "SessionConfig",
    "TensorData",
    "TokenView",
    "TrainingClient",
    "UnsafeArchiveError",
    "broadcast_to_tokens",
    "chat_datum",
    "chat_prompt",
    "check_logprob_agreement",
    "completion_mask",
    "completion_positions",
    "critic_datum",
    "datasets",
    "export_archive",
    "gae",
    "group_relative_advantages",
    "import_archive",
    "kl_penalty",
    "policy_datum",
    "render_datum",
    "render_sample",
    "render_tokens",
    "sequence_datum",
    "train_step",
]
