"""Tinker-named clients over an engine: `TrainingClient`, `SamplingClient` and `ServiceClient`.

Code written for the `tinker` SDK runs against these unchanged: the same method names and arguments,
and the same futures (`.result()`, `await`). A `TrainingClient` speaks for one model of an engine: a
run's policy, its critic, or the reference (the base model with adapters off, forward only). A
`SamplingClient` samples fixed weights, pinned in submission order with the training operations (see
`workbench.engine.sampling`). Every call goes through the engine's public interface; the clients hold
no state of their own beyond which model they speak for.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from transformers import PreTrainedTokenizerBase

from workbench.engine import CustomLossFn, Engine, Restore, Role, SamplerPin
from workbench.futures import APIFuture
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

C = TypeVar("C")


class ClientFuture(APIFuture[C], Generic[C]):
    """A future of a client, as the SDK's `create_*` methods return: awaitable, `.result()`, and
    attribute access goes to the client (waiting for it), so code that used the return value as the
    client keeps working."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.result(), name)


def _client_future(future: APIFuture[C]) -> ClientFuture[C]:
    return ClientFuture(future.future(), future.worker)


@dataclass(frozen=True)
class ModelInfo:
    """What `TrainingClient.get_info()` reports (Tinker's `GetInfoResponse`, flattened)."""

    model_id: str
    model_name: str
    lora_rank: int | None
    is_lora: bool


class TrainingClient:
    """Trains one model of an engine with Tinker's methods; every call returns an `APIFuture`."""

    def __init__(self, engine: Engine, model_id: str, role: Role = Role.POLICY):
        self._engine = engine
        self._model_id = model_id
        self._role = role

    @property
    def engine(self) -> Engine:
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
        status = self._engine.run_status(self._model_id)
        if self._role is Role.POLICY:
            return status.step
        if self._role is Role.CRITIC and status.critic_step is not None:
            return status.critic_step
        return 0

    @property
    def weights_version(self) -> int:
        """Bumped by every change of this model's weights (each applied optim_step, each load)."""
        status = self._engine.run_status(self._model_id)
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
        position; `metrics` has `loss:sum` and diagnostics such as `entropy:mean`.
        """
        return self._engine.forward_backward(self._model_id, self._role, data, loss_fn, loss_fn_config)

    def forward(
        self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Like `forward_backward`, without touching gradients."""
        return self._engine.forward(self._model_id, self._role, data, loss_fn, loss_fn_config)

    def forward_backward_custom(
        self, data: Sequence[Any], loss_fn: CustomLossFn
    ) -> APIFuture[ForwardBackwardOutput]:
        """Train on any differentiable function of the per-datum logprobs.

        `loss_fn(data, logprobs_list) -> (loss, metrics)` gets one logprob tensor per datum (length of
        its targets, with autograd) and returns a scalar loss and a dict of float metrics. The result's
        `loss:sum` is the loss's value; the gradient accumulates as with `forward_backward`.
        """
        return self._engine.forward_backward_custom(self._model_id, self._role, data, loss_fn)

    def optim_step(self, adam_params: Any = None) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradient with AdamW, using every field of `adam_params` (Tinker's
        `AdamParams`, ours, or a dict; None = defaults). Metrics: `grad_norm` (before clipping),
        `learning_rate`, `step`, `applied`."""
        return self._engine.optim_step(self._model_id, self._role, adam_params)

    # ------------------------------------------------------------------------------------------ checkpoints

    def save_state(self, name: str, overwrite: bool = False) -> APIFuture[SaveWeightsResponse]:
        """Save the run's whole state (policy and critic, optimizers, counters, weight versions, RNG
        states, config), whichever of its training clients is asked, to `<run_dir>/checkpoints/<name>`;
        `.path` is its `tinker://<run>/weights/<name>` path, `.folder` the folder. Atomic: the folder
        appears complete or not at all. An existing name needs `overwrite=True`. Accumulated gradients
        not yet applied are saved too, and come back with `load_state_with_optimizer`."""
        return self._engine.save_state(self._model_id, name, overwrite=overwrite)

    def load_state(self, path: str | Path) -> APIFuture[LoadWeightsResponse]:
        """Load the weights of a `save_state` checkpoint (a `tinker://` path, a folder, or a checkpoint
        name of this run) into this run's models; the optimizer state is left as it is. The checkpoint is
        verified (file hashes, base model, adapter shapes) before anything changes; an error names the
        problem and leaves the run as it was. Each weights_version becomes max(saved, current) + 1."""
        return self._engine.load_state(self._model_id, path, Restore.WEIGHTS)

    def load_state_with_optimizer(self, path: str | Path) -> APIFuture[LoadWeightsResponse]:
        """Like `load_state`, and the optimizer state, step counters and pending gradients too."""
        return self._engine.load_state(self._model_id, path, Restore.WITH_OPTIMIZER)

    def save_weights_for_sampler(
        self, name: str, overwrite: bool = False
    ) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save the policy's adapter as a peft folder, `<run_dir>/sampler_weights/<name>` (`.folder`;
        `.path` is `tinker://<run>/sampler_weights/<name>`), that `peft.AutoPeftModelForCausalLM` and
        vLLM's `LoRARequest` load on their own."""
        self._require_policy("sampler weights")
        return self._engine.save_weights_for_sampler(self._model_id, name, overwrite=overwrite)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> ClientFuture[SamplingClient]:
        """A sampling client for this model's weights as the operations submitted before this call leave
        them (`name` is accepted for Tinker compatibility and ignored: the weights stay in memory,
        nothing is written). Returns a future of the client, which also forwards the client's methods."""
        self._require_policy("a sampling client")
        client = SamplingClient(self._engine, self._engine.pin_sampler(self._model_id))
        return _client_future(client.pinned().then(lambda _: client))

    def _require_policy(self, what: str) -> None:
        if self._role is not Role.POLICY:
            raise ValueError(f"only the policy has {what}; the {self._role} does not")

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._engine.tokenizer

    def get_info(self) -> ModelInfo:
        lora: LoraConfig | None = (
            self._engine.run_status(self._model_id).lora if self._role is Role.POLICY else None
        )
        return ModelInfo(
            model_id=self._model_id,
            model_name=self._engine.config.base_model,
            lora_rank=lora.rank if lora else None,
            is_lora=self._role is not Role.REFERENCE,
        )


