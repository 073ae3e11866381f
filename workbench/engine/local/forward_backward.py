"""`forward`, `forward_backward` and `forward_backward_custom`: from the caller's data to the result.

In the caller's thread, every datum is checked against the loss (`resolve_loss`, `batching.prepare_batch`):
bad input raises a `ValueError` naming the datum and field, and nothing is queued. On the worker thread,
in submission order, the batch is cut into length-grouped micro-batches (`batching.plan_microbatches`);
each is padded, run through the model (the policy's or the reference's logprobs, or the critic's
values), through the loss, and backward when the call trains. Per-datum outputs are cut back to each
datum's length in input order; metric sums are kept over the micro-batches and turned into
`name:reduction` metrics at the end. A training call's datums whose loss has no gradient (the input that
scales every term of the loss, `LossSpec.gradient_scale`, is 0 throughout: a group RL prompt whose
completions got equal rewards) run forward only, in passes of their own. A training call adds its
gradient to the accumulated one only when the whole call succeeded and its gradient is finite
(`TrainableAdapter.accumulating`).

Datums that start with the same tokens (a group RL prompt's completions) are found first
(`shared_prefix.groups_for_streams`, where its cost rule says sharing pays, with the call's streams
kept busy): each such group runs in a
shared-prefix pass, its prefix computed once (`workbench.engine.model.prefix_attention`), and the other
datums as above. A group is never split across passes or streams; a training pass of one group over
half the model's full-activation limit runs in parts (`workbench.engine.model.prefix_parts`: the prefix
once, then a few datums' suffixes at a time, each with its loss and backward), so that it keeps less
than a plain pass of its datums would. The history row of the call records
the tokens computed and the tokens submitted (`computed_tokens:sum`, `submitted_tokens:sum`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from workbench.engine.interface import CustomLossFn
from workbench.engine.local.heap import release_freed_memory
from workbench.engine.local.lora_models import LoraModel
from workbench.engine.local.provenance import attach_sampling_records
from workbench.engine.local.state import EngineState
from workbench.engine.local.streams import CHUNK_TOKENS, run_on_streams, stream_chunks
from workbench.engine.model import shared_prefix
from workbench.engine.model.batching import (
    MicroBatch,
    PreparedDatum,
    collate,
    plan_microbatches,
    prepare_batch,
)
from workbench.engine.model.prefix_parts import (
    add_gradients,
    checkpointed_prefix_layers,
    kept_tokens,
    part_members,
    runs_in_parts,
)
from workbench.engine.model.shared_prefix import (
    PrefixGroup,
    SharedPrefixMicroBatch,
    collate_shared,
    computed_tokens,
    groups_for_streams,
    plan_shared_passes,
    saved_tokens,
    spread_shared_passes,
)
from workbench.engine.roles import Role
from workbench.futures import APIFuture
from workbench.losses import LossOutput, LossSpec, resolve_loss
from workbench.metrics import metric_values
from workbench.sdk_conversion import to_datum
from workbench.types import ForwardBackwardOutput, TensorData


@dataclass
class MetricTotals:
    """Sums over the micro-batches of one call, turned into `name:reduction` metrics at the end."""

    loss: float = 0.0
    active_tokens: float = 0.0
    diagnostic_sums: dict[str, float] = field(default_factory=dict)

    def add(
        self, elementwise_loss_B_T: Tensor, active_B_T: Tensor, diagnostics: Mapping[str, Tensor]
    ) -> None:
        self.loss += float(elementwise_loss_B_T.detach().sum())
        active = active_B_T.float()
        self.active_tokens += float(active.sum())
        for name, values_B_T in diagnostics.items():
            total = float((values_B_T.detach().float() * active).sum())
            self.diagnostic_sums[name] = self.diagnostic_sums.get(name, 0.0) + total

    def metrics(self, spec: LossSpec | None, with_loss: bool) -> dict[str, float]:
        metrics: dict[str, float] = {"num_tokens:sum": self.active_tokens}
        if with_loss:
            metrics["loss:sum"] = self.loss
        if self.active_tokens > 0:
            means = {name: total / self.active_tokens for name, total in self.diagnostic_sums.items()}
            if spec is not None and spec.summarize is not None and with_loss:
                means = spec.summarize(means)
            metrics.update(
                {f"{name}:mean": value for name, value in means.items() if not name.startswith("_")}
            )
        return metrics


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
    op = "forward_backward" if backward else "forward"
    return state.submit(
        lambda: run_loss(state, state.lora_model(model_id), role, op, batch, spec, config, with_loss)
    )


def submit_custom(
    state: EngineState, model_id: str, role: Role, data: Sequence[Any], loss_fn: CustomLossFn
) -> APIFuture[ForwardBackwardOutput]:
    """Validate a `forward_backward_custom` call, then queue it."""
    state.check_open()
    _check_target(state, model_id, role, True)
    if role is Role.CRITIC:
        raise ValueError("forward_backward_custom trains on logprobs; the critic trains with 'ppo_critic'")
    if not callable(loss_fn):
        raise ValueError(
            f"forward_backward_custom needs a function fn(data, logprobs_list) -> (loss, metrics), got {loss_fn!r}"
        )
    batch = prepare(state, data, ("target_tokens",), {}, strict=False, soft_targets=True)
    user_data = list(data)
    return state.submit(
        lambda: run_custom(state, state.lora_model(model_id), role, batch, loss_fn, user_data)
    )


# ---------------------------------------------------------------------------------------------- worker

Pass = list[int] | list[PrefixGroup]
"""The datums of one pass: plain datum indices, or whole shared-prefix groups."""


@dataclass
class CallPlan:
    """How a call's datums run: its passes, the chunks for streams (None: on the worker's threads; a
    single chunk runs there too unless another part of the call runs on streams beside it), and the real
    tokens it computes against those submitted."""

    passes: list[Pass]
    chunks: list[Pass] | None
    computed: int
    submitted: int


def plan_call(
    state: EngineState, batch: Sequence[PreparedDatum], token_limit: int | None, streams: int
) -> CallPlan:
    """Shared-prefix groups first, in passes of at most the micro-batch budget and `token_limit` (on
    `streams` streams, spread over as many passes for each stream, of about `CHUNK_TOKENS` or fewer:
    `spread_shared_passes`); the other datums as length-grouped micro-batches, cut into stream chunks."""
    lengths = [item.length for item in batch]
    groups = groups_for_streams(
        [item.tokens_N for item in batch], shared_prefix.PREFIX_PASS_OVERHEAD_TOKENS, streams
    )
    grouped = {index for group in groups for index in group.indices}
    rest = [index for index in range(len(batch)) if index not in grouped]
    plan = (
        [
            [rest[k] for k in micro]
            for micro in plan_microbatches(
                [lengths[i] for i in rest], state.config.max_tokens_per_microbatch, token_limit
            )
        ]
        if rest
        else []
    )
    budget = (
        state.config.max_tokens_per_microbatch
        if token_limit is None
        else min(state.config.max_tokens_per_microbatch, token_limit)
    )
    shared: list[Pass] = []
    if groups and streams >= 2:
        total = sum(computed_tokens([group], lengths) for group in groups)
        per_stream = max(1, math.ceil(total / (streams * CHUNK_TOKENS)))
        shared = list(spread_shared_passes(groups, lengths, streams * per_stream, budget))
    elif groups:
        shared = list(plan_shared_passes(groups, lengths, budget))
    chunks: list[Pass] | None = None
    if streams >= 2:
        plain_chunks = stream_chunks(plan, lengths, streams, token_limit) if plan else []
        units: list[Pass] = [*(plan if plain_chunks is None else plain_chunks), *shared]
        within_limit = token_limit is None or all(
            _pass_tokens(unit, lengths) <= token_limit for unit in units
        )
        if within_limit and (plain_chunks is not None or shared):
            chunks = units
    submitted = sum(lengths)
    return CallPlan([*shared, *plan], chunks, submitted - saved_tokens(groups), submitted)


def _pass_tokens(unit: Pass, lengths: Sequence[int]) -> int:
    if unit and isinstance(unit[0], PrefixGroup):
        return computed_tokens(unit, lengths)  # type: ignore[arg-type]
    return len(unit) * max(lengths[index] for index in unit)  # type: ignore[index]


def collate_pass(state: EngineState, batch: Sequence[PreparedDatum], unit: Pass) -> MicroBatch:
    """One pass's micro-batch on the engine's device: plain, or shared-prefix."""
    pad = state.tokenizer.pad_token_id
    if unit and isinstance(unit[0], PrefixGroup):
        return collate_shared(batch, unit, pad, state.device)  # type: ignore[arg-type]
    return collate(batch, unit, pad, state.device)  # type: ignore[arg-type]


def token_counts(*plans: CallPlan) -> dict[str, float]:
    """The history row's record of the saving: real tokens computed and submitted by a call's plans."""
    return {
        "computed_tokens:sum": float(sum(plan.computed for plan in plans)),
        "submitted_tokens:sum": float(sum(plan.submitted for plan in plans)),
    }


def predict(
    state: EngineState,
    lora_model: LoraModel,
    role: Role,
    micro: MicroBatch,
    with_entropy: bool = False,
    trained_B_T: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The model's prediction for a micro-batch: the critic's values, or the targets' logprobs for the
    policy and the reference (and, when asked, the detached entropy of each next-token distribution),
    with autograd only at the positions `trained_B_T` marks (None: all; `trained_positions`)."""
    if role is Role.CRITIC:
        critic = lora_model.role_adapter(Role.CRITIC)
        assert critic.value_head is not None
        return state.model.values(critic.adapter, critic.value_head, micro), {}
    adapter = None if role is Role.REFERENCE else lora_model.policy.adapter
    logprobs_B_T, entropy_B_T = state.model.target_logprobs(adapter, micro, with_entropy, trained_B_T)
    return logprobs_B_T, {} if entropy_B_T is None else {"entropy": entropy_B_T}


