"""Datums of one call that start with the same tokens: finding them, deciding when sharing pays, and
laying a group out for a pass that computes the shared prefix once.

In group RL each of a prompt's G completions is its own datum, so a plain pass runs the prompt through
every layer G times, forward and backward. Prefix Grouper (Liu et al. 2025, arXiv 2506.05433) shows
the fix is exact: run the shared prefix once, let every completion attend to its keys and values, and
the outputs and gradients are those of the G separate passes (causal attention: a prefix position never
sees what follows it, so its hidden states are the same in every datum; the gradient reaching them is
the sum over the datums). `workbench.engine.model.prefix_attention` runs such a pass.

Notation: D datums; a group of G datums sharing a prefix of L tokens, datum d of N_d tokens with a
suffix of N_d − L; a shared pass of P groups and R = Σ G datums, prefixes right-padded to L_max and
suffixes to S; T the longest datum of the pass; X the trailing target axis (none, or K soft targets).

The rule. Sharing a group's L prefix tokens computes L + Σ (N_d − L) tokens instead of Σ N_d, saving
(G − 1) · L, and costs its own prefix pass: about `PREFIX_PASS_OVERHEAD_TOKENS` tokens' worth (see
below). The datums are sorted by their tokens, so datums with a common prefix are neighbours, and cut
into runs by an exact dynamic programme that maximises Σ ((G − 1) · L − overhead) over the runs that
share (a run of one, or one that does not pay, runs as today). A prefix stops one token short of the
shortest datum of its group, so every datum keeps a suffix of at least one token.

On S ≥ 2 streams the largest saving can be the slowest plan. A group is one pass, so a call's time is
at least its largest group's computed tokens C_max, and at least its computed tokens C over S:
time ∝ max(C_max, C / S). Group RL's prompts share a header (a system prompt, worked examples) and,
within a problem's G completions, the question after it; the one run over every problem that shares
the header saves the most tokens, and puts nearly the whole call in one pass on one stream
(`bench/peers.py`'s GRPO batch: 24 of its 32 datums in one 819-token pass, the other stream idle
after 165 tokens, as slow as not sharing). So the rule is also run with each group's computed tokens
capped at the first plan's C / S, and the plan of the two with the smaller max(C_max, C / S) is taken
(there: 7 groups of at most 165 tokens, a problem's completions each, 1.2x fewer computed tokens, in
two balanced passes).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from workbench.engine.model.batching import MicroBatch, PreparedDatum, collate

# The cost of a group's own prefix pass, in tokens' worth of a training pass. A shared pass makes one
# model call more than a plain micro-batch (the planner's measured cost of a call,
# `batching.MICROBATCH_OVERHEAD_TOKENS` = 128), and the groups of a pass (up to about 8 of a GRPO batch's
# on 2 streams) share that call: 128 / 8. Bounded by a measurement: `bench/peers.py`'s GRPO batch (8
# problems x 4 completions, a 27-token header and an 18-token question) ran a group per problem, 728
# computed tokens, in 4.25 s, and a plan of 5 groups, one over the header, 882 tokens, in 5.5 s
# (SmolLM2-135M, 2 streams); a cost of 45 or more per group would have chosen the slower one. Tests
# inject it; `bench/prefix.py` runs with it.
PREFIX_PASS_OVERHEAD_TOKENS = 16


@dataclass(frozen=True)
class PrefixGroup:
    """Datums (positions in the call's batch) that all start with the same `prefix_length` tokens, each
    with at least one token after them."""

    indices: list[int]
    prefix_length: int


def common_prefix_length(first: np.ndarray, second: np.ndarray) -> int:
    """How many leading tokens two token arrays share."""
    n = min(len(first), len(second))
    differs = np.flatnonzero(first[:n] != second[:n])
    return int(differs[0]) if len(differs) else n


def find_groups(
    tokens: Sequence[Tensor], overhead_tokens: float, largest_group_tokens: float = math.inf
) -> list[PrefixGroup]:
    """The groups worth sharing among datums with these `tokens` (each (N_d,)), by the rule above with
    `overhead_tokens` for a prefix pass, none computing more than `largest_group_tokens` tokens; each
    group's datums in input order, groups in sorted order."""
    arrays = [t.numpy() if isinstance(t, Tensor) else np.asarray(t) for t in tokens]
    count = len(arrays)
    if count < 2:
        return []
    order = sorted(range(count), key=lambda i: arrays[i].tolist())
    neighbour_prefix = [
        common_prefix_length(arrays[order[k]], arrays[order[k + 1]]) for k in range(count - 1)
    ]
    if max(neighbour_prefix) == 0:
        return []
    # best[j]: the largest saving over sorted datums [0, j); start[j]: where the last run of it begins
    best = [0.0] * (count + 1)
    start = list(range(count + 1))
    prefix_of = [0] * (count + 1)
    for end in range(1, count + 1):
        best[end], start[end] = best[end - 1], end - 1
        shared = len(arrays[order[end - 1]]) - 1
        run_tokens = len(arrays[order[end - 1]])
        for first in range(end - 2, -1, -1):
            shared = min(shared, neighbour_prefix[first], len(arrays[order[first]]) - 1)
            run_tokens += len(arrays[order[first]])
            if shared == 0 or run_tokens - (end - first - 1) * shared > largest_group_tokens:
                break  # a longer run shares no more and computes more
            saving = best[first] + (end - first - 1) * shared - overhead_tokens
            if saving > best[end]:
                best[end], start[end], prefix_of[end] = saving, first, shared
    groups: list[PrefixGroup] = []
    end = count
    while end > 0:
        first = start[end]
        if end - first >= 2:
            groups.append(PrefixGroup(sorted(order[first:end]), prefix_of[end]))
        end = first
    return groups[::-1]


def group_tokens(group: PrefixGroup, lengths: Sequence[int]) -> int:
    """The real tokens a group computes: its prefix once and each datum's suffix, Σ N_d − (G − 1) · L."""
    return sum(lengths[i] for i in group.indices) - (len(group.indices) - 1) * group.prefix_length


def saved_tokens(groups: Sequence[PrefixGroup]) -> int:
    """The tokens sharing saves: Σ (G − 1) · L over the groups."""
    return sum((len(group.indices) - 1) * group.prefix_length for group in groups)


def groups_for_streams(tokens: Sequence[Tensor], overhead_tokens: float, streams: int) -> list[PrefixGroup]:
    """`find_groups`, and on `streams` ≥ 2 the same with each group capped at the first plan's computed
    tokens per stream, whichever plan has the smaller max(C_max, C / S) (the module's docstring)."""
    groups = find_groups(tokens, overhead_tokens)
    if streams < 2 or not groups:
        return groups
    lengths = [len(t) for t in tokens]

    def per_stream(chosen: list[PrefixGroup]) -> float:
        """C / S, with each group's prefix pass counted at `overhead_tokens`."""
        return (sum(lengths) - saved_tokens(chosen) + overhead_tokens * len(chosen)) / streams

    def call_time(chosen: list[PrefixGroup]) -> float:
        return max([per_stream(chosen), *(group_tokens(group, lengths) for group in chosen)])

    balanced = find_groups(tokens, overhead_tokens, largest_group_tokens=per_stream(groups))
    return balanced if call_time(balanced) < call_time(groups) else groups


def computed_tokens(groups: Sequence[PrefixGroup], lengths: Sequence[int]) -> int:
    """The padded tokens a pass over `groups` computes: P · L_max for the prefixes and R · S for the
    suffixes."""
    longest_prefix = max(group.prefix_length for group in groups)
    longest_suffix = max(lengths[i] - group.prefix_length for group in groups for i in group.indices)
    rows = sum(len(group.indices) for group in groups)
    return len(groups) * longest_prefix + rows * longest_suffix


def plan_shared_passes(
    groups: Sequence[PrefixGroup], lengths: Sequence[int], token_budget: int
) -> list[list[PrefixGroup]]:
    """Groups packed into passes of at most `token_budget` computed tokens (a group over it goes
    alone): by prefix length, longest first, so little goes to padding; never a group split, which
    would compute its prefix again."""
    ordered = sorted(groups, key=lambda g: (-g.prefix_length, g.indices))
    passes: list[list[PrefixGroup]] = []
    for group in ordered:
        if passes and computed_tokens([*passes[-1], group], lengths) <= token_budget:
            passes[-1].append(group)
        else:
            passes.append([group])
    return passes


def spread_shared_passes(
    groups: Sequence[PrefixGroup], lengths: Sequence[int], count: int, token_budget: int
) -> list[list[PrefixGroup]]:
    """Groups spread over `count` passes of about equal computed tokens, for `count` / S passes per
    stream on S streams: largest group first, each into the pass that computes the fewest tokens so far
    and still holds it within `token_budget` (a new pass where none does; a group over the budget goes
    alone). Longest-processing-time-first scheduling (Graham 1969), whose longest pass is at most 4/3
    of the best possible. Packing to the budget instead (`plan_shared_passes`) leaves a stream idle:
    6 of `bench/peers.py`'s GRPO groups went into passes of 4 and 2 groups, and the call took longer
    than all 8 groups in passes of 4 and 4. Passes come largest first, so the streams, which take the
    next pass as they finish one, start on the largest."""
    passes: list[list[PrefixGroup]] = [[] for _ in range(count)]
    for group in sorted(groups, key=lambda g: (-group_tokens(g, lengths), g.indices)):
        fitting = [
            pass_groups
            for pass_groups in passes
            if not pass_groups or computed_tokens([*pass_groups, group], lengths) <= token_budget
        ]
        if fitting:
            min(fitting, key=lambda p: computed_tokens(p, lengths) if p else 0).append(group)
        else:
            passes.append([group])
    filled = [pass_groups for pass_groups in passes if pass_groups]
    return sorted(filled, key=lambda p: -computed_tokens(p, lengths))


@dataclass(frozen=True)
class SharedPrefixMicroBatch(MicroBatch):
    """A micro-batch of R datums in P prefix groups: the plain (R, T) layout every loss reads, and the
    layout the model runs, the P prefixes once and the R suffixes after them.

    The model's per-position outputs come back as a prefix part (P, L_max, …) and a suffix part (R, S,
    …); `per_datum` puts them into the (R, T, …) layout by one gather, whose backward adds the gradient
    of every datum at a shared position into that position."""

    groups: list[PrefixGroup]
    prefix_ids_P_L: Tensor
    prefix_mask_P_L: Tensor
    suffix_ids_R_S: Tensor
    suffix_mask_R_S: Tensor
    position_ids_R_S: Tensor  # each suffix position's place in its datum
    row_group_R: Tensor  # the group of each datum
    row_member_R: Tensor  # each datum's place within its group
    members: int  # the largest group's G
    suffix_source_R_S: Tensor  # where each suffix position is in the (R, T) layout (clamped on padding)
    shared_source_R_T: Tensor  # into cat(prefix (P·L_max), suffix (R·S)): a value shared by the group
    member_source_R_T: Tensor  # into cat(prefix (P·L_max·G), suffix (R·S)): one value per datum

    @property
    def computed_tokens(self) -> int:
        return self.prefix_ids_P_L.numel() + self.suffix_ids_R_S.numel()

    def suffix_values(self, values_R_T_X: Tensor) -> Tensor:
        """The suffix positions' entries of a (R, T, …) input, as (R, S, …)."""
        index = self.suffix_source_R_S.reshape(*self.suffix_source_R_S.shape, *[1] * (values_R_T_X.dim() - 2))
        return values_R_T_X.gather(1, index.expand(-1, -1, *values_R_T_X.shape[2:]))

    def prefix_values(self, values_R_T_X: Tensor) -> Tensor:
        """The prefix positions' entries of a (R, T, …) input, one column per datum, as (P, L_max, G, …)
        (zero where a group has fewer datums or a shorter prefix)."""
        out = values_R_T_X.new_zeros(
            (len(self.groups), self.prefix_ids_P_L.shape[1], self.members, *values_R_T_X.shape[2:])
        )
        for row, (group, member) in enumerate(
            zip(self.row_group_R.tolist(), self.row_member_R.tolist(), strict=True)
        ):
            length = self.groups[group].prefix_length
            out[group, :length, member] = values_R_T_X[row, :length]
        return out

    def per_datum(self, prefix_P_L_X: Tensor, suffix_R_S_X: Tensor, per_member: bool) -> Tensor:
        """The (R, T, …) layout from the prefix part, (P, L_max, G, …) when `per_member` (a value per
        datum, such as a target's logprob) else (P, L_max, …) (one value shared by the group, such as a
        hidden state's value), and the suffix part (R, S, …); zero on padding."""
        trailing = suffix_R_S_X.shape[2:]
        flat = torch.cat([prefix_P_L_X.reshape(-1, *trailing), suffix_R_S_X.reshape(-1, *trailing)])
        source_R_T = self.member_source_R_T if per_member else self.shared_source_R_T
        values_R_T_X = flat[source_R_T.clamp_min(0)]
        real = (source_R_T >= 0).reshape(*source_R_T.shape, *[1] * len(trailing))
        return torch.where(real, values_R_T_X, torch.zeros((), dtype=flat.dtype, device=flat.device))


def collate_shared(
    batch: Sequence[PreparedDatum], groups: Sequence[PrefixGroup], pad_token_id: int, device: torch.device
) -> SharedPrefixMicroBatch:
    """The pass over `groups`: their datums in group order, right-padded both ways."""
    indices = [index for group in groups for index in group.indices]
    plain = collate(batch, indices, pad_token_id, device)
    longest_prefix = max(group.prefix_length for group in groups)
    members = max(len(group.indices) for group in groups)
    rows = len(indices)
    prefix_ids = torch.full((len(groups), longest_prefix), pad_token_id, dtype=torch.long)
    prefix_mask = torch.zeros((len(groups), longest_prefix), dtype=torch.long)
    row_group, row_member, prefix_lengths = [], [], []
    for number, group in enumerate(groups):
        length = group.prefix_length
        prefix_ids[number, :length] = batch[group.indices[0]].tokens_N[:length]
        prefix_mask[number, :length] = 1
        for member in range(len(group.indices)):
            row_group.append(number)
            row_member.append(member)
            prefix_lengths.append(length)
    suffix_lengths = [plain.lengths[row] - prefix_lengths[row] for row in range(rows)]
    longest_suffix = max(suffix_lengths)
    longest = max(plain.lengths)
    suffix_ids = torch.full((rows, longest_suffix), pad_token_id, dtype=torch.long)
    suffix_mask = torch.zeros((rows, longest_suffix), dtype=torch.long)
    steps = torch.arange(longest_suffix)
    position_ids = torch.stack([length + steps for length in prefix_lengths])
    suffix_source = position_ids.clamp_max(longest - 1)
    shared_source = torch.full((rows, longest), -1, dtype=torch.long)
    member_source = torch.full((rows, longest), -1, dtype=torch.long)
    suffix_start_shared = len(groups) * longest_prefix
    suffix_start_member = suffix_start_shared * members
    for row, index in enumerate(indices):
        length, suffix = prefix_lengths[row], suffix_lengths[row]
        suffix_ids[row, :suffix] = batch[index].tokens_N[length:]
        suffix_mask[row, :suffix] = 1
        positions = torch.arange(length)
        shared_source[row, :length] = row_group[row] * longest_prefix + positions
        member_source[row, :length] = (row_group[row] * longest_prefix + positions) * members + row_member[
            row
        ]
        suffix_positions = row * longest_suffix + torch.arange(suffix)
        shared_source[row, length : length + suffix] = suffix_start_shared + suffix_positions
        member_source[row, length : length + suffix] = suffix_start_member + suffix_positions
    return SharedPrefixMicroBatch(
        indices=plain.indices,
        input_ids_B_T=plain.input_ids_B_T,
        attention_mask_B_T=plain.attention_mask_B_T,
        inputs=plain.inputs,
        lengths=plain.lengths,
        groups=list(groups),
        prefix_ids_P_L=prefix_ids.to(device),
        prefix_mask_P_L=prefix_mask.to(device),
        suffix_ids_R_S=suffix_ids.to(device),
        suffix_mask_R_S=suffix_mask.to(device),
        position_ids_R_S=position_ids.to(device),
        row_group_R=torch.tensor(row_group, device=device),
        row_member_R=torch.tensor(row_member, device=device),
        members=members,
        suffix_source_R_S=suffix_source.to(device),
        shared_source_R_T=shared_source.to(device),
        member_source_R_T=member_source.to(device),
    )
