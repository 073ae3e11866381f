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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from torch import Tensor
from transformers import PreTrainedTokenizerBase

from workbench.engine.config import EngineConfig, ModelConfig
from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.roles import Role
from workbench.engine.samplers.requests import PreparedRequest, TokenSink
from workbench.engine.samplers.sample_request import SampleRequest
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
class CheckedSample:
    """A `SampleRequest` an engine has checked (`EngineInterface.check_sample`), which its `sample` takes
    without checking it again: the compatible APIs check every call of a request before they resolve its
    weights or queue the first call, then sample the calls they checked.

    Attributes:
        request: The request as its caller built it.
        prepared: What the local engine's check worked out (`requests.prepare_request`); None from a remote
            engine, whose service checks what needs the model.
        checked_by: The engine whose check it passed; another engine checks it afresh.
    """

    request: SampleRequest
    prepared: PreparedRequest | None = field(compare=False, repr=False)
    checked_by: object = field(compare=False, repr=False)


def asked(request: SampleRequest | CheckedSample) -> SampleRequest:
    """The request a sample call stands for, checked or not."""
    return request.request if isinstance(request, CheckedSample) else request


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
    # Tinker's `kind="inflight"`: the client follows its model's shared inflight target, which later
    # inflight saves move; `version` is then the version the target held when the pin was taken (the
    # oldest the client can sample), and each request samples the target as it stands when it runs
    inflight: bool = False

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
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The base model's tokenizer (Tinker's `TrainingClient.get_tokenizer`)."""

    @property
    def base_info(self) -> BaseModelInfo:
        """What is known of the base model: its name, path, architecture, vocabulary and sizes."""

    @property
    def history(self) -> MetricsHistory:
        """Every completed operation's metrics, in submission order (all models; the `model` column
        says which)."""

    @property
    def closed(self) -> bool:
        """Whether `close` was called: from then on every operation raises `SessionClosedError`."""

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
        """Add a model with a new LoRA policy on the base (Tinker's
        `ServiceClient.create_lora_training_client`); resolves to its model id (default: a fresh one).

        `seed` makes the adapter's initialisation reproducible. The model's folder, where its history
        and W&B files go, is `<models root>/<model id>` unless `model_dir` says otherwise;
        `user_metadata` is kept with the model.
        """

    def model_ids(self) -> list[str]:
        """The engine's models, in the order they were created."""

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
    ) -> APIFuture[ForwardBackwardOutput]:
        """The loss `loss_fn` and its per-datum outputs (`logprobs` among them) on `data`, without
        touching gradients (Tinker's `TrainingClient.forward`).

        `data` holds `Datum`s (ours, the SDK's, or dicts with their fields); `loss_fn_config` sets the
        loss's parameters (e.g. PPO's clip thresholds).
        """

    def forward_backward(
        self,
        model_id: str,
        role: Role,
        data: Sequence[Any],
        loss_fn: str,
        loss_fn_config: Mapping[str, float] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """As `forward`, and the loss's gradient is added to the accumulated one: gradients accumulate
        over calls until `optim_step` applies them (Tinker's `TrainingClient.forward_backward`)."""

    def forward_backward_custom(
        self, model_id: str, role: Role, data: Sequence[Any], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """Train on any differentiable function of the per-datum logprobs: `loss_fn(data, logprobs)`
        gives `(loss, metrics)`, and the loss's gradient is accumulated as `forward_backward`'s is
        (Tinker's `TrainingClient.forward_backward_custom`)."""

    def optim_step(self, model_id: str, role: Role, adam_params: Any = None) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradient with AdamW and every field of `adam_params` (an `AdamParams`,
        the SDK's, or a dict; default `AdamParams()`, whose weight decay is 0 as Tinker's is), then start
        a new one; the step and the weights version move on by one (Tinker's `TrainingClient.optim_step`)."""

    # sampling
    def pin_sampler(
        self, model_id: str | None, version: int | None = None, *, inflight: bool = False
    ) -> APIFuture[SamplerPin]:
        """Hold the weights a sampling client samples: the model's policy at `version` (default: the
        weights the operations queued before this call leave), or the base model (`model_id=None`), until
        `release_sampler` (Tinker's `save_weights_and_get_sampling_client`). With `inflight`, the pin
        moves the model's shared inflight target to those weights and follows the target from then on
        (Tinker's `kind="inflight"`): every inflight client of the model samples the newest inflight
        save's weights; `version` must then be None."""

    def pin_sampler_checkpoint(self, path: str | Path) -> APIFuture[SamplerPin]:
        """Hold the weights of a saved checkpoint for sampling, named by its `tinker://` path: sampler
        weights, or the policy of a state checkpoint (Tinker's `create_sampling_client(model_path=...)`);
        training the live models does not change them."""

    def release_sampler(self, pin: APIFuture[SamplerPin], wait: bool = False) -> None:
        """Let go of pinned weights (a sampling client that is dropped or closed), after everything
        queued before; takes no lock, so a finalizer may call it. With `wait` (never from a finalizer),
        return once they are released."""

    def sample(
        self,
        pin: APIFuture[SamplerPin],
        request: SampleRequest | CheckedSample,
        token_sink: TokenSink | None = None,
    ) -> APIFuture[SampleResponse]:
        """Sample `request.num_samples` continuations of `request.prompt` from the pinned weights, each
        with the logprob of every sampled token (Tinker's `SamplingClient.sample`).

        The request was checked as it was built of everything that needs no model (`SampleRequest`); what
        needs the model (token ids within the vocabulary, `max_tokens` within the context, widths capped
        by the vocabulary) is checked before anything is queued, and a refused request raises a
        ValueError and changes nothing; a request this engine's `check_sample` passed is not checked
        again. Sampled tokens' logprobs follow the temperature rule of
        `workbench.types.SampledSequence`; the prompt's logprobs and scores (top-k, target ids, draws) are
        the model's own, as `workbench.types.SampleResponse` says.

        Every sequence gets a `sequence_id` unique in this engine; a caller that must know the ids before
        the sequences exist (the REST server promises them with the request) names them in
        `request.sequence_ids`. With `request.record_stability_info`, the engine keeps each sequence
        (prompt, tokens, the sampler's logprobs, the weights) for a day, for `stable_reinforce` training
        data that names it. `token_sink` (the engine's own, not the SDK's: the compatible APIs' streams
        use it) is told each sequence's tokens as they are drawn, from the engine's worker thread
        (`requests.TokenSink`); an engine that answers a request whole tells it nothing, and its caller
        reads the tokens from the response.
        """

    def check_sample(self, request: SampleRequest) -> CheckedSample:
        """Raise the ValueError `sample` would raise for `request`, queueing nothing: what the caller
        checks before it resolves weights or queues the first of several requests (the compatible APIs'
        calls), so a refused request changes nothing; what passed is sampled without a second check."""

    def compute_logprobs(
        self,
        pin: APIFuture[SamplerPin],
        prompt: ModelInput | Sequence[int],
        *,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[list[float | None]]:
        """The logprob of every token of `prompt` given the ones before it, from the pinned weights: the
        first entry None, and with `prompt_logprobs_last_n` every entry before the last N (Tinker's
        `SamplingClient.compute_logprobs`)."""

    # checkpoints
    def save_state(
        self,
        model_id: str,
        name: str,
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """Save the model's state, to resume from (its weights and optimizer state), as checkpoint `name`
        after the operations queued before; `.path` is `tinker://<model id>/weights/<name>` (Tinker's
        `TrainingClient.save_state`).

        With `ttl_seconds` the checkpoint expires that long after (None: never); `overwrite` replaces
        a checkpoint of that name, metadata included; `user_metadata` is stored with it and listed.
        """

    def save_weights_for_sampler(
        self,
        model_id: str,
        name: str,
        *,
        overwrite: bool = False,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save the policy's adapter for sampling as `name`, after the operations queued before; `.path`
        is `tinker://<model id>/sampler_weights/<name>`, which `pin_sampler_checkpoint` loads (Tinker's
        `TrainingClient.save_weights_for_sampler`). The options are `save_state`'s."""

    def save_weights_external(
        self,
        model_id: str,
        name: str,
        *,
        ttl_seconds: int | None = None,
        age_encryption_recipients: Sequence[str] | None = None,
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """Save the policy's adapter in peft's format as external weights `name`, after the operations
        queued before; `.path` is `tinker://<model id>/external_weights/<name>`, listed and deleted like
        any checkpoint (Tinker's `TrainingClient.save_weights_external`). With
        `age_encryption_recipients` (age or SSH public keys), every file is encrypted to them."""

    def load_state(self, model_id: str, path: str | Path, restore: Restore) -> APIFuture[LoadWeightsResponse]:
        """Load a state checkpoint (its `tinker://` path) into the model after the operations queued
        before, as far as `restore` says: `Restore.WEIGHTS` is Tinker's `load_state` (the optimizer
        starts afresh), `Restore.WITH_OPTIMIZER` its `load_state_with_optimizer`; the weights version
        moves on. `.path` names what was loaded."""

    def list_checkpoints(self, model_id: str) -> list[CheckpointInfo]:
        """The model's complete, unexpired checkpoints, oldest first (Tinker's
        `RestClient.list_checkpoints`)."""

    def delete_checkpoint(self, model_id: str, name: str, kind: CheckpointKind = "state") -> APIFuture[None]:
        """Delete the model's checkpoint `name` of `kind`, after the operations queued before (never
        racing a save of it)."""

    # misc
    def record(self, op: str, label: str, step: int, metrics: Mapping[str, float]) -> APIFuture[None]:
        """Append a row to the history after everything queued before it (e.g. a run step's metrics).
        Metrics named like the history's own columns (`step`, `op`, `model`, `time`) or not numbers
        raise ValueError here, before anything is queued."""

    def close(self) -> None:
        """Finish the queued operations, then free the models; safe to call again, also after an
        interrupted call."""


_DEPRECATED = {"RunStatus": "ModelStatus"}


def __getattr__(name: str) -> Any:
    """The deprecated names of this module's classes, with a DeprecationWarning."""
    if name in _DEPRECATED:
        warnings.warn(f"{name} is now {_DEPRECATED[name]}", DeprecationWarning, stacklevel=2)
        return globals()[_DEPRECATED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
