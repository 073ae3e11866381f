"""Tinker-named clients over an engine: `TrainingClient` and `SamplingClient` (and `ClientFuture`).

Code written for the `tinker` SDK (0.38) runs against these unchanged: every public method of the
SDK's clients, with the same parameters and defaults, returning the same kinds of futures (`.result()`,
`await`); the `*_async` twins behave as the SDK's (an `async` method that returns what the plain one
does, or the future of it). A `TrainingClient` speaks for one model of an engine: a run's policy, its
critic, or the reference (the base model with adapters off, forward only). A `SamplingClient` samples
fixed weights (Tinker's `kind="snapshot"`) or its model's shared inflight target (`kind="inflight"`),
pinned in submission order with the training operations (see `workbench.engine.local.sample`). Every call goes through the engine's public interface; the clients hold
no state of their own beyond which model they speak for.

SDK arguments with no local meaning are accepted. Those that cannot change a result are documented as
such (`retry_config`, `weights_access_token`: there is no network and no account); those that would
raise a `ValueError` saying so when set, before anything is
queued. The deliberate gaps are listed in docs/tinker-parity.md.
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

from transformers import PreTrainedTokenizerBase

from workbench.engine.interface import CustomLossFn, EngineInterface, Restore, SamplerPin
from workbench.engine.roles import Role
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.futures import APIFuture
from workbench.storage.model_folders import models_root
from workbench.types import (
    ForwardBackwardOutput,
    GetInfoResponse,
    LoadWeightsResponse,
    LoraConfig,
    ModelData,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
    SaveWeightsExternalResponse,
    SaveWeightsForSamplerResponse,
    SaveWeightsResponse,
)

C = TypeVar("C")


class ClientFuture(APIFuture[C], Generic[C]):
    """A future of a client, as the SDK's `create_*` methods return: awaitable, `.result()`, and
    attribute access goes to the client (waiting for it), so code that used the return value as the
    client keeps working."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.result(), name)


def client_future(future: APIFuture[C]) -> ClientFuture[C]:
    """The client `future` resolves to, as a `ClientFuture`."""
    return ClientFuture(future.future(), future.worker)


SAMPLING_CLIENT_KINDS = ("snapshot", "inflight")
"""The SDK's `SamplingClientKind`: fixed weights, or the training model's shared inflight target."""


def check_sampling_kind(kind: object) -> None:
    """The SDK refuses any other kind as its request is built (a pydantic `ValidationError`, a
    ValueError), before anything is sent: so does this, before anything is queued."""
    if not isinstance(kind, str) or kind not in SAMPLING_CLIENT_KINDS:
        raise ValueError(f"kind: Input should be 'snapshot' or 'inflight', got {kind!r}")


def console_url() -> str:
    """Where this process's runs are: the local stand-in for the Tinker Console."""
    return models_root().as_uri()