@dataclass
class CallPart:
    """The datums of a call that run alike (trained, or forward only), their plan, and their outputs as
    the chunks bring them."""

    indices: list[int]  # into the call's batch
    batch: list[PreparedDatum]
    trains: bool
    plan: CallPlan
    outputs: list[dict[str, TensorData]] = field(init=False)

    def __post_init__(self) -> None:
        self.outputs = [{} for _ in self.batch]


@dataclass
class ChunkResult:
    """What one micro-batch (or stream chunk) of a built-in-loss pass gives back: its per-position
    outputs, what the metrics add up, and, when it trains, its gradient per trainable parameter."""

    micro: MicroBatch
    per_position: dict[str, Tensor]
    elementwise_loss_B_T: Tensor
    active_B_T: Tensor
    diagnostics: dict[str, Tensor]
    gradients: Sequence[Tensor | None] | None


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
    backward = op == "forward_backward"
    outputs: list[dict[str, TensorData]] = [{} for _ in batch]
    totals = MetricTotals()
    parameters = list(lora_model.role_adapter(role).trainable.parameters.values()) if backward else []
    streams = 1 if role is Role.REFERENCE else state.streams
    kept = kept_tokens(state.model.full_activation_limit)

    def plan_part(indices: list[int], trains: bool) -> CallPart:
        part = [batch[index] for index in indices]
        token_limit = state.model.full_activation_limit if trains else None
        return CallPart(indices, part, trains, plan_call(state, part, token_limit, streams))

    def run_chunk(call_part: CallPart, unit: Pass) -> list[ChunkResult]:
        part, trains = call_part.batch, call_part.trains
        micro = collate_pass(state, part, unit)
        if trains and isinstance(micro, SharedPrefixMicroBatch) and runs_in_parts(micro, kept):
            return run_in_parts(state, lora_model, role, part, micro, spec, config, parameters, kept)
        mask_B_T = micro.attention_mask_B_T.bool()
        with torch.set_grad_enabled(trains):
            trained_B_T = trained_positions(spec, micro) if trains else None
            prediction_B_T, extra = predict(state, lora_model, role, micro, spec.reports_entropy, trained_B_T)
            if not with_loss:
                return [
                    ChunkResult(
                        micro,
                        {spec.head: prediction_B_T},
                        torch.zeros_like(prediction_B_T),
                        mask_B_T,
                        extra,
                        None,
                    )
                ]
            result = spec.fn(prediction_B_T, micro.inputs, mask_B_T, config)
            gradients = (
                torch.autograd.grad(result.elementwise_loss_B_T.sum(), parameters, allow_unused=True)
                if trains
                else None
            )
        return [loss_result(micro, spec, prediction_B_T, extra, result, gradients)]

    def take(call_part: CallPart, pieces: list[ChunkResult]) -> None:
        release_freed_memory()  # the chunk's activations
        for chunk in pieces:
            totals.add(chunk.elementwise_loss_B_T, chunk.active_B_T, chunk.diagnostics)
            scatter_outputs(call_part.outputs, chunk.micro, chunk.per_position)
            for param, grad in zip(parameters, chunk.gradients or (), strict=False):
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)

    def run(parts: list[CallPart]) -> None:
        """Every part's passes: those with stream chunks together on the streams (the training part's
        first, so the streams start on the longest work), where that makes two chunks or more; the
        rest on the worker's threads."""
        streamed = [(p, unit) for p in parts if p.plan.chunks is not None for unit in p.plan.chunks]
        on_streams = len(streamed) >= 2
        if on_streams:
            with state.model.using(lora_model.role_adapter(role).adapter):  # the streams only read the model
                run_on_streams(
                    lambda item: (item[0], run_chunk(*item)),
                    streamed,
                    state.streams,
                    lambda done: take(*done),
                )
        for call_part in parts:
            if call_part.plan.chunks is None or not on_streams:
                for unit in call_part.plan.passes:
                    take(call_part, run_chunk(call_part, unit))

    parts: list[CallPart] = []
    if backward:
        gradient_free = [without_gradient(spec, item) for item in batch]
        trained = [index for index, free in enumerate(gradient_free) if not free]
        frozen = [index for index, free in enumerate(gradient_free) if free]
        parts = [plan_part(trained, trains=True)] if trained else []
        parts += [plan_part(frozen, trains=False)] if frozen else []
        with lora_model.role_adapter(role).trainable.accumulating(
            f"{op} with {spec.fn.__name__!r} on {state.adapter_label(lora_model, role)}"
        ):
            if not trained:  # the gradient the whole call would have given: zero for every parameter
                for param in parameters:
                    param.grad = torch.zeros_like(param)
            run(parts)
    else:
        parts = [plan_part(list(range(len(batch))), trains=False)]
        run(parts)
    for call_part in parts:
        for index, output in zip(call_part.indices, call_part.outputs, strict=True):
            outputs[index] = output
    metrics = totals.metrics(spec, with_loss)
    state.record(
        op,
        lora_model,
        state.adapter_label(lora_model, role),
        {**metrics, **token_counts(*(p.plan for p in parts))},
    )
    return ForwardBackwardOutput(
        loss_fn_output_type="TorchLossReturn", loss_fn_outputs=outputs, metrics=metrics
    )


