"""What both engines do: the local `Engine` and the `RemoteEngine`, and the types they share.

`Session`, the Tinker clients (`workbench.tinker_api.clients`), the run loop and the panel are typed against
`EngineInterface`, so the same notebook code runs on the base model in this process
(`workbench.engine.Engine`) or on a Tinker-compatible service over the `tinker` SDK
(`workbench.engine.remote.engine.RemoteEngine`). Both validate input in the caller's thread, take effect in
submission order and return `APIFuture`s.

The interface holds only what both engines do. What needs the model in this process (a critic, local
tensors and devices, checkpoint folders, a merged export, serving) is a method of the local `Engine`
alone, reached where only a local engine exists: `Session` checks its engine once and refuses a remote
one with a `RemoteUnsupportedError` before anything is sent. A remote engine also refuses, inside an
operation both engines have, what its service cannot do (a loss it does not list, a local checkpoint path).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from workbench.engine.config import EngineConfig, ModelConfig
from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.roles import Role
from workbench.engine.samplers.requests import TokenSink
from workbench.futures import APIFuture
from workbench.metrics import MetricsHistory
from workbench.storage.checkpoint_store import CheckpointInfo, CheckpointKind
from workbench.types import (
    ForwardBackwardOutput,
    LoadWeightsResponse,
    LoraConfig,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)


class Restore(enum.Enum):
    """How much of a state checkpoint a load puts back."""

    # the adapters' weights (and the critic's value head); the optimizer starts afresh and a pending
    # gradient is dropped: Tinker's `load_state`
    WEIGHTS = "weights"
    WITH_OPTIMIZER = "with_optimizer"  # + AdamW state, step counters, pending gradients
    EVERYTHING = "everything"  # + every RNG: an exact resume


@dataclass(frozen=True)
class ModelStatus:
    """A model as it stands (a snapshot: read it again for later values)."""

    model_id: str
    model_dir: Path
    lora: LoraConfig
    critic_lora: LoraConfig | None
    seed: int
    step: int  # the policy's optimizer steps
    weights_version: int  # the policy's
    pending_backward_calls: int  # the policy's
    critic_step: int | None
    critic_weights_version: int | None
    live_versions: list[int]  # the policy versions a new sampling client can pin
    user_metadata: dict[str, str]
    created_at: float
    adapter: str  # the policy's label in the history
    critic_adapter: str | None
    snapshot_bytes: int  # memory held by copies of past policy versions that sampling clients pin

    @property
    def run_dir(self) -> Path:
        """Deprecated: `model_dir`."""
        warnings.warn("run_dir is now model_dir", DeprecationWarning, stacklevel=2)
        return self.model_dir


CustomLossFn = Callable[[list[Any], list[Tensor]], tuple[Tensor, Mapping[str, float]]]
"""`fn(data, logprobs_list) -> (loss, metrics)`: a scalar loss of per-datum logprob tensors."""


@dataclass(frozen=True)
class SamplerPin:
    """The weights one sampling client samples: a model's policy at a version, a loaded sampler
    checkpoint (an inference-only adapter), or the base model (neither)."""

    model_id: str | None = None
    version: int | None = None  # the policy's weights version (a loaded checkpoint: the version saved)
    adapter: str | None = None  # the inference adapter of a loaded checkpoint
    folder: Path | None = None  # the checkpoint folder it was loaded from

    @property
    def is_base(self) -> bool:
        return self.model_id is None and self.adapter is None

    @property
    def weights_key(self) -> tuple[str | None, int | None, str | None]:
        """Requests with the same key sample the same weights (one engine call)."""
        return (self.model_id, self.version, self.adapter)


@runtime_checkable
class EngineInterface(Protocol):
    """What `Session`, the clients, the run loop and the panel call on an engine.

    A model is named by its `model_id` and a `Role` (its policy, critic or the reference); each method
    that returns an `APIFuture` validates in the caller's thread and runs in submission order.
    """

    @property
    def endpoint(self) -> str | None:
        """Where the model runs: None for this process, else the URL of the Tinker service."""

    @property
    def config(self) -> EngineConfig:
        """The base model and the engine's settings."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def base_info(self) -> BaseModelInfo: ...

    @property
    def history(self) -> MetricsHistory:
        """Every completed operation's metrics, in submission order."""

    @property
    def closed(self) -> bool: ...

    def check_open(self) -> None:
        """Raise `SessionClosedError` once the engine is closed."""

    # models
    def create_model(
        self,
        lora: LoraConfig,
        *,
        seed: int = 0,
        model_id: str | None = None,
        model_dir: str | Path | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[str]:
        """Add a LoRA model on the base; resolves to its model id."""

    def model_ids(self) -> list[str]: ...

    def model_status(self, model_id: str) -> ModelStatus:
        """The model's counters and settings now (a snapshot)."""

    def model_config(self, model_id: str) -> ModelConfig:
        """What defines the model: what its checkpoints and W&B run record."""

    # training
    def forward(
        self,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def forward_backward(
        self,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def forward_backward_custom(
        self, model_id: str, role: Role, data: Sequence[Any], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]: ...

    def optim_step(
        self, model_id: str, role: Role, adam_params: Any = None
    ) -> APIFuture[OptimStepResponse]: ...

    # sampling
    def pin_sampler(self, model_id: str | None, version: int | None = None) -> APIFuture[SamplerPin]:
        """Hold a policy's weights at a version (default: current) for sampling; `None`: the base model."""

    def pin_sampler_checkpoint(self, path: str | Path) -> APIFuture[SamplerPin]:
        """Hold the weights of a sampler checkpoint for sampling."""

    def release_sampler(self, pin: APIFuture[SamplerPin], wait: bool = False) -> None:
        """Let go of pinned weights (a sampling client that is dropped or closed)."""

    def sample(
        self,
        pin: APIFuture[SamplerPin],
        prompt: ModelInput | Sequence[int],
        num_samples: int,
        sampling_params: SamplingParams | Mapping[str, Any],
        include_prompt_logprobs: bool = False,
        *,
        prompt_logprobs_last_n: int | None = None,
        record_stability_info: bool = False,
        sequence_ids: Sequence[str] | None = None,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: Any = None,
        prompt_alt_tokens_k: int = 0,
        token_sink: TokenSink | None = None,
    ) -> APIFuture[SampleResponse]: ...

    def compute_logprobs(
        self,
        pin: APIFuture[SamplerPin],
        prompt: ModelInput | Sequence[int],
        *,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[list[float | None]]: ...

    # checkpoints
    def save_state(
        self,
        model_id: str,
        name: str,
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]: ...

    def save_weights_for_sampler(
        self,
        model_id: str,
        name: str,
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]: ...

    def save_weights_external(
        self,
        model_id: str,
        name: str,
        *,
        ttl_seconds: int | None = None,
        age_encryption_recipients: Sequence[str] | None = None,
    ) -> APIFuture[SaveWeightsExternalResponse]: ...

    def load_state(
        self, model_id: str, path: str | Path, restore: Restore
    ) -> APIFuture[LoadWeightsResponse]: ...

    def list_checkpoints(self, model_id: str) -> list[CheckpointInfo]: ...

    def delete_checkpoint(
        self, model_id: str, name: str, kind: CheckpointKind = "state"
    ) -> APIFuture[None]: ...

    # misc
    def record(self, op: str, label: str, step: int, metrics: Mapping[str, float]) -> APIFuture[None]:
        """Append a history row after everything queued before it (a run step's metrics)."""

    def close(self) -> None:
        """Finish the queued operations and free the models; safe to call again."""


_DEPRECATED = {"RunStatus": "ModelStatus"}


def __getattr__(name: str) -> Any:
    """The deprecated names of this module's classes, with a DeprecationWarning."""
    if name in _DEPRECATED:
        warnings.warn(f"{name} is now {_DEPRECATED[name]}", DeprecationWarning, stacklevel=2)
        return globals()[_DEPRECATED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