class SamplingClient:
    """Samples from fixed weights: a run's policy at the version its pin took, a sampler checkpoint, or
    the base model.

    Tinker's snapshot semantics: later optimizer steps do not change what this client samples. Its pin
    runs in order with the training operations, so a client created after queued steps samples the
    weights those steps leave. Every `SampleResponse` reports the version it used. The client holds on
    to its weights (a copy is made only once the policy has moved on) until it is garbage-collected or
    `close()`d.
    """

    def __init__(self, engine: Engine, pin: APIFuture[SamplerPin]):
        self._engine = engine
        self._pin = pin
        self._release = weakref.finalize(self, engine.release_sampler, pin)

    def pinned(self) -> APIFuture[SamplerPin]:
        """The pin of this client's weights, resolved once the operations queued before it have run."""
        return self._pin

    @property
    def weights_version(self) -> int | None:
        """The policy weight version this client samples (waits for the pin); None for the base model."""
        return self._pin.result().version

    @property
    def is_base(self) -> bool:
        return self._pin.result().is_base

    def __repr__(self) -> str:
        if not self._pin.done():
            return "SamplingClient(pinning ...)"
        pin = self._pin.result()
        if pin.is_base:
            what = "base model"
        elif pin.folder is not None:
            what = f"checkpoint {pin.folder.name}"
        else:
            what = f"{pin.model_id} weights_version={pin.version}"
        return f"SamplingClient({what})"

    def sample(
        self,
        prompt: ModelInput | Sequence[int],
        num_samples: int,
        sampling_params: SamplingParams | Mapping[str, Any],
        include_prompt_logprobs: bool = False,
    ) -> APIFuture[SampleResponse]:
        """Sample `num_samples` continuations of `prompt`, with the logprob of every sampled token.

        With `include_prompt_logprobs`, the response's `prompt_logprobs` has one entry per prompt token
        (the first is None: nothing predicts it). Concurrent calls are generated together.
        """
        return self._engine.sample(self._pin, prompt, num_samples, sampling_params, include_prompt_logprobs)

    def compute_logprobs(self, prompt: ModelInput | Sequence[int]) -> APIFuture[list[float | None]]:
        """The logprob of every token of `prompt` given the ones before it (first entry None)."""
        return self._engine.compute_logprobs(self._pin, prompt)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._engine.tokenizer

    def get_base_model(self) -> str:
        return self._engine.config.base_model

    def close(self) -> None:
        """Release the pinned weights now rather than at garbage collection (returns once released)."""
        if self._release.detach() is not None:
            self._engine.release_sampler(self._pin, wait=True)


class ServiceClient:
    """Tinker's entry point: creates training and sampling clients on local engines, one engine per base
    model, shared by every client made for it (one copy of the base in memory).

    `ServiceClient(...)` accepts Tinker's connection arguments (`base_url`, `api_key`, ...) and ignores
    them, so scripts written for the hosted service run locally unchanged.
    """

    def __init__(self, **_connection_args: Any):
        self._engines: dict[str, Engine] = {}

    def engine(self, base_model: str) -> Engine:
        """The engine for `base_model`, started on first use."""
        if base_model not in self._engines:
            self._engines[base_model] = Engine(base_model, sampler="hf")
        return self._engines[base_model]

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: Mapping[str, str] | None = None,
    ) -> ClientFuture[TrainingClient]:
        lora = LoraConfig(
            rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed
        )
        engine = self.engine(base_model)
        model_id = engine.create_model(lora, seed=0 if seed is None else seed, user_metadata=user_metadata)
        return _client_future(model_id.then(lambda created: TrainingClient(engine, created)))

    def close(self) -> None:
        for engine in self._engines.values():
            engine.close()
        self._engines.clear()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