def loss_result(
    micro: MicroBatch,
    spec: LossSpec,
    prediction_B_T: Tensor,
    extra: Mapping[str, Tensor],
    result: LossOutput,
    gradients: Sequence[Tensor | None] | None,
) -> ChunkResult:
    """A micro-batch's `ChunkResult` from its prediction and the loss's result (all detached)."""
    loss_B_T = result.elementwise_loss_B_T.detach()
    return ChunkResult(
        micro,
        {spec.head: prediction_B_T.detach(), "elementwise_loss": loss_B_T},
        loss_B_T,
        result.active_B_T,
        {name: values.detach() for name, values in {**extra, **result.diagnostics}.items()},
        gradients,
    )


def run_in_parts(
    state: EngineState,
    lora_model: LoraModel,
    role: Role,
    batch: Sequence[PreparedDatum],
    micro: SharedPrefixMicroBatch,
    spec: LossSpec,
    config: Mapping[str, float],
    parameters: list[torch.nn.Parameter],
    kept: int,
) -> list[ChunkResult]:
    """A shared pass of one group, trained in parts (`workbench.engine.model.prefix_parts`): the prefix
    once, each part's suffixes with their loss and backward, then the prefix's backward. One result per
    part; the last carries the whole pass's gradient."""
    model = state.model
    critic = role is Role.CRITIC
    adapter = lora_model.role_adapter(role)
    head = adapter.value_head if critic else None
    group = micro.groups[0]
    suffix_length = micro.suffix_ids_R_S.shape[1]
    parts = part_members(len(group.indices), suffix_length, kept)
    part_tokens = len(parts[0]) * suffix_length
    prefix_tokens = micro.prefix_ids_P_L.numel()
    checkpointed = checkpointed_prefix_layers(prefix_tokens, part_tokens, kept, len(model.decoder_layers))
    with torch.enable_grad():
        with model.checkpointing_first(checkpointed):
            stage = model.prefix_stage(
                adapter.adapter,
                head,
                micro,
                spec.reports_entropy and not critic,
                kept_positions=max(0, kept - part_tokens),
                trained_B_T=None if critic else trained_positions(spec, micro),
                in_parts=True,
            )
        release_freed_memory()  # what the prefix's pass freed
        totals: list[Tensor | None] = [None] * len(parameters)
        pieces = []
        for members in parts:
            indices = [group.indices[member] for member in members]
            sub = collate_shared(
                batch, [PrefixGroup(indices, group.prefix_length)], state.tokenizer.pad_token_id, state.device
            )
            prediction_B_T, entropy_B_T = model.suffix_part(
                adapter.adapter,
                head,
                stage,
                sub,
                members,
                kept_positions=sub.suffix_ids_R_S.numel(),
                trained_B_T=None if critic else trained_positions(spec, sub),
            )
            extra = {} if entropy_B_T is None else {"entropy": entropy_B_T}
            result = spec.fn(prediction_B_T, sub.inputs, sub.attention_mask_B_T.bool(), config)
            gradients = torch.autograd.grad(
                result.elementwise_loss_B_T.sum(), [*parameters, *stage.leaves], allow_unused=True
            )
            add_gradients(totals, gradients[: len(parameters)])
            add_gradients(stage.leaf_gradients, gradients[len(parameters) :])
            pieces.append(loss_result(sub, spec, prediction_B_T, extra, result, None))
            del prediction_B_T, entropy_B_T, extra, result, gradients
            release_freed_memory()  # the part's activations, before the next part allocates its own
        add_gradients(totals, stage.backward(parameters))
    pieces[-1].gradients = totals
    return pieces


