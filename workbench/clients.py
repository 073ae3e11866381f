"""Tinker-named clients over a Session: `TrainingClient` and `ServiceClient`.

Code written for the `tinker` SDK runs against these unchanged: the same method names and arguments,
and the same futures (`.result()`, `await`). A `TrainingClient` speaks for one model of the session:
the policy, the critic, or the reference (the base model with adapters off, forward only).
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from workbench.futures import APIFuture
from workbench.sampling import operations
from workbench.types import (
    ForwardBackwardOutput,
    LoraConfig,
    ModelInput,
    OptimStepResponse,
    SampleResponse,
    SamplingParams,
)

if TYPE_CHECKING:
    from pathlib import Path

    from workbench.forward_backward import CustomLossFn
    from workbench.session import Session
    from workbench.types import LoadWeightsResponse, SaveWeightsForSamplerResponse, SaveWeightsResponse


@dataclass(frozen=True)
class ModelInfo:
    """What `TrainingClient.get_info()` reports (Tinker's `GetInfoResponse`, flattened)."""

    model_id: str
    model_name: str
    lora_rank: int | None
    is_lora: bool


class TrainingClient:
    """Trains one model of a session with Tinker's methods; every call returns an `APIFuture`."""

    def __init__(self, session: Session, role: str):
        self._session = session
        self.role = role

    def __repr__(self) -> str:
        return f"TrainingClient({self.role}, step={self.step}, weights_version={self.weights_version})"

    @property
    def session(self) -> Session:
        return self._session

    @property
    def step(self) -> int:
        """Optimizer steps applied to this model (0 for the frozen reference)."""
        adapter = self._session._adapters.get(self.role)
        return adapter.step if adapter else 0

    @property
    def weights_version(self) -> int:
        """Bumped by every change of this model's weights (each applied optim_step, each load)."""
        adapter = self._session._adapters.get(self.role)
        return adapter.weights_version if adapter else 0

    def forward_backward(
        self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Compute the loss and add its gradient to the accumulated one (applied by `optim_step`).

        Each datum's output has `logprobs` (the critic: `values`) and `elementwise_loss`, one value per
        position; `metrics` has `loss:sum` and diagnostics such as `entropy:mean`.
        """
        return self._session._submit_forward(self.role, data, loss_fn, loss_fn_config, backward=True)

    def forward(
        self, data: Sequence[Any], loss_fn: str, loss_fn_config: Mapping[str, float] | None = None
    ) -> APIFuture[ForwardBackwardOutput]:
        """Like `forward_backward`, without touching gradients."""
        return self._session._submit_forward(self.role, data, loss_fn, loss_fn_config, backward=False)

    def forward_backward_custom(self, data: Sequence[Any], loss_fn: CustomLossFn) -> APIFuture[ForwardBackwardOutput]:
        """Train on any differentiable function of the per-datum logprobs.

        `loss_fn(data, logprobs_list) -> (loss, metrics)` gets one logprob tensor per datum (length of
        its targets, with autograd) and returns a scalar loss and a dict of float metrics. The result's
        `loss:sum` is the loss's value; the gradient accumulates as with `forward_backward`.
        """
        return self._session._submit_custom(self.role, data, loss_fn)

    def optim_step(self, adam_params: Any = None) -> APIFuture[OptimStepResponse]:
        """Apply the accumulated gradient with AdamW, using every field of `adam_params` (Tinker's
        `AdamParams`, ours, or a dict; None = defaults). Metrics: `grad_norm` (before clipping),
        `learning_rate`, `step`, `applied`."""
        return self._session._submit_optim_step(self.role, adam_params)

    def save_state(self, name: str, overwrite: bool = False) -> APIFuture[SaveWeightsResponse]:
        """Save the whole session's state (policy and critic, optimizers, counters, weight versions, RNG
        states, config), whichever client is asked, to `<run_dir>/checkpoints/<name>`; `.path` is that
        folder. Atomic: the folder appears complete or not at all. An existing name needs `overwrite=True`.
        Accumulated gradients not yet applied are saved too, and come back on load."""
        from workbench.checkpoints import save_state

        return save_state(self._session, name, overwrite)

    def load_state(self, path: str | Path) -> APIFuture[LoadWeightsResponse]:
        """Load a `save_state` checkpoint (a folder, or a checkpoint name of this run) into this session:
        every model's weights, optimizer state and counters, and the RNG states. The checkpoint is
        verified (file hashes, base model, adapter shapes) before anything changes; an error names the
        problem and leaves the session as it was. Each weights_version becomes max(saved, current) + 1."""
        from workbench.checkpoints import load_state

        return load_state(self._session, path)

    def save_weights_for_sampler(self, name: str, overwrite: bool = False) -> APIFuture[SaveWeightsForSamplerResponse]:
        """Save the policy's adapter as a peft folder, `<run_dir>/sampler_weights/<name>` (`.path`), that
        `peft.AutoPeftModelForCausalLM.from_pretrained(path)` and vLLM's `LoRARequest` load on their own."""
        from workbench.checkpoints import save_weights_for_sampler

        return save_weights_for_sampler(self._session, self.role, name, overwrite)

    def save_weights_and_get_sampling_client(self, name: str | None = None) -> SamplingClient:
        """A sampling client pinned to this model's current weights (`name` is accepted for Tinker
        compatibility and ignored: the weights stay in memory, nothing is written)."""
        if self.role != "policy":
            raise ValueError(f"only the policy samples; the {self.role} does not")
        return self._session.sampling_client()

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._session.tokenizer

    def get_info(self) -> ModelInfo:
        lora: LoraConfig | None = self._session.config.lora if self.role == "policy" else None
        return ModelInfo(
            model_id=self.role,
            model_name=self._session.config.base_model,
            lora_rank=lora.rank if lora else None,
            is_lora=self.role != "reference",
        )


class SamplingClient:
    """Samples from fixed weights: the policy's at the version it was created from, or the base model.

    Tinker's snapshot semantics: later optimizer steps do not change what this client samples. Every
    `SampleResponse` reports the version it used. The client holds on to its version's weights (a copy
    is made only once the policy has moved on) until it is garbage-collected or `close()`d.
    """

    def __init__(self, session: Session, version: int | None):
        self._session = session
        self._version = version  # None: the base model, adapters off
        session._pin_version(version)
        self._release = weakref.finalize(self, session._unpin_version, version)

    @property
    def weights_version(self) -> int | None:
        """The policy weight version this client samples; None for the base model."""
        return self._version

    @property
    def is_base(self) -> bool:
        return self._version is None

    def __repr__(self) -> str:
        what = "base model" if self._version is None else f"policy weights_version={self._version}"
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
        return operations.submit_sample(self._session, self._version, prompt, num_samples, sampling_params, include_prompt_logprobs)

    def compute_logprobs(self, prompt: ModelInput | Sequence[int]) -> APIFuture[list[float | None]]:
        """The logprob of every token of `prompt` given the ones before it (first entry None)."""
        return operations.submit_compute_logprobs(self._session, self._version, prompt)

    def get_tokenizer(self) -> PreTrainedTokenizerBase:
        return self._session.tokenizer

    def get_base_model(self) -> str:
        return self._session.config.base_model

    def close(self) -> None:
        """Release the pinned weights now rather than at garbage collection."""
        self._release()


class ServiceClient:
    """Tinker's entry point: creates training clients, each on a Session of its own.

    `ServiceClient(...)` accepts and ignores Tinker's connection arguments (`base_url`, `api_key`, ...),
    so scripts written for the hosted service run locally unchanged.
    """

    def __init__(self, **_connection_args: Any):
        self._sessions: list[Session] = []

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: Mapping[str, str] | None = None,
    ) -> TrainingClient:
        from workbench.session import Session

        lora = LoraConfig(rank=rank, seed=seed, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed)
        session = Session(base_model=base_model, lora=lora, seed=0 if seed is None else seed)
        self._sessions.append(session)
        return session.policy

    def close(self) -> None:
        for session in self._sessions:
            session.close()
        self._sessions.clear()

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
