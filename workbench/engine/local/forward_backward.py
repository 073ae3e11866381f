"""`forward`, `forward_backward` and `forward_backward_custom`: from the caller's data to the result.

In the caller's thread, every datum is checked against the loss (`resolve_loss`, `batching.prepare_batch`):
bad input raises a `ValueError` naming the datum and field, and nothing is queued. On the worker thread,
in submission order, a built-in-loss call goes partition → accumulate → record (`LossCall`): its datums
are parted into those that train and those whose loss has no gradient (the input that scales every term
of the loss, `LossSpec.gradient_scale`, is 0 throughout: a group RL prompt whose completions got equal
rewards), which run forward only; each part is planned into passes (`call_plan`: shared-prefix groups,
length-grouped micro-batches, stream chunks); each pass is computed (`pass_computation`: the
prediction, the loss, the pass's own gradient) and its outputs, metric sums and gradient are added up in
pass order; the per-datum outputs come back in input order, the metrics as `name:reduction`, and the
call's row goes to the history with the tokens computed and submitted (`computed_tokens:sum`,
`submitted_tokens:sum`). A training call adds its gradient to the accumulated one only when the whole
call succeeded and its gradient is finite (`TrainableAdapter.accumulating`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from workbench.engine.interface import CustomLossFn
from workbench.engine.local.call_plan import (
    CallPlan,
    Pass,
    collate_pass,
    plan_call,
    token_counts,
    without_gradient,
)
from workbench.engine.local.collectives import RankCallFailedError
from workbench.engine.local.heap import release_freed_memory
from workbench.engine.local.lora_models import LoraModel
from workbench.engine.local.pass_computation import (
    ChunkResult,
    MetricTotals,
    PassComputation,
    predict,
    scatter_outputs,
)
from workbench.engine.local.provenance import attach_sampling_records
from workbench.engine.local.state import EngineState
from workbench.engine.local.streams import run_on_streams
from workbench.engine.model.batching import PreparedDatum, prepare_batch
from workbench.engine.model.prefix_parts import kept_tokens
from workbench.engine.roles import Role
from workbench.futures import APIFuture
from workbench.losses import LossSpec, resolve_loss
from workbench.metrics import metric_values
from workbench.sdk_conversion import to_datum
from workbench.types import ForwardBackwardOutput, TensorData

# ---------------------------------------------------------------------------------------------- submission


def prepare(
    state: EngineState,
    data: Sequence[Any],
    required: Sequence[str],
    optional: Mapping[str, float | None],
    strict: bool = True,
    soft_targets: bool = False,
) -> list[PreparedDatum]:
    """Validate a batch against the engine's vocabulary and context (caller's thread)."""
    info = state.base_info
    return prepare_batch(
        data,
        required=required,
        optional=optional,
        vocab_size=info.vocab_size,
        max_length=info.max_length,
        strict=strict,
        soft_targets=soft_targets,
    )


def _check_target(state: EngineState, model_id: str, role: Role, training: bool) -> None:
    """The run exists, and a training call names a model that trains (not the reference)."""
    lora_model = state.lora_model(model_id)
    if training:
        lora_model.role_adapter(role)


def _check_loss_role(role: Role, spec: LossSpec, loss_name: str) -> None:
    wants = "values" if role is Role.CRITIC else "logprobs"
    if spec.head != wants:
        if role is Role.CRITIC:
            raise ValueError(f"{loss_name!r} is a policy loss; the critic trains with 'ppo_critic'")
        raise ValueError(f"{loss_name!r} is the critic's loss; the {role} uses a policy loss such as 'ppo'")


@dataclass(frozen=True)
class CheckedCall:
    """A `forward` or `forward_backward` call checked in the caller's thread, ready to run."""

    op: str  # "forward" or "forward_backward"
    batch: list[PreparedDatum]
    spec: LossSpec
    config: Mapping[str, float]
    with_loss: bool


