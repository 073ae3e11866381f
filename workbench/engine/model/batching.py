"""From a list of datums to padded micro-batches, and back.

Notation: D datums; a micro-batch of B datums padded to length T; N_d positions in datum d; K targets per
position where a loss takes soft targets (`target_tokens` and `weights` of shape (N, K)).

`prepare_batch` validates every datum in the caller's thread, before anything is queued, and raises a
`ValueError` naming the datum index and the field. `plan_microbatches` groups datums by length under a
token budget, so memory stays bounded and little compute goes to padding. `collate` right-pads one
micro-batch (causal attention makes right padding invisible to the real positions).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from workbench.sdk_conversion import to_datum
from workbench.types import Datum

# Fixed cost of one extra forward pass, in padded-token equivalents. The planner splits a batch only
# where the padding saved is worth more than this.
MICROBATCH_OVERHEAD_TOKENS = 128
# Extra cost of a training token whose activations are recomputed in backward, as a fraction of a
# training token's cost (measured on SmolLM2-135M: recomputing every layer and the logits of a
# 2048-token micro-batch takes its step from 1.0 to 1.44).
RECOMPUTE_COST = 0.4

PER_TARGET_INPUTS = ("target_tokens", "weights")
"""The inputs that hold one value per target: (N,) for one target per position, (N, K) for K (soft targets)."""


@dataclass(frozen=True)
class PreparedDatum:
    """One validated datum as tensors on the CPU: `tokens_N` and each loss input as a length-N tensor
    ((N, K) for the `PER_TARGET_INPUTS` of a datum with K targets per position)."""

    tokens_N: torch.Tensor
    inputs: dict[str, torch.Tensor]

    @property
    def length(self) -> int:
        return int(self.tokens_N.shape[0])


@dataclass(frozen=True)
class MicroBatch:
    """B datums right-padded to T. `indices` are the datums' positions in the original batch."""

    indices: list[int]
    input_ids_B_T: torch.Tensor
    attention_mask_B_T: torch.Tensor  # 1 on real positions
    inputs: dict[str, torch.Tensor]  # each (B, T) or, for K targets per position, (B, T, K); zero on padding
    lengths: list[int]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)


def _check_tokens(where: str, array: np.ndarray, vocab_size: int) -> None:
    """Token ids: integers in the vocabulary. `array` is (N,) or (N, K); a bad cell is named by its
    position (and its column k for (N, K))."""

    def cell(flat_index: int) -> str:
        if array.ndim < 2:
            return f"position {flat_index}"
        row, column = np.unravel_index(flat_index, array.shape)
        return f"position {int(row)}, target {int(column)}"

    flat = array.reshape(-1)
    if array.dtype.kind == "f":
        if not np.all(np.isfinite(flat)) or not np.all(flat == np.round(flat)):
            bad = int(np.flatnonzero(~np.isfinite(flat) | (flat != np.round(flat)))[0])
            raise ValueError(f"{where}: token ids must be integers, got {flat[bad].item()!r} at {cell(bad)}")
    elif array.dtype.kind not in "iu":
        raise ValueError(f"{where}: token ids must be integers, got dtype {array.dtype}")
    out_of_range = (flat < 0) | (flat >= vocab_size)
    if out_of_range.any():
        bad = int(np.flatnonzero(out_of_range)[0])
        raise ValueError(
            f"{where}: token id {int(flat[bad])} at {cell(bad)} is outside the vocabulary [0, {vocab_size})"
        )


def _per_target_shape(where: str, datum: Datum, n: int, soft_targets: bool) -> tuple[int, ...]:
    """The shape the `PER_TARGET_INPUTS` must have: (N,), or (N, K) where `target_tokens` is (N, K) and
    the loss takes soft targets."""
    target = datum.loss_fn_inputs.get("target_tokens")
    shape = (n,) if target is None else tuple(target.to_numpy().shape)
    if len(shape) != 2 or shape[0] != n:
        return (n,)
    if not soft_targets:
        raise ValueError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {list(shape)}: K targets per position "
            f"(soft targets) are for 'cross_entropy' and forward_backward_custom; this loss takes one target "
            f"per position ({n},)"
        )
    if shape[1] == 0:
        raise ValueError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {list(shape)}: K must be at least 1"
        )
    return shape


