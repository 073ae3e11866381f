"""A training call on several ranks: its datums split by tokens, each rank's part run, the results gathered.

Tinker's losses are sums over tokens, so a call whose datums are split over N ranks is the same call:
each rank runs its part exactly as one device runs a call (`forward_backward.LossCall`), the gradients
are summed across ranks inside the call (`collectives.sum_call_gradient`), and rank 0 gathers the
per-datum outputs back into datum order and adds the metric sums (`MetricTotals.sum_of`), so
`loss:sum`, `num_tokens:sum` and every `:mean` are the whole call's. Results equal one device's to float
rounding (the sums are added in another order).

The split (`split_by_tokens`) balances the real tokens per rank: whole shared-prefix groups (a group RL
prompt's completions, `shared_prefix.find_groups`) and single datums, largest first, each to the rank
with the fewest tokens so far; each rank keeps its datums in call order.

On a sharded base (`shard_base=True`) every pass is collective (FSDP all-gathers each layer's weights
as it runs), so every rank must run the same passes in the same order: every rank then runs the whole
call (`shards_for`), computes the same gradient from the same gathered weights, and the ranks only agree
that the call succeeded (`Collectives.agree_on_call`); rank 0's result is the call's. Such a call takes
a one-device call's time; the base's memory is what it saves. Each rank frees the gathered weights
after its part (`ShardedBase.reshard`).

A custom loss (`forward_backward_custom`) is a function of every datum's logprobs, so it runs on rank
0 only, as the SDK runs one: every rank computes its datums' logprobs without a graph, rank 0 calls the
loss on leaf copies of all of them, and each rank then backpropagates the surrogate
Σ logprobs · ∂loss/∂logprobs over its own datums, whose gradient is the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from workbench.engine.interface import CustomLossFn
from workbench.engine.local.call_plan import CallPlan, collate_pass, plan_call, token_counts
from workbench.engine.local.collectives import RankCallFailedError
from workbench.engine.local.forward_backward import LossCall, ShardResult, call_custom_loss
from workbench.engine.local.heap import release_freed_memory
from workbench.engine.local.pass_computation import MetricTotals, predict
from workbench.engine.local.ranks import FollowerRanks
from workbench.engine.local.state import EngineState
from workbench.engine.model import shared_prefix
from workbench.engine.model.batching import PreparedDatum
from workbench.engine.model.sharded_base import resharding
from workbench.engine.roles import Role
from workbench.losses import resolve_loss
from workbench.types import ForwardBackwardOutput, TensorData

T = TypeVar("T")


def split_by_tokens(batch: Sequence[PreparedDatum], ranks: int) -> list[list[int]]:
    """Each rank's datum indices (in call order), their tokens balanced; a shared-prefix group whole."""
    tokens = [item.tokens_N for item in batch]
    groups = shared_prefix.find_groups(tokens, shared_prefix.PREFIX_PASS_OVERHEAD_TOKENS)
    grouped = {index for group in groups for index in group.indices}
    units = [list(group.indices) for group in groups] + [[i] for i in range(len(batch)) if i not in grouped]
    units.sort(key=lambda unit: (-sum(batch[i].length for i in unit), unit[0]))
    load = [0] * ranks
    shards: list[list[int]] = [[] for _ in range(ranks)]
    for unit in units:
        rank = min(range(ranks), key=lambda r: (load[r], r))
        shards[rank].extend(unit)
        load[rank] += sum(batch[i].length for i in unit)
    return [sorted(shard) for shard in shards]


def shards_for(state: EngineState, batch: Sequence[PreparedDatum], ranks: int) -> list[list[int]]:
    """Each rank's datum indices: split by tokens, or every datum on every rank on a sharded base."""
    if state.sharded is not None:
        return [list(range(len(batch)))] * ranks
    return split_by_tokens(batch, ranks)


def _combined(
    state: EngineState, shards: list[list[int]], results: list[ShardResult], size: int
) -> ShardResult:
    """The call's result from every rank's: merged in datum order, or rank 0's on a sharded base."""
    return results[0] if state.sharded is not None else _merge(shards, results, size)


@dataclass(frozen=True)
class LossShard:
    """One rank's part of a built-in-loss call (the loss named, so the follower resolves it itself)."""

    model_id: str
    role: Role
    op: str
    batch: list[PreparedDatum]
    loss_fn: str
    loss_fn_config: Mapping[str, float] | None
    with_loss: bool