def trained_positions(spec: LossSpec, micro: MicroBatch) -> Tensor | None:
    """Where the loss of `spec` can give a micro-batch's logprobs a gradient, (B, T) bool: its
    `gradient_scale` input is not 0 there (over every target column, for soft targets). None for a loss
    without such an input: every position."""
    if spec.gradient_scale is None:
        return None
    scale_B_T_X = micro.inputs[spec.gradient_scale]
    return scale_B_T_X.ne(0).reshape(*scale_B_T_X.shape[:2], -1).any(dim=-1)


def without_gradient(spec: LossSpec, datum: PreparedDatum) -> bool:
    """True when the datum's loss has no gradient: every term of `spec`'s loss is multiplied by its
    `gradient_scale` input (`LossSpec.gradient_scale`), and that input is 0 at every position."""
    if spec.gradient_scale is None:
        return False
    return not bool(datum.inputs[spec.gradient_scale].any())


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


def scatter_outputs(
    outputs: list[dict[str, TensorData]], micro: MicroBatch, per_position: Mapping[str, Tensor]
) -> None:
    """Cut each (B, T) or (B, T, K) tensor back into one (N_d,) or (N_d, K) `TensorData` per datum, in
    input order."""
    arrays = {name: tensor_B_T.detach().float().cpu().numpy() for name, tensor_B_T in per_position.items()}
    for row, index in enumerate(micro.indices):
        n = micro.lengths[row]
        for name, array_B_T in arrays.items():
            outputs[index][name] = TensorData(np.ascontiguousarray(array_B_T[row, :n]), "float32")


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
