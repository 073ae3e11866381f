"""Tinker-named clients over a Session: `TrainingClient` and `ServiceClient`.

Code written for the `tinker` SDK runs against these unchanged: the same method names and arguments,
and the same futures (`.result()`, `await`). A `TrainingClient` speaks for one model of the session:
the policy, the critic, or the reference (the base model with adapters off, forward only).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from transformers import PreTrainedTokenizerBase

from workbench.futures import APIFuture
from workbench.types import ForwardBackwardOutput, LoraConfig, OptimStepResponse

if TYPE_CHECKING:
    from workbench.session import CustomLossFn, Session


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