def check_call(
    state: EngineState,
    model_id: str,
    role: Role,
    data: Sequence[Any],
    loss_fn: str,
    loss_fn_config: Mapping[str, float] | None,
    backward: bool,
) -> CheckedCall:
    """Validate a `forward` (backward=False) or `forward_backward` call (caller's thread)."""
    state.check_open()
    _check_target(state, model_id, role, backward)
    spec, config = resolve_loss(loss_fn, loss_fn_config)
    _check_loss_role(role, spec, loss_fn)
    required = spec.required_inputs + (spec.training_inputs if backward else ())
    optional: dict[str, float | None] = dict(spec.optional_inputs)
    if not backward:
        optional.update(dict.fromkeys(spec.training_inputs))
    batch = prepare(state, data, required, optional, soft_targets=spec.soft_targets)
    if spec.check_datum is not None:
        for index, item in enumerate(batch):
            problem = spec.check_datum(item.inputs)
            if problem is not None:
                raise ValueError(f"datum {index}: {problem}")
    if spec.uses_sampling_records:
        batch = attach_sampling_records(state.stability_records, [to_datum(d) for d in data], batch)
    with_loss = backward or all(key in item.inputs for item in batch for key in spec.training_inputs)
    if not with_loss and any(key in item.inputs for item in batch for key in spec.training_inputs):
        raise ValueError(
            f"some datums carry {list(spec.training_inputs)} and some do not: give them to all datums "
            "(to compute the loss) or to none (values only)"
        )
    return CheckedCall("forward_backward" if backward else "forward", batch, spec, config, with_loss)


def note_loss(
    state: EngineState, model_id: str, role: Role, loss_fn: str | CustomLossFn, config: Mapping[str, float]
) -> None:
    """Record the loss a model trains with in its settings (`settings.json`, the Runs tab), on one
    device or several; a custom loss is named by its function."""
    name = (
        loss_fn
        if isinstance(loss_fn, str)
        else f"custom: {getattr(loss_fn, '__qualname__', type(loss_fn).__name__)}"
    )
    state.lora_model(model_id).settings.note(role.value, "loss", {"loss_fn": name, "loss_fn_config": config})


def submit(
    state: EngineState,
    model_id: str,
    role: Role,
    data: Sequence[Any],
    loss_fn: str,
    loss_fn_config: Mapping[str, float] | None,
    backward: bool,
) -> APIFuture[ForwardBackwardOutput]:
    """Validate a `forward` (backward=False) or `forward_backward` call, then queue it."""
    call = check_call(state, model_id, role, data, loss_fn, loss_fn_config, backward)
    if backward:
        note_loss(state, model_id, role, loss_fn, call.config)
    return state.submit(
        lambda: run_loss(
            state,
            state.lora_model(model_id),
            role,
            call.op,
            call.batch,
            call.spec,
            call.config,
            call.with_loss,
        ),
        beside_writes=True,
    )


def check_custom(
    state: EngineState, model_id: str, role: Role, data: Sequence[Any], loss_fn: CustomLossFn
) -> list[PreparedDatum]:
    """Validate a `forward_backward_custom` call (caller's thread)."""
    state.check_open()
    _check_target(state, model_id, role, True)
    if role is Role.CRITIC:
        raise ValueError("forward_backward_custom trains on logprobs; the critic trains with 'ppo_critic'")
    if not callable(loss_fn):
        raise ValueError(
            f"forward_backward_custom needs a function fn(data, logprobs_list) -> (loss, metrics), got {loss_fn!r}"
        )
    return prepare(state, data, ("target_tokens",), {}, strict=False, soft_targets=True)


def submit_custom(
    state: EngineState, model_id: str, role: Role, data: Sequence[Any], loss_fn: CustomLossFn
) -> APIFuture[ForwardBackwardOutput]:
    """Validate a `forward_backward_custom` call, then queue it."""
    batch = check_custom(state, model_id, role, data, loss_fn)
    user_data = list(data)
    note_loss(state, model_id, role, loss_fn, {})
    return state.submit(
        lambda: run_custom(state, state.lora_model(model_id), role, batch, loss_fn, user_data),
        beside_writes=True,
    )


# ---------------------------------------------------------------------------------------------- worker