@dataclass(frozen=True)
class CustomLogprobsShard:
    """A custom-loss call's first half on one rank: its datums' logprobs, without a graph."""

    model_id: str
    role: Role
    batch: list[PreparedDatum]


@dataclass(frozen=True)
class CustomBackwardShard:
    """A custom-loss call's second half on one rank: the surrogate's backward over its datums."""

    model_id: str
    role: Role
    batch: list[PreparedDatum]
    logprob_gradients: list[Tensor | None]


Shard = LossShard | CustomLogprobsShard | CustomBackwardShard

REPLY_TYPES: dict[str, type] = {cls.__name__: cls for cls in (ShardResult, MetricTotals)}
"""What a follower's replies are built of, besides plain data and tensors (`rank_messages`)."""
SHARD_TYPES: dict[str, type] = {
    cls.__name__: cls for cls in (LossShard, CustomLogprobsShard, CustomBackwardShard, PreparedDatum, Role)
}
"""What a shard sent to a follower is built of."""


def _merge(shards: list[list[int]], results: list[ShardResult], size: int) -> ShardResult:
    outputs: list[dict[str, TensorData]] = [{} for _ in range(size)]
    for indices, result in zip(shards, results, strict=True):
        for index, output in zip(indices, result.outputs, strict=True):
            outputs[index] = output
    counts: dict[str, float] = {}
    for result in results:
        for name, value in result.token_counts.items():
            counts[name] = counts.get(name, 0.0) + value
    return ShardResult(outputs, MetricTotals.sum_of([result.totals for result in results]), counts)


def _everywhere(followers: FollowerRanks, messages: Sequence[Any], own: Callable[[], T]) -> list[Any]:
    """Send each follower its part (`messages[rank]`), do rank 0's (`own`), and gather every rank's
    result in rank order. Every reply is taken before anything is raised, so the pipes stay in step."""
    for rank in followers.ranks:
        followers.request(rank, ("shard", messages[rank]))
    try:
        results: list[Any] = [own()]
    except BaseException:
        for rank in followers.ranks:
            with contextlib.suppress(RuntimeError):  # rank 0's error is the one reported
                followers.reply(rank)
        raise
    error: RuntimeError | None = None
    for rank in followers.ranks:
        try:
            results.append(followers.reply(rank))
        except RuntimeError as failure:
            error = error or failure
    if error is not None:
        raise error
    return results


def _loss_call(state: EngineState, shard: LossShard) -> LossCall:
    spec, config = resolve_loss(shard.loss_fn, shard.loss_fn_config)
    lora_model = state.lora_model(shard.model_id)
    return LossCall.start(state, lora_model, shard.role, shard.op, spec, config, shard.with_loss)


def _run_loss_call(state: EngineState, call: LossCall, shard: LossShard) -> ShardResult:
    with resharding(state.sharded):
        parts = call.partition(shard.batch)
        call.accumulate(parts)
        return call.outcome(parts, len(shard.batch))


def run_loss(
    state: EngineState,
    followers: FollowerRanks,
    model_id: str,
    role: Role,
    op: str,
    batch: list[PreparedDatum],
    loss_fn: str,
    loss_fn_config: Mapping[str, float] | None,
    with_loss: bool,
) -> ForwardBackwardOutput:
    """Rank 0's `forward` / `forward_backward` over every rank (worker thread)."""
    with followers.during(op):
        shards = shards_for(state, batch, len(followers.ranks) + 1)
        pieces = [
            LossShard(model_id, role, op, [batch[i] for i in shard], loss_fn, loss_fn_config, with_loss)
            for shard in shards
        ]
        call = _loss_call(state, pieces[0])
        results = _everywhere(followers, pieces, lambda: _run_loss_call(state, call, pieces[0]))
        return call.record(_combined(state, shards, results, len(batch)))


def _custom_plan(state: EngineState, batch: list[PreparedDatum]) -> CallPlan:
    return plan_call(state, batch, state.model.full_activation_limit, streams=1)


def _custom_logprobs(state: EngineState, shard: CustomLogprobsShard) -> list[Tensor]:
    """The shard's per-datum logprobs, without a graph."""
    lora_model = state.lora_model(shard.model_id)
    logprobs_list: list[Tensor] = [torch.empty(0)] * len(shard.batch)
    with torch.no_grad():
        for unit in _custom_plan(state, shard.batch).passes:
            micro = collate_pass(state, shard.batch, unit)
            logprobs_B_T, _ = predict(state, lora_model, shard.role, micro)
            for row, index in enumerate(micro.indices):
                logprobs_list[index] = logprobs_B_T[row, : micro.lengths[row]].detach().cpu()
    return logprobs_list


