"""A call's plan: which passes its datums run in, and where (on streams or on the worker's threads).

Datums that start with the same tokens (a group RL prompt's completions) are found first
(`shared_prefix.groups_for_streams`, where its cost rule says sharing pays, with the call's streams kept
busy): each such group runs in a shared-prefix pass, its prefix computed once
(`workbench.engine.model.prefix_attention`); the other datums run in length-grouped micro-batches
(`batching.plan_microbatches`). A group is never split across passes or streams. The plan also counts the
real tokens it computes against those submitted, which the history row of the call records
(`computed_tokens:sum`, `submitted_tokens:sum`).

Which positions a loss can give a gradient is part of the plan too: a training call's datums whose loss
has none (`without_gradient`: the input that scales every term of the loss, `LossSpec.gradient_scale`,
is 0 throughout) run forward only, in passes of their own, and a trained pass keeps autograd only at the
positions where it is not 0 (`trained_positions`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor

from workbench.engine.local.state import EngineState
from workbench.engine.local.streams import CHUNK_TOKENS, stream_chunks
from workbench.engine.model import shared_prefix
from workbench.engine.model.batching import MicroBatch, PreparedDatum, collate, plan_microbatches
from workbench.engine.model.shared_prefix import (
    PrefixGroup,
    collate_shared,
    computed_tokens,
    groups_for_streams,
    plan_shared_passes,
    saved_tokens,
    spread_shared_passes,
)
from workbench.losses import LossSpec

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