@dataclass
class CallPart:
    """The datums of a call that run alike (trained, or forward only), their plan, and their outputs as
    the passes bring them."""

    indices: list[int]  # into the call's batch
    batch: list[PreparedDatum]
    trains: bool
    plan: CallPlan
    outputs: list[dict[str, TensorData]] = field(init=False)

    def __post_init__(self) -> None:
        self.outputs = [{} for _ in self.batch]


@dataclass
class ShardResult:
    """A call's outcome on one rank's datums: per-datum outputs in their order, the metric sums, and
    the tokens computed and submitted (`token_counts`). One rank's is the whole call's."""

    outputs: list[dict[str, TensorData]]
    totals: MetricTotals
    token_counts: dict[str, float]


@dataclass
class LossCall:
    """One built-in-loss call on the worker: what its passes compute with, the streams they may use, and
    the metric sums so far. `run_loss` drives it: `partition`, `accumulate`, `record`."""

    op: str  # "forward" or "forward_backward"
    compute: PassComputation
    streams: int
    totals: MetricTotals = field(default_factory=MetricTotals)

    @classmethod
    def start(
        cls,
        state: EngineState,
        lora_model: LoraModel,
        role: Role,
        op: str,
        spec: LossSpec,
        config: Mapping[str, float],
        with_loss: bool,
    ) -> LossCall:
        """A call of `op` on `role` of `lora_model`; the reference's passes stay on the worker's threads
        (adapters off for the pass: `workbench.engine.local.streams`)."""
        trains = op == "forward_backward"  # the reference has no trainable parameters to ask for
        parameters = list(lora_model.role_adapter(role).trainable.parameters.values()) if trains else []
        kept = kept_tokens(state.model.full_activation_limit)
        compute = PassComputation(state, lora_model, role, spec, config, with_loss, parameters, kept)
        return cls(op, compute, 1 if role is Role.REFERENCE else state.streams)

    @property
    def trains(self) -> bool:
        return self.op == "forward_backward"

    def partition(self, batch: list[PreparedDatum]) -> list[CallPart]:
        """The call's parts, each planned: for a training call, the datums that train, then those whose
        loss has no gradient (`without_gradient`), forward only; otherwise all datums, forward only."""
        if not self.trains:
            return [self._planned(batch, list(range(len(batch))), trains=False)]
        gradient_free = [without_gradient(self.compute.spec, item) for item in batch]
        trained = [index for index, free in enumerate(gradient_free) if not free]
        frozen = [index for index, free in enumerate(gradient_free) if free]
        parts = [self._planned(batch, trained, trains=True)] if trained else []
        return parts + ([self._planned(batch, frozen, trains=False)] if frozen else [])

    def _planned(self, batch: list[PreparedDatum], indices: list[int], trains: bool) -> CallPart:
        """A trained part's passes stay within the model's full-activation limit; a forward-only part's
        keep no activations for a backward, so they have no such limit."""
        state = self.compute.state
        part = [batch[index] for index in indices]
        token_limit = state.model.full_activation_limit if trains else None
        return CallPart(indices, part, trains, plan_call(state, part, token_limit, self.streams))

    def accumulate(self, parts: list[CallPart]) -> None:
        """Every part's passes, their outputs, metric sums and gradients added up; a training call's
        gradient goes to the accumulated one only if the whole call succeeds and it is finite."""
        if not self.trains:
            self._run(parts)
            return
        state, lora_model, role = self.compute.state, self.compute.lora_model, self.compute.role
        with lora_model.role_adapter(role).trainable.accumulating(
            f"{self.op} with {self.compute.spec.fn.__name__!r} on {state.adapter_label(lora_model, role)}"
        ):
            if not any(part.trains for part in parts):  # the call's gradient: zero for every parameter
                for param in self.compute.parameters:
                    param.grad = torch.zeros_like(param)
            collectives = state.collectives
            if collectives is None:
                self._run(parts)
                return
            replicated = state.sharded is not None  # every rank ran the whole call (`data_parallel`)
            try:  # on several ranks: the call's gradient is the sum of every rank's (`collectives`)
                self._run(parts)
            except BaseException:
                with contextlib.suppress(RankCallFailedError):  # the others undo the call too
                    collectives.combine_call_gradient(self.compute.parameters, True, replicated)
                raise
            collectives.combine_call_gradient(self.compute.parameters, False, replicated)

    def _run(self, parts: list[CallPart]) -> None:
        """Every part's passes: those with stream chunks together on the streams (the training part's
        first, so the streams start on the longest work), where that makes two chunks or more; the
        rest on the worker's threads."""
        streamed = [
            (part, unit) for part in parts if part.plan.chunks is not None for unit in part.plan.chunks
        ]
        on_streams = len(streamed) >= 2
        if on_streams:
            adapter = self.compute.lora_model.role_adapter(self.compute.role).adapter
            with self.compute.state.model.using(adapter):  # the streams only read the model
                run_on_streams(
                    lambda item: (item[0], self._run_pass(*item)),
                    streamed,
                    self.compute.state.streams,
                    lambda done: self._take(*done),
                )
        for part in parts:
            if part.plan.chunks is None or not on_streams:
                for unit in part.plan.passes:
                    self._take(part, self._run_pass(part, unit))

    def _run_pass(self, part: CallPart, unit: Pass) -> list[ChunkResult]:
        return self.compute.run(part.batch, unit, part.trains)

    def _take(self, part: CallPart, pieces: list[ChunkResult]) -> None:
        """A pass's results, in pass order: its metric sums, its outputs, its gradient added."""
        release_freed_memory()  # the pass's activations
        for chunk in pieces:
            self.totals.add(chunk.elementwise_loss_B_T, chunk.active_B_T, chunk.diagnostics)
            scatter_outputs(part.outputs, chunk.micro, chunk.per_position)
            for param, grad in zip(self.compute.parameters, chunk.gradients or (), strict=False):
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)

    def outcome(self, parts: list[CallPart], size: int) -> ShardResult:
        """The per-datum outputs in input order, the metric sums and the tokens of the call's parts."""
        outputs: list[dict[str, TensorData]] = [{} for _ in range(size)]
        for part in parts:
            for index, output in zip(part.indices, part.outputs, strict=True):
                outputs[index] = output
        return ShardResult(outputs, self.totals, token_counts(*(part.plan for part in parts)))

    def record(self, result: ShardResult) -> ForwardBackwardOutput:
        """The call's row in the history, and its result."""
        state, lora_model, role = self.compute.state, self.compute.lora_model, self.compute.role
        metrics = result.totals.metrics(self.compute.spec, self.compute.with_loss)
        state.record(
            self.op, lora_model, state.adapter_label(lora_model, role), {**metrics, **result.token_counts}
        )
        return ForwardBackwardOutput(
            loss_fn_output_type="TorchLossReturn", loss_fn_outputs=result.outputs, metrics=metrics
        )