def prepare_datum(
    index: int,
    raw: Any,
    *,
    required: Collection[str],
    optional: Mapping[str, float | None],
    vocab_size: int,
    max_length: int,
    strict: bool = True,
    soft_targets: bool = False,
) -> PreparedDatum:
    """Validate one datum against the loss's inputs and the model's vocabulary and context.

    Optional inputs the datum leaves out are filled with their default value at every position (or left
    out, where the default is None).
    Unknown input keys are an error when `strict`, and left out otherwise (custom losses read their own
    inputs from the datums themselves). With `soft_targets`, `target_tokens` may be (N, K), and then the
    other `PER_TARGET_INPUTS` must be (N, K) too (Tinker's multi-target cross-entropy).
    """
    where = f"datum {index}"
    try:
        datum: Datum = to_datum(raw)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{where}: {error}") from error
    tokens = _model_input_tokens(where, datum, vocab_size, max_length)
    n = len(tokens)
    unknown = _unknown_inputs(where, set(datum.loss_fn_inputs), required, optional, strict)
    used = set(required) | set(optional)
    per_target = _per_target_shape(where, datum, n, soft_targets)
    inputs: dict[str, torch.Tensor] = {}
    for key, value in datum.loss_fn_inputs.items():
        if key in unknown:
            continue
        array = value.to_numpy()
        expected = per_target if key in PER_TARGET_INPUTS else (n,)
        _check_input_shape(where, key, array.shape, expected, soft_targets)
        _check_input_values(where, key, array, vocab_size)
        if key in used:  # `target_tokens` is checked even where the loss does not read it
            inputs[key] = torch.from_numpy(array.astype(np.int64 if key == "target_tokens" else np.float32))
    for key, default in optional.items():
        if key not in inputs and default is not None:
            shape = per_target if key in PER_TARGET_INPUTS else (n,)
            inputs[key] = torch.full(shape, default, dtype=torch.float32)
    return PreparedDatum(tokens_N=torch.from_numpy(tokens.astype(np.int64)), inputs=inputs)


def _model_input_tokens(where: str, datum: Datum, vocab_size: int, max_length: int) -> np.ndarray:
    """The datum's model_input as token ids: not empty, within the model's context, in its vocabulary."""
    token_list = datum.model_input.to_ints()
    n = len(token_list)
    if n == 0:
        raise ValueError(f"{where}: model_input is empty")
    if n > max_length:
        raise ValueError(
            f"{where}: model_input has {n} tokens, more than the model's context of {max_length}"
        )
    tokens = np.asarray(token_list)
    _check_tokens(f"{where}: model_input", tokens, vocab_size)
    return tokens


def _unknown_inputs(
    where: str,
    given: set[str],
    required: Collection[str],
    optional: Mapping[str, float | None],
    strict: bool,
) -> list[str]:
    """The datum's loss inputs the loss does not use (an error when `strict`); a required input missing
    is an error."""
    missing = [key for key in required if key not in given]
    if missing:
        raise ValueError(
            f"{where}: loss_fn_inputs is missing {missing}; this loss needs {sorted(required)}"
            + (f" and accepts {sorted(optional)}" if optional else "")
        )
    # `target_tokens` is part of every Tinker datum; a loss that does not read it still validates it.
    unknown = sorted(given - set(required) - set(optional) - {"target_tokens"})
    if unknown and strict:
        raise ValueError(
            f"{where}: loss_fn_inputs has unknown key(s) {unknown}; this loss uses {sorted(required)}"
            + (f" and optionally {sorted(optional)}" if optional else "")
        )
    return unknown


def _check_input_shape(
    where: str, key: str, shape: tuple[int, ...], expected: tuple[int, ...], soft_targets: bool
) -> None:
    """One loss input has one value per position (N,), or per target (N, K) with soft targets."""
    if shape != expected and len(expected) == 2:
        raise ValueError(
            f"{where}: loss_fn_inputs[{key!r}] has shape {list(shape)}, but target_tokens has shape "
            f"{list(expected)}: with K targets per position, {key!r} needs one value per target {expected}"
        )
    if shape != expected:
        n = expected[0]
        raise ValueError(
            f"{where}: loss_fn_inputs[{key!r}] has shape {list(shape)}, but model_input has {n} "
            f"tokens: each input needs exactly one value per position ({n},)"
            + (" or, for soft targets, (N, K) target_tokens and weights" if soft_targets else "")
        )


def _check_input_values(where: str, key: str, array: np.ndarray, vocab_size: int) -> None:
    """`target_tokens` are ids in the vocabulary; any other input is numeric and finite."""
    if key == "target_tokens":
        _check_tokens(f"{where}: loss_fn_inputs['target_tokens']", array, vocab_size)
        return
    if array.dtype.kind not in "iuf":
        raise ValueError(f"{where}: loss_fn_inputs[{key!r}] must be numeric, got dtype {array.dtype}")
    finite = np.isfinite(array)
    if not finite.all():
        bad = int(np.flatnonzero(~finite)[0])
        raise ValueError(
            f"{where}: loss_fn_inputs[{key!r}] has a non-finite value {array[bad].item()} at position {bad}"
        )


