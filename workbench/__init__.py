"""workbench: a Jupyter-first research workbench for LLM post-training.

One kernel-resident `Session` holds a base model with a LoRA policy, and speaks the Tinker training API
(`forward_backward`, `forward`, `optim_step`, ...) on the local GPU or CPU, or, with `Session.connect`,
on a Tinker-compatible service elsewhere.

`import workbench` loads none of the heavy libraries: each public name is imported from its module the
first time it is used (PEP 562 module `__getattr__`), so torch, transformers and peft load with the
first name that needs them, and ipywidgets, matplotlib and W&B only with a panel, a plot or a W&B run.
`from workbench import Session` and `wb.Session` work as with eager imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Each public name and the module it lives in (`datasets` is a module itself).
_EXPORTS: dict[str, str] = {
    "broadcast_to_tokens": "workbench.advantages",
    "completion_mask": "workbench.advantages",
    "gae": "workbench.advantages",
    "group_relative_advantages": "workbench.advantages",
    "kl_penalty": "workbench.advantages",
    "UnsafeArchiveError": "workbench.archive",
    "export_archive": "workbench.archive",
    "import_archive": "workbench.archive",
    "chat_datum": "workbench.chat",
    "chat_prompt": "workbench.chat",
    "CheckpointError": "workbench.checkpoint_store",
    "CheckpointInfo": "workbench.checkpoint_store",
    "CorruptCheckpointError": "workbench.checkpoint_store",
    "ClientFuture": "workbench.clients",
    "SamplingClient": "workbench.clients",
    "TrainingClient": "workbench.clients",
    "Engine": "workbench.engine",
    "ModelTensors": "workbench.engine",
    "Restore": "workbench.engine",
    "Role": "workbench.engine",
    "RunStatus": "workbench.engine",
    "SessionConfig": "workbench.engine",
    "EngineInterface": "workbench.engine_interface",
    "APIFuture": "workbench.futures",
    "ReentrantWaitError": "workbench.futures",
    "LOSSES": "workbench.losses",
    "MetricsHistory": "workbench.metrics",
    "Panel": "workbench.panel",
    "AgreementReport": "workbench.probes",
    "check_logprob_agreement": "workbench.probes",
    "EngineUnreachableError": "workbench.remote_engine",
    "RemoteEngine": "workbench.remote_engine",
    "RemoteUnsupportedError": "workbench.remote_engine",
    "RestClient": "workbench.rest_client",
    "completion_positions": "workbench.rollouts",
    "critic_datum": "workbench.rollouts",
    "policy_datum": "workbench.rollouts",
    "sequence_datum": "workbench.rollouts",
    "Run": "workbench.run",
    "RunActiveError": "workbench.run",
    "RunState": "workbench.run",
    "train_step": "workbench.run",
    "ServiceClient": "workbench.service_client",
    "Session": "workbench.session",
    "TokenView": "workbench.token_view",
    "render_datum": "workbench.token_view",
    "render_sample": "workbench.token_view",
    "render_tokens": "workbench.token_view",
    "NonFiniteGradientError": "workbench.training",
    "AdamParams": "workbench.types",
    "Datum": "workbench.types",
    "EncodedTextChunk": "workbench.types",
    "ForwardBackwardOutput": "workbench.types",
    "GetInfoResponse": "workbench.types",
    "LoraConfig": "workbench.types",
    "ModelData": "workbench.types",
    "ModelInput": "workbench.types",
    "OptimStepResponse": "workbench.types",
    "PromptProvenanceSpan": "workbench.types",
    "SampledProvenanceSpan": "workbench.types",
    "SampledSequence": "workbench.types",
    "SampleResponse": "workbench.types",
    "SamplingParams": "workbench.types",
    "TensorData": "workbench.types",
    "SessionClosedError": "workbench.worker",
}
_SUBMODULES = frozenset({"datasets"})

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


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here for the next."""
    if name in _SUBMODULES:
        value = importlib.import_module(f"workbench.{name}")
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