def run_loss(
    state: EngineState,
    lora_model: LoraModel,
    role: Role,
    op: str,
    batch: list[PreparedDatum],
    spec: LossSpec,
    config: Mapping[str, float],
    with_loss: bool,
) -> ForwardBackwardOutput:
    """`forward` (op "forward") or `forward_backward` (op "forward_backward") with a built-in loss.

    Without `with_loss` (a critic `forward` given no returns), only the predictions come back. On a CPU
    the policy's and the critic's passes over several datums run on single-threaded streams
    (`workbench.engine.local.streams`); each chunk's gradient is added in chunk order either way.

    A training call's datums whose loss has no gradient (`without_gradient`: a group RL prompt whose
    completions all got the same reward, so every advantage is 0) are computed forward only, in passes of
    their own: their outputs and metrics are the same, their gradient is 0 and its backward pass (about
    two thirds of a datum's cost) is skipped. On streams those passes run in the same run as the
    training passes, after them, so a stream that finishes its training passes early takes them up.
    `bench/peers.py`'s GRPO batch (SmolLM2-135M, 2 cores) with 6 of its 8 groups training took
    6.1–6.7 s when the forward-only passes waited for every training pass (and the 6 groups went into
    passes of 4 and 2: `plan_call`), more than the 5.7–5.9 s of all 8 training; it now takes 5.4–5.6 s
    (4 of 8: 5.5–5.6 s, now 4.6–4.7 s).
    """
    call = LossCall.start(state, lora_model, role, op, spec, config, with_loss)
    parts = call.partition(batch)
    call.accumulate(parts)
    return call.record(call.outcome(parts, len(batch)))