def _custom_backward(state: EngineState, shard: CustomBackwardShard) -> dict[str, float]:
    """The surrogate Σ logprobs · ∂loss/∂logprobs backpropagated over the shard's datums, the gradient
    summed over the ranks and accumulated; the shard's token counts."""
    lora_model = state.lora_model(shard.model_id)
    trainable = lora_model.role_adapter(shard.role).trainable
    plan = _custom_plan(state, shard.batch)
    assert state.collectives is not None
    with trainable.accumulating(f"forward_backward_custom on {state.adapter_label(lora_model, shard.role)}"):
        parameters = list(trainable.parameters.values())
        try:
            for unit in plan.passes:
                micro = collate_pass(state, shard.batch, unit)
                logprobs_B_T, _ = predict(state, lora_model, shard.role, micro)
                grad_B_T = torch.zeros_like(logprobs_B_T)
                for row, index in enumerate(micro.indices):
                    gradient = shard.logprob_gradients[index]
                    if gradient is not None:
                        grad_B_T[row, : micro.lengths[row]] = gradient.to(grad_B_T.device)
                (logprobs_B_T * grad_B_T).sum().backward()
                release_freed_memory()
        except BaseException:
            with contextlib.suppress(RankCallFailedError):  # the others undo the call too
                state.collectives.combine_call_gradient(parameters, True, state.sharded is not None)
            raise
        state.collectives.combine_call_gradient(parameters, False, state.sharded is not None)
    return token_counts(plan)


def run_custom(
    state: EngineState,
    followers: FollowerRanks,
    model_id: str,
    role: Role,
    batch: list[PreparedDatum],
    loss_fn: CustomLossFn,
    user_data: list[Any],
) -> ForwardBackwardOutput:
    """Rank 0's `forward_backward_custom` over every rank (worker thread)."""
    op = "forward_backward_custom"
    with followers.during(op):
        shards = shards_for(state, batch, len(followers.ranks) + 1)
        parts = [[batch[i] for i in shard] for shard in shards]
        requests = [CustomLogprobsShard(model_id, role, part) for part in parts]
        gathered = _everywhere(followers, requests, lambda: run_shard(state, requests[0]))
        counted = 1 if state.sharded is not None else len(shards)  # sharded: rank 0's are the call's
        logprobs_list: list[Tensor] = [torch.empty(0)] * len(batch)
        for indices, logprobs in zip(shards[:counted], gathered[:counted], strict=True):
            for index, logprobs_N in zip(indices, logprobs, strict=True):
                logprobs_list[index] = logprobs_N.to(state.device).requires_grad_(True)
        loss, user_metrics = call_custom_loss(loss_fn, user_data, logprobs_list)
        loss.backward()
        gradients = [None if lp.grad is None else lp.grad.detach().cpu() for lp in logprobs_list]
        pieces = [
            CustomBackwardShard(model_id, role, part, [gradients[i] for i in shard])
            for shard, part in zip(shards, parts, strict=True)
        ]
        counts = _everywhere(followers, pieces, lambda: run_shard(state, pieces[0]))[:counted]
    outputs = [{"logprobs": TensorData.from_torch(logprobs_N.detach())} for logprobs_N in logprobs_list]
    metrics = {**user_metrics, "loss:sum": float(loss.detach())}
    totals = {name: sum(count[name] for count in counts) for name in counts[0]}
    lora_model = state.lora_model(model_id)
    state.record(op, lora_model, state.adapter_label(lora_model, role), {**metrics, **totals})
    return ForwardBackwardOutput(
        loss_fn_output_type="TorchLossReturn", loss_fn_outputs=outputs, metrics=metrics
    )


def run_shard(state: EngineState, shard: Shard) -> Any:
    """A follower's part of a call (worker thread): what rank 0 gathers from it."""
    if isinstance(shard, LossShard):
        return _run_loss_call(state, _loss_call(state, shard), shard)
    with resharding(state.sharded):
        if isinstance(shard, CustomLogprobsShard):
            return _custom_logprobs(state, shard)
        return _custom_backward(state, shard)
