"""The interface every surface drives a model through: the local `Engine` and the `RemoteEngine`.

`Session`, the Tinker clients (`workbench.tinker_api.clients`), the run loop and the panel are typed against
`EngineInterface`, so the same notebook code runs on the base model in this process
(`workbench.engine.Engine`) or on a Tinker-compatible service over the `tinker` SDK
(`workbench.engine.remote.RemoteEngine`). Both validate input in the caller's thread, take effect in
submission order and return `APIFuture`s; what one cannot do (a remote engine has no local tensors to
digest, for instance) raises a clear error before anything is sent.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase

from workbench.engine.config import EngineConfig, SessionConfig
from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.roles import Role
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
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)


class Restore(enum.Enum):
    """How much of a state checkpoint a load puts back."""

    WEIGHTS = "weights"  # the adapters' weights (and the critic's value head): Tinker's `load_state`
    WITH_OPTIMIZER = "with_optimizer"  # + AdamW state, step counters, pending gradients
    EVERYTHING = "everything"  # + every RNG: an exact resume


@dataclass(frozen=True)
class RunStatus:
    """A run as it stands (a snapshot: read it again for later values)."""

    model_id: str
    run_dir: Path
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


CustomLossFn = Callable[[list[Any], list[Tensor]], tuple[Tensor, Mapping[str, float]]]
"""`fn(data, logprobs_list) -> (loss, metrics)`: a scalar loss of per-datum logprob tensors."""


@dataclass(frozen=True)
class SamplerPin:
    """The weights one sampling client samples: a run's policy at a version, a loaded sampler
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
    """What `Session`, the clients, the run loop and the panel call on an engine."""

    @property
    def endpoint(self) -> str | None:
        """Where the model runs: None for this process, else the URL of the Tinker service."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def base_info(self) -> BaseModelInfo: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def history(self) -> MetricsHistory: ...

    @property
    def closed(self) -> bool: ...

    def check_open(self) -> None: ...

    # models
    def create_model(
        self,
        lora: LoraConfig,
        *,
        seed: int = 0,
        model_id: str | None = None,
        run_dir: str | Path | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[str]: ...

    def create_critic(self, model_id: str, lora: LoraConfig | None = None) -> APIFuture[None]: ...

    def delete_critic(self, model_id: str) -> APIFuture[None]: ...

    def model_ids(self) -> list[str]: ...

    def run_status(self, model_id: str) -> RunStatus: ...

    def session_config(self, model_id: str) -> SessionConfig: ...

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
    def pin_sampler(self, model_id: str | None, version: int | None = None) -> APIFuture[SamplerPin]: ...

    def pin_sampler_checkpoint(self, path: str | Path) -> APIFuture[SamplerPin]: ...

    def release_sampler(self, pin: APIFuture[SamplerPin], wait: bool = False) -> None: ...

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

    def load_state(
        self, model_id: str, path: str | Path, restore: Restore
    ) -> APIFuture[LoadWeightsResponse]: ...

    def list_checkpoints(self, model_id: str) -> list[CheckpointInfo]: ...

    def delete_checkpoint(
        self, model_id: str, name: str, kind: CheckpointKind = "state"
    ) -> APIFuture[None]: ...

    def cleanup_checkpoints(self, model_id: str) -> APIFuture[list[Path]]: ...

    def export_merged(self, model_id: str, path: str | Path) -> APIFuture[Path]: ...

    # misc
    def record(self, op: str, label: str, step: int, metrics: Mapping[str, float]) -> APIFuture[None]: ...

    def state_digest(self, model_id: str | None = None, role: Role | None = None) -> str: ...

    def close(self) -> None: ...
