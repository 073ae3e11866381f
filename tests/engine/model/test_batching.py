"""Micro-batch planning: bounded memory, little padding, every datum exactly once."""

from __future__ import annotations

import itertools
import random

import torch

from workbench.engine.model.batching import (
    MICROBATCH_OVERHEAD_TOKENS,
    PreparedDatum,
    collate,
    plan_microbatches,
)


def _padded_cost(lengths: list[int], groups: list[list[int]]) -> int:
    return sum(len(g) * max(lengths[i] for i in g) for g in groups)


def test_every_datum_appears_once_and_budget_holds() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(16, 256) for _ in range(200)]
    groups = plan_microbatches(lengths, token_budget=2048)
    assert sorted(i for g in groups for i in g) == list(range(200))
    for group in groups:
        assert len(group) * max(lengths[i] for i in group) <= 2048


def test_ragged_batches_waste_little_padding() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(16, 256) for _ in range(64)]
    groups = plan_microbatches(lengths, token_budget=16384)
    real = sum(lengths)
    padded_to_longest = len(lengths) * max(lengths)
    planned = _padded_cost(lengths, groups)
    assert planned < 1.15 * real
    assert padded_to_longest / real > 1.5  # what the plan saves against padding everything


def test_equal_lengths_make_one_microbatch_within_budget() -> None:
    assert (
        plan_microbatches([128] * 16, token_budget=4096) == [list(range(16))]
        or len(plan_microbatches([128] * 16, token_budget=4096)) == 1
    )
    assert len(plan_microbatches([128] * 64, token_budget=4096)) == 2


def test_plan_is_optimal_for_small_cases() -> None:
    """Brute force over all contiguous splits of the sorted order agrees with the planner's cost."""
    rng = random.Random(2)
    for _ in range(20):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 8))]
        budget = rng.randint(50, 200)
        groups = plan_microbatches(lengths, budget)
        cost = _padded_cost(lengths, groups) + MICROBATCH_OVERHEAD_TOKENS * len(groups)
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        best = float("inf")
        n = len(order)
        for mask in range(1 << (n - 1)):
            cuts = [0] + [k + 1 for k in range(n - 1) if mask >> k & 1] + [n]
            split = [order[a:b] for a, b in itertools.pairwise(cuts)]
            if any(len(g) * max(lengths[i] for i in g) > budget and len(g) > 1 for g in split):
                continue
            best = min(best, _padded_cost(lengths, split) + MICROBATCH_OVERHEAD_TOKENS * len(split))
        assert cost == best


def test_a_datum_longer_than_the_budget_goes_alone() -> None:
    groups = plan_microbatches([10, 500, 12], token_budget=100)
    assert [1] in groups


def test_collate_right_pads_and_keeps_indices() -> None:
    batch = [
        PreparedDatum(torch.tensor([1, 2, 3]), {"weights": torch.tensor([1.0, 1.0, 1.0])}),
        PreparedDatum(torch.tensor([4]), {"weights": torch.tensor([0.5])}),
    ]
    micro = collate(batch, [1, 0], pad_token_id=0, device=torch.device("cpu"))
    assert micro.indices == [1, 0]
    assert micro.input_ids_B_T.tolist() == [[4, 0, 0], [1, 2, 3]]
    assert micro.attention_mask_B_T.tolist() == [[1, 0, 0], [1, 1, 1]]
    assert micro.inputs["weights"].tolist() == [[0.5, 0.0, 0.0], [1.0, 1.0, 1.0]]
    assert micro.num_tokens == 4


def test_training_plans_count_the_recomputation_beyond_full_activations() -> None:
    lengths = [128] * 16  # 2048 tokens: one pass recomputes half of them, two passes recompute none
    assert len(plan_microbatches(lengths, token_budget=32768)) == 1
    groups = plan_microbatches(lengths, token_budget=32768, full_activation_tokens=1024)
    assert [len(group) for group in groups] == [8, 8]
    assert len(plan_microbatches([2048], token_budget=32768, full_activation_tokens=1024)) == 1
