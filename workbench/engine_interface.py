"""The interface every surface drives a model through: the local `Engine` and the `RemoteEngine`.

`Session`, the Tinker clients (`workbench.clients`), the run loop and the panel are typed against
`EngineInterface`, so the same notebook code runs on the base model in this process
(`workbench.engine.Engine`) or on a Tinker-compatible service over the `tinker` SDK
(`workbench.remote_engine.RemoteEngine`). Both validate input in the caller's thread, take effect in
submission order and return `APIFuture`s; what one cannot do (a remote engine has no local tensors to
digest, for instance) raises a clear error before anything is sent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from transformers import PreTrainedTokenizerBase

from workbench.checkpoint_store import CheckpointInfo, CheckpointKind
from workbench.engine import CustomLossFn, EngineConfig, Restore, Role, RunStatus, SamplerPin, SessionConfig
from workbench.futures import APIFuture
from workbench.metrics import MetricsHistory
from workbench.models import BaseModelInfo
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