def prepare_batch(
    data: Sequence[Any],
    *,
    required: Collection[str],
    optional: Mapping[str, float | None] | None = None,
    vocab_size: int,
    max_length: int,
    strict: bool = True,
    soft_targets: bool = False,
) -> list[PreparedDatum]:
    """Validate every datum; raises `ValueError` naming the first bad datum and field.

    With `soft_targets`, every datum of the batch has the same number K of targets per position (one
    (N, K) output per datum, as the wire's batched outputs need)."""
    if isinstance(data, (Datum, dict)) or not isinstance(data, Sequence):
        raise ValueError(f"data must be a list of datums, got {type(data).__name__}")
    if len(data) == 0:
        raise ValueError("data is empty: pass at least one datum")
    batch = [
        prepare_datum(
            i,
            raw,
            required=required,
            optional=optional or {},
            vocab_size=vocab_size,
            max_length=max_length,
            strict=strict,
            soft_targets=soft_targets,
        )
        for i, raw in enumerate(data)
    ]
    widths = [
        tuple(item.inputs["target_tokens"].shape[1:]) for item in batch if "target_tokens" in item.inputs
    ]
    for index, width in enumerate(widths):
        if width != widths[0]:
            first = f"K={widths[0][0]} targets per position" if widths[0] else "one target per position"
            this = f"K={width[0]}" if width else "one"
            raise ValueError(
                f"datum {index}: loss_fn_inputs['target_tokens'] has {this} target(s) per position but datum 0 "
                f"has {first}: every datum of one call needs the same K"
            )
    return batch


def plan_microbatches(
    lengths: Sequence[int], token_budget: int, full_activation_tokens: int | None = None
) -> list[list[int]]:
    """Split datums into micro-batches of similar length.

    Datums are sorted by length and cut into contiguous groups minimising the sum over groups of
    padded + MICROBATCH_OVERHEAD_TOKENS + RECOMPUTE_COST x recomputed, padded = group size x longest in
    group, recomputed = padded − F²/padded where padded > F = `full_activation_tokens` (else 0), with each group's padded size within `token_budget` (a datum
    longer than the budget goes alone). The last term is for training passes (`full_activation_tokens`
    given; None for passes without gradients): beyond that many tokens a micro-batch recomputes
    activations in backward (`workbench.engine.model.activation_checkpointing`), so short datums are grouped past it
    only where that saves more than it costs. Exact dynamic programme over the sorted order. Longest
    groups come first, so a batch that does not fit in memory fails on its first micro-batch.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    sorted_lengths = np.asarray([lengths[i] for i in order], dtype=np.int64)
    n = len(order)
    best_cost = np.zeros(n + 1, dtype=np.float64)
    best_start = np.zeros(n + 1, dtype=np.int64)
    for end in range(1, n + 1):
        longest = int(sorted_lengths[end - 1])
        max_group = max(1, token_budget // longest)
        starts = np.arange(max(0, end - max_group), end)
        padded = (end - starts) * longest
        costs = best_cost[starts] + padded + MICROBATCH_OVERHEAD_TOKENS
        if full_activation_tokens is not None:
            full = full_activation_tokens
            recomputed = np.where(padded > full, padded - full * full / np.maximum(padded, 1), 0.0)
            costs = costs + RECOMPUTE_COST * recomputed
        pick = int(np.argmin(costs))
        best_cost[end] = costs[pick]
        best_start[end] = starts[pick]
    groups: list[list[int]] = []
    end = n
    while end > 0:
        start = int(best_start[end])
        groups.append([order[k] for k in range(start, end)])
        end = start
    return groups  # built from the longest end backwards: longest group first


def collate(
    batch: Sequence[PreparedDatum], indices: list[int], pad_token_id: int, device: torch.device
) -> MicroBatch:
    """Right-pad the datums at `indices` into (B, T) tensors on `device`."""
    items = [batch[i] for i in indices]
    lengths = [item.length for item in items]
    longest = max(lengths)
    count = len(items)
    input_ids = torch.full((count, longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((count, longest), dtype=torch.long)
    keys = items[0].inputs.keys()
    inputs = {
        key: torch.zeros((count, longest, *items[0].inputs[key].shape[1:]), dtype=items[0].inputs[key].dtype)
        for key in keys
    }
    for row, item in enumerate(items):
        n = item.length
        input_ids[row, :n] = item.tokens_N
        attention_mask[row, :n] = 1
        for key in keys:
            inputs[key][row, :n] = item.inputs[key]
    return MicroBatch(
        indices=list(indices),
        input_ids_B_T=input_ids.to(device),
        attention_mask_B_T=attention_mask.to(device),
        inputs={key: value.to(device) for key, value in inputs.items()},
        lengths=lengths,
    )