def run_custom(
    state: EngineState,
    lora_model: LoraModel,
    role: Role,
    batch: list[PreparedDatum],
    loss_fn: CustomLossFn,
    user_data: list[Any],
) -> ForwardBackwardOutput:
    """`forward_backward_custom`: the user's loss over per-datum logprob tensors.

    When the batch fits in one micro-batch, the tensors given to `loss_fn` are slices of the live graph
    and `loss.backward()` reaches the adapter directly. Otherwise (the SDK's method): logprobs are
    computed without a graph, `loss_fn` runs on leaf copies, and each micro-batch is run again with the
    surrogate Σ logprobs · ∂loss/∂logprobs, whose parameter gradient is the same.
    """
    plan = plan_call(state, batch, state.model.full_activation_limit, streams=1)
    logprobs_list: list[Tensor] = [torch.empty(0)] * len(batch)
    with lora_model.role_adapter(role).trainable.accumulating(
        f"forward_backward_custom on {state.adapter_label(lora_model, role)}"
    ):
        if len(plan.passes) == 1:
            micro = collate_pass(state, batch, plan.passes[0])
            logprobs_B_T, _ = predict(state, lora_model, role, micro)
            for row, index in enumerate(micro.indices):
                logprobs_list[index] = logprobs_B_T[row, : micro.lengths[row]]
            loss, user_metrics = call_custom_loss(loss_fn, user_data, logprobs_list)
            loss.backward()
        else:
            with torch.no_grad():
                for unit in plan.passes:
                    micro = collate_pass(state, batch, unit)
                    logprobs_B_T, _ = predict(state, lora_model, role, micro)
                    for row, index in enumerate(micro.indices):
                        logprobs_list[index] = (
                            logprobs_B_T[row, : micro.lengths[row]].clone().requires_grad_(True)
                        )
            loss, user_metrics = call_custom_loss(loss_fn, user_data, logprobs_list)
            loss.backward()
            for unit in plan.passes:
                micro = collate_pass(state, batch, unit)
                logprobs_B_T, _ = predict(state, lora_model, role, micro)
                grad_B_T = torch.zeros_like(logprobs_B_T)
                for row, index in enumerate(micro.indices):
                    if logprobs_list[index].grad is not None:
                        grad_B_T[row, : micro.lengths[row]] = logprobs_list[index].grad
                (logprobs_B_T * grad_B_T).sum().backward()
                release_freed_memory()
    outputs = [{"logprobs": TensorData.from_torch(logprobs_N.detach())} for logprobs_N in logprobs_list]
    metrics = {**user_metrics, "loss:sum": float(loss.detach())}
    state.record(
        "forward_backward_custom",
        lora_model,
        state.adapter_label(lora_model, role),
        {**metrics, **token_counts(plan)},
    )
    return ForwardBackwardOutput(
        loss_fn_output_type="TorchLossReturn", loss_fn_outputs=outputs, metrics=metrics
    )


def call_custom_loss(
    loss_fn: CustomLossFn, data: list[Any], logprobs_list: list[Tensor]
) -> tuple[Tensor, dict[str, float]]:
    """Run the user's loss and check what it returns: a differentiable scalar and a dict of floats."""
    result = loss_fn(data, logprobs_list)
    if not (isinstance(result, tuple) and len(result) == 2):
        raise ValueError("a custom loss must return (loss, metrics): a scalar tensor and a dict of floats")
    loss, metrics = result
    if not isinstance(loss, Tensor) or loss.numel() != 1:
        raise ValueError(f"a custom loss must return a scalar tensor as its loss, got {type(loss).__name__}")
    if not loss.requires_grad:
        raise ValueError(
            "the custom loss does not depend on the logprobs it was given: nothing to differentiate"
        )
    try:
        values = metric_values(metrics)
    except ValueError as error:
        raise ValueError(f"the custom loss's metrics: {error}") from None
    return loss.reshape(()), values