class TrainingClient:
    """Trains one model of an engine with Tinker's methods; every call returns an `APIFuture`."""

    def __init__(self, engine: EngineInterface, model_id: str, role: Role = Role.POLICY):
        self._engine = engine
        self._model_id = model_id
        self._role = role
        self.on_batch: Callable[[Sequence[Any]], None] | None = None
        """Called with each `forward_backward` batch before it is sent: a session checks its run's
        first batch this way (`workbench.loops.data_checks`)."""

    @property
    def engine(self) -> EngineInterface:
        return self._engine

    @property
    def model_id(self) -> str:
        """Tinker's model id (also the training run id and the run's folder name)."""
        return self._model_id

    @property
    def role(self) -> Role:
        return self._role

    def __repr__(self) -> str:
        return f"TrainingClient({self._model_id!r}, {self._role.value}, step={self.step}, weights_version={self.weights_version})"

    @property
    def step(self) -> int:
        """Optimizer steps applied to this model (0 for the frozen reference)."""
        status = self._engine.model_status(self._model_id)
        if self._role is Role.POLICY:
            return status.step
        if self._role is Role.CRITIC and status.critic_step is not None:
            return status.critic_step
        return 0

    @property
    def weights_version(self) -> int:
        """Bumped by every change of this model's weights (each applied optim_step, each load)."""
        status = self._engine.model_status(self._model_id)
        if self._role is Role.POLICY:
            return status.weights_version
        if self._role is Role.CRITIC and status.critic_weights_version is not None:
            return status.critic_weights_version
        return 0

    # ------------------------------------------------------------------------------------------ training

    def forward_backward(
        self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Compute the loss and add its gradient to the accumulated one (applied by `optim_step`).

        Each datum's output has `logprobs` (the critic: `values`) and `elementwise_loss`, one value per
        position; `metrics` has `loss:sum` and diagnostics such as `entropy:mean`. `stable_reinforce`
        datums name sampled sequences in their provenance spans (see `workbench.engine.local.provenance`).
        """
        if self.on_batch is not None:
            self.on_batch(data)
        return self._engine.forward_backward(self._model_id, self._role, data, loss_fn, loss_fn_config)

    async def forward_backward_async(
        self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """The SDK's deprecated twin: `await` it for the future of `forward_backward`."""
        return self.forward_backward(data, loss_fn, loss_fn_config)

    def forward(
        self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Like `forward_backward`, without touching gradients."""
        return self._engine.forward(self._model_id, self._role, data, loss_fn, loss_fn_config)

    async def forward_async(
        self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """The SDK's deprecated twin: `await` it for the future of `forward`."""
        return self.forward(data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self,
        data: Sequence[Any],
        loss_fn: CustomLossFn,
        *,
        loss_type_input: Literal["logprobs"] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """Train on any differentiable function of the per-datum logprobs.

        `loss_fn(data, logprobs_list) -> (loss, metrics)` gets one logprob tensor per datum (length of
        its targets, with autograd) and returns a scalar loss and a dict of float metrics. The result's
        `loss:sum` is the loss's value; the gradient accumulates as with `forward_backward`.
        `loss_type_input` is the SDK's deprecated argument: the loss always receives logprobs.
        """
        if loss_type_input not in (None, "logprobs"):
            raise ValueError(f"loss_type_input must be None or 'logprobs', got {loss_type_input!r}")
        return self._engine.forward_backward_custom(self._model_id, self._role, data, loss_fn)

    async def forward_backward_custom_async(
        self,
        data: Sequence[Any],
        loss_fn: CustomLossFn,
        *,
        loss_type_input: Literal["logprobs"] | None = None,
    ) -> APIFuture[ForwardBackwardOutput]:
        """The SDK's deprecated twin: `await` it for the future of `forward_backward_custom`."""
        return self.forward_backward_custom(data, loss_fn, loss_type_input=loss_type_input)

    def optim_step(
        self, optim_params: Any = None, *, adam_params: Any = None
    ) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradient with AdamW, using every field of the `AdamParams` given as
        `optim_params` or (the SDK's legacy keyword) `adam_params`: Tinker's, ours, or a dict; None =
        defaults. The response's `metrics` has `grad_norm` (before clipping); `applied` and
        `skipped_reason` say whether the step ran."""
        if optim_params is not None and adam_params is not None:
            raise ValueError("give optim_params or the legacy adam_params, not both")
        params = optim_params if optim_params is not None else adam_params
        return self._engine.optim_step(self._model_id, self._role, params)

    async def optim_step_async(
        self, optim_params: Any = None, *, adam_params: Any = None
    ) -> APIFuture[OptimStepResponse]:
        """The SDK's deprecated twin: `await` it for the future of `optim_step`."""
        return self.optim_step(optim_params, adam_params=adam_params)

    # ------------------------------------------------------------------------------------------ checkpoints

    def save_state(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """Save the run's whole state (policy and critic, optimizers, counters, weight versions, RNG
        states, config), whichever of its training clients is asked, to `<model_dir>/checkpoints/<name>`;
        `.path` is its `tinker://<run>/weights/<name>` path, `.folder` the folder. Atomic: the folder
        appears complete or not at all. An existing name needs `overwrite=True`. Accumulated gradients
        not yet applied are saved too, and come back with `load_state_with_optimizer`.

        `ttl_seconds` is honoured: past it the checkpoint is no longer listed or loadable (None: kept
        until deleted). `user_metadata` is stored with it and returned by checkpoint listings.
        """
        return self._engine.save_state(
            self._model_id, name, overwrite=overwrite, ttl_seconds=ttl_seconds, user_metadata=user_metadata
        )

    async def save_state_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        overwrite: bool = False,
        user_metadata: Mapping[str, str] | None = None,
    ) -> APIFuture[SaveWeightsResponse]:
        """The SDK's deprecated twin: `await` it for the future of `save_state`."""
        return self.save_state(
            name, ttl_seconds=ttl_seconds, overwrite=overwrite, user_metadata=user_metadata
        )

    def load_state(
        self, path: str | Path, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        """Load the weights of a `save_state` checkpoint (a `tinker://` path, a folder, or a checkpoint
        name of this run) into this run's models; the optimizer state is left as it is (Tinker's
        `load_state`). The checkpoint is verified (file hashes, base model, adapter shapes) before
        anything changes; an error names the problem and leaves the run as it was. Each weights_version
        becomes max(saved, current) + 1. `weights_access_token` has no local meaning: every local
        checkpoint is readable."""
        return self._engine.load_state(self._model_id, path, Restore.WEIGHTS)

    async def load_state_async(
        self, path: str | Path, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        """The SDK's deprecated twin: `await` it for the future of `load_state`."""
        return self.load_state(path, weights_access_token)

    def load_state_with_optimizer(
        self, path: str | Path, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        """Like `load_state`, and the optimizer state, step counters and pending gradients too."""
        return self._engine.load_state(self._model_id, path, Restore.WITH_OPTIMIZER)

    async def load_state_with_optimizer_async(
        self, path: str | Path, weights_access_token: str | None = None
    ) -> APIFuture[LoadWeightsResponse]:
        """The SDK's deprecated twin: `await` it for the future of `load_state_with_optimizer`."""
        return self.load_state_with_optimizer(path, weights_access_token)

    def save_weights_for_sampler(
        self,
        name: str,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
        *,
        overwrite: bool = False,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save the policy's adapter as a peft folder, `<model_dir>/sampler_weights/<name>` (`.folder`;
        `.path` is `tinker://<run>/sampler_weights/<name>`), that `peft.AutoPeftModelForCausalLM` and
        vLLM's `LoRARequest` load on their own. `ttl_seconds` and `user_metadata` as for `save_state`."""
        self._require_policy("sampler weights")
        return self._engine.save_weights_for_sampler(
            self._model_id, name, overwrite=overwrite, ttl_seconds=ttl_seconds, user_metadata=user_metadata
        )

    async def save_weights_for_sampler_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        user_metadata: Mapping[str, str] | None = None,
        *,
        overwrite: bool = False,
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """The SDK's deprecated twin: `await` it for the future of `save_weights_for_sampler`."""
        return self.save_weights_for_sampler(name, ttl_seconds, user_metadata, overwrite=overwrite)

    def save_weights_external(
        self,
        name: str,
        ttl_seconds: int | None = None,
        age_encryption_recipients: list[str] | None = None,
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """Save the policy's adapter in the external format: peft's `adapter_config.json` and
        `adapter_model.safetensors` (what tinker-cookbook's `weights.build_lora_adapter` and
        `build_hf_model`, peft and vLLM read) in `<model_dir>/external_weights/<name>`; `.path` is
        `tinker://<run>/external_weights/<name>`, listed and deleted like any checkpoint, its files
        downloaded through `RestClient.get_external_weights_urls`. With `age_encryption_recipients`
        (1 to 10 `age1...` keys or SSH public keys) every file is age-encrypted to them and named
        `<file>.age`. `ttl_seconds` as for `save_state`."""
        self._require_policy("external weights")
        return self._engine.save_weights_external(
            self._model_id,
            name,
            ttl_seconds=ttl_seconds,
            age_encryption_recipients=age_encryption_recipients,
        )

    async def save_weights_external_async(
        self,
        name: str,
        ttl_seconds: int | None = None,
        age_encryption_recipients: list[str] | None = None,
    ) -> APIFuture[SaveWeightsExternalResponse]:
        """The SDK's deprecated twin: `await` it for the future of `save_weights_external`."""
        return self.save_weights_external(name, ttl_seconds, age_encryption_recipients)

    # ------------------------------------------------------------------------------------------ sampling

    def save_weights_and_get_sampling_client(
        self,
        name: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
        kind: Literal["snapshot", "inflight"] = "snapshot",
    ) -> ClientFuture[SamplingClient]:
        """A sampling client for this model's weights as the operations submitted before this call leave
        them. Nothing is written: the weights stay in memory (`name` is the SDK's deprecated argument
        and has no effect there either). `kind="snapshot"` keeps those weights whatever trains after;
        `kind="inflight"` moves this model's shared inflight target to them, and the client (with every
        earlier inflight one) samples whatever the latest inflight save published, never older than
        its own (the SDK's contract, `tinker.types.SamplingClientKind`); the future resolves once the
        target has moved. With `record_stability_info`, every sample is recorded for
        `stable_reinforce`. `retry_config` has no local meaning (nothing to retry). Returns a future of
        the client, which also forwards the client's methods."""
        self._require_policy("a sampling client")
        check_sampling_kind(kind)
        client = SamplingClient(
            self._engine,
            self._engine.pin_sampler(self._model_id, inflight=kind == "inflight"),
            record_stability_info=record_stability_info,
        )
        return client_future(client.pinned().then(lambda _: client))

    async def save_weights_and_get_sampling_client_async(
        self,
        name: str | None = None,
        retry_config: Any = None,
        record_stability_info: bool = False,
        kind: Literal["snapshot", "inflight"] = "snapshot",
    ) -> SamplingClient:
        """The SDK's deprecated twin: the sampling client itself."""
        return await self.save_weights_and_get_sampling_client(
            name, retry_config, record_stability_info, kind
        )

    def create_sampling_client(
        self, model_path: str | Path, retry_config: Any = None, record_stability_info: bool = False
    ) -> ClientFuture[SamplingClient]:
        """A sampling client of saved weights: sampler weights (`tinker://<model>/sampler_weights/<name>`)
        or a state checkpoint's policy (`tinker://<model>/weights/<name>`), or their folders. It samples
        those weights, whatever the live models do afterwards. `record_stability_info` and
        `retry_config` as for `save_weights_and_get_sampling_client`."""
        client = SamplingClient(
            self._engine,
            self._engine.pin_sampler_checkpoint(model_path),
            record_stability_info=record_stability_info,
        )
        return client_future(client.pinned().then(lambda _: client))

    async def create_sampling_client_async(
        self, model_path: str | Path, retry_config: Any = None, record_stability_info: bool = False
    ) -> SamplingClient:
        """The SDK's deprecated twin: the sampling client itself."""
        return await self.create_sampling_client(model_path, retry_config, record_stability_info)

    def _require_policy(self, what: str) -> None:
        if self._role is not Role.POLICY:
            raise ValueError(f"only the policy has {what}; the {self._role} does not")

    # ------------------------------------------------------------------------------------------ info

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._engine.tokenizer

    def get_info(self) -> GetInfoResponse:
        """The model's base, LoRA rank and optimizer, in the shape of Tinker's `GetInfoResponse`
        (`.model_data.model_name` is the base model as the engine was made with it, `.tokenizer_id`
        the folder or HF id its tokenizer loads from)."""
        lora: LoraConfig | None = None
        if self._role is not Role.REFERENCE:
            status = self._engine.model_status(self._model_id)
            lora = status.lora if self._role is Role.POLICY else status.critic_lora
        base = self._engine.base_info
        model_name = self._engine.config.base_model
        return GetInfoResponse(
            model_data=ModelData(arch=base.model_type, model_name=model_name, tokenizer_id=base.path),
            model_id=self._model_id,
            is_lora=lora is not None,
            lora_rank=None if lora is None else lora.rank,
            model_name=model_name,
        )

    async def get_info_async(self) -> GetInfoResponse:
        """The SDK's deprecated twin of `get_info`."""
        return self.get_info()

    def get_telemetry(self) -> None:
        """No telemetry is collected locally."""
        return None

    def get_console_url(self) -> str:
        """The models root, where the Tinker Console would be."""
        return console_url()


class SamplingClient:
    """Samples from fixed weights: a run's policy at the version its pin took, a saved checkpoint, or
    the base model; or, made with `kind="inflight"`, its run's shared inflight target.

    Tinker's snapshot semantics: later optimizer steps do not change what this client samples (an
    inflight client samples what the run's latest inflight save published when each request runs). Its pin
    runs in order with the training operations, so a client created after queued steps samples the
    weights those steps leave. Every `SampleResponse` reports the version it used. The client holds on
    to its weights (a copy is made only once the policy has moved on) until it is garbage-collected or
    `close()`d. With `record_stability_info`, the engine keeps what `stable_reinforce` needs of every
    sequence it samples (for a day), under its `sequence_id`.
    """

    def __init__(
        self, engine: EngineInterface, pin: APIFuture[SamplerPin], *, record_stability_info: bool = False
    ):
        self._engine = engine
        self._pin = pin
        self._record_stability_info = bool(record_stability_info)
        self._release = weakref.finalize(self, engine.release_sampler, pin)

    def pinned(self) -> APIFuture[SamplerPin]:
        """The pin of this client's weights, resolved once the operations queued before it have run."""
        return self._pin

    @property
    def weights_version(self) -> int | None:
        """The policy weight version this client samples (waits for the pin); None for the base model.
        For an inflight client, the version it was made with: the oldest it samples (each response
        says which version produced it)."""
        return self._pin.result().version

    @property
    def is_inflight(self) -> bool:
        """Whether this client follows its run's inflight target (`kind="inflight"`)."""
        return self._pin.result().inflight

    @property
    def is_base(self) -> bool:
        return self._pin.result().is_base

    @property
    def records_stability_info(self) -> bool:
        return self._record_stability_info

    def __repr__(self) -> str:
        if not self._pin.done():
            return "SamplingClient(pinning ...)"
        pin = self._pin.result()
        if pin.is_base:
            what = "base model"
        elif pin.folder is not None:
            what = f"checkpoint {pin.folder.name}"
        elif pin.inflight:
            what = f"{pin.model_id} inflight, from weights_version={pin.version}"
        else:
            what = f"{pin.model_id} weights_version={pin.version}"
        return f"SamplingClient({what})"

    def sample(
        self,
        prompt: ModelInput | Sequence[int],
        num_samples: int,
        sampling_params: SamplingParams | Mapping[str, Any],
        include_prompt_logprobs: bool = False,
        topk_prompt_logprobs: int = 0,
        topk_sample_logprobs: int = 0,
        target_prompt_logprobs: Any = None,
        prompt_alt_tokens_k: int = 0,
        prompt_logprobs_last_n: int | None = None,
    ) -> APIFuture[SampleResponse]:
        """Sample `num_samples` continuations of `prompt`, with the logprob of every sampled token.

        With `include_prompt_logprobs`, the response's `prompt_logprobs` has one entry per prompt token
        (the first is None: nothing predicts it; with `prompt_logprobs_last_n`, all but the last N).
        `topk_prompt_logprobs=k`: the k most likely tokens at every prompt position
        (`response.topk_prompt_logprobs`); `topk_sample_logprobs=k`: at every generated position
        (`sequence.topk_logprobs`); `target_prompt_logprobs`: a (len(prompt) − 1, K) int tensor of ids to
        score at prompt positions 1.. (−1: nothing; dense or the SDK's sparse CSR), answered as a float32
        tensor of the same shape; `prompt_alt_tokens_k=k`: k draws at the request's temperature at every
        prompt position after the first (`response.prompt_alt_tokens`). k is capped by the vocabulary
        only. Sampled tokens' logprobs follow the temperature rule of `workbench.types.SampledSequence`
        (the tempered distribution they were drawn from); prompt scores and `compute_logprobs` are the
        model's own (τ = 1). Concurrent calls are generated together. A bad argument raises a
        ValueError naming it before anything is queued (as the `SampleRequest` is built, or as the engine
        checks it against the model).
        """
        request = SampleRequest(
            prompt,
            num_samples,
            sampling_params,
            include_prompt_logprobs,
            prompt_logprobs_last_n=prompt_logprobs_last_n,
            record_stability_info=self._record_stability_info,
            topk_prompt_logprobs=topk_prompt_logprobs,
            topk_sample_logprobs=topk_sample_logprobs,
            target_prompt_logprobs=target_prompt_logprobs,
            prompt_alt_tokens_k=prompt_alt_tokens_k,
        )
        return self._engine.sample(self._pin, request)

    async def sample_async(self, *args: Any, **kwargs: Any) -> SampleResponse:
        """The SDK's deprecated twin of `sample`, with its parameters: the `SampleResponse` itself."""
        return await self.sample(*args, **kwargs)

    # what `help()`, `inspect` and a notebook's completion show: `sample`'s parameters
    sample_async.__signature__ = inspect.signature(sample).replace(  # type: ignore[attr-defined]
        return_annotation="SampleResponse"
    )

    def compute_logprobs(
        self, prompt: ModelInput | Sequence[int], prompt_logprobs_last_n: int | None = None
    ) -> APIFuture[list[float | None]]:
        """The logprob of every token of `prompt` given the ones before it (first entry None; with
        `prompt_logprobs_last_n`, every entry before the last N), under the model's own distribution
        (τ = 1: what `forward` computes, whatever temperature a sample used)."""
        return self._engine.compute_logprobs(self._pin, prompt, prompt_logprobs_last_n=prompt_logprobs_last_n)

    async def compute_logprobs_async(
        self, prompt: ModelInput | Sequence[int], prompt_logprobs_last_n: int | None = None
    ) -> list[float | None]:
        """The SDK's deprecated twin: the logprobs themselves."""
        return await self.compute_logprobs(prompt, prompt_logprobs_last_n)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._engine.tokenizer

    def get_base_model(self) -> str:
        return self._engine.config.base_model

    async def get_base_model_async(self) -> str:
        """The SDK's deprecated twin of `get_base_model`."""
        return self.get_base_model()

    def get_telemetry(self) -> None:
        """No telemetry is collected locally."""
        return None

    def on_queue_state_change(self, queue_state: Any, queue_state_reason: str | None) -> None:
        """The SDK's hook for server queue pauses; a local engine has no queue to pause."""

    def close(self) -> None:
        """Release the pinned weights now rather than at garbage collection (returns once released)."""
        if self._release.detach() is not None:
            self._engine.release_sampler(self._pin, wait=True)
