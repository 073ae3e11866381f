"""Advantage estimators against slow, literal implementations of their definitions and hand-worked examples."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch

from workbench.loops.advantages import (
    broadcast_to_tokens,
    completion_mask,
    gae,
    group_relative_advantages,
    kl_penalty,
)

# ---------------------------------------------------------------------------------------------- gae


def slow_gae(rewards: list[float], values: list[float], gamma: float, lam: float) -> list[float]:
    """A_t = Σ_k (γλ)^k δ_{t+k}, δ_t = r_t + γ·V_{t+1} − V_t, V_T = 0, as two plain loops."""
    T = len(rewards)
    next_values = [*values[1:], 0.0]
    deltas = [rewards[t] + gamma * next_values[t] - values[t] for t in range(T)]
    advantages = []
    for t in range(T):
        total = 0.0
        for k in range(T - t):
            total += (gamma * lam) ** k * deltas[t + k]
        advantages.append(total)
    return advantages


@pytest.mark.parametrize(
    "gamma, lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.95), (0.9, 0.0), (0.5, 0.7), (0.0, 1.0)]
)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_matches_the_definition(gamma: float, lam: float, seed: int) -> None:
    rng = random.Random(seed)
    T = rng.randint(1, 12)
    rewards = [rng.uniform(-2, 2) for _ in range(T)]
    values = [rng.uniform(-1, 1) for _ in range(T)]
    advantages_T, returns_T = gae(rewards, values, gamma=gamma, lam=lam)
    assert advantages_T.dtype == torch.float32 and returns_T.dtype == torch.float32
    assert advantages_T.shape == (T,)
    torch.testing.assert_close(
        advantages_T, torch.tensor(slow_gae(rewards, values, gamma, lam)), atol=1e-5, rtol=1e-5
    )
    torch.testing.assert_close(returns_T, advantages_T + torch.tensor(values))


def test_gae_with_lambda_one_is_reward_to_go_minus_values() -> None:
    rng = np.random.default_rng(3)
    rewards, values = rng.normal(size=7), rng.normal(size=7)
    advantages_T, returns_T = gae(rewards, values, gamma=1.0, lam=1.0)
    reward_to_go = np.cumsum(rewards[::-1])[::-1].copy()
    torch.testing.assert_close(advantages_T, torch.tensor(reward_to_go - values, dtype=torch.float32))
    torch.testing.assert_close(returns_T, torch.tensor(reward_to_go, dtype=torch.float32))


def test_gae_with_lambda_zero_is_the_td_error() -> None:
    advantages_T, _ = gae([1.0, 2.0, 3.0], [0.5, 0.25, 1.0], gamma=0.5, lam=0.0)
    # δ = [1 + 0.5·0.25 − 0.5, 2 + 0.5·1 − 0.25, 3 + 0 − 1]
    torch.testing.assert_close(advantages_T, torch.tensor([0.625, 2.25, 2.0]))


def test_gae_hand_example() -> None:
    # rewards [1, 0, 2], values [0.5, 1.0, 1.5], γ = 0.9, λ = 0.5, so γλ = 0.45:
    #   δ_2 = 2 + 0.9·0   − 1.5 = 0.5
    #   δ_1 = 0 + 0.9·1.5 − 1.0 = 0.35
    #   δ_0 = 1 + 0.9·1.0 − 0.5 = 1.4
    #   A_2 = 0.5
    #   A_1 = 0.35 + 0.45·0.5   = 0.575
    #   A_0 = 1.4  + 0.45·0.575 = 1.65875
    #   R   = A + V = [2.15875, 1.575, 2.0]
    advantages_T, returns_T = gae(
        torch.tensor([1.0, 0.0, 2.0]), np.array([0.5, 1.0, 1.5]), gamma=0.9, lam=0.5
    )
    torch.testing.assert_close(advantages_T, torch.tensor([1.65875, 0.575, 0.5]))
    torch.testing.assert_close(returns_T, torch.tensor([2.15875, 1.575, 2.0]))


def test_gae_does_not_modify_its_inputs() -> None:
    rewards_T, values_T = torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.5])
    advantages_T, returns_T = gae(rewards_T, values_T)
    advantages_T += 100
    returns_T += 100
    assert rewards_T.tolist() == [1.0, 2.0] and values_T.tolist() == [0.5, 0.5]


@pytest.mark.parametrize(
    "rewards, values, gamma, lam, match",
    [
        ([1.0, 2.0], [0.0], 1.0, 0.95, "same length"),
        ([], [], 1.0, 0.95, "empty"),
        ([1.0, math.nan], [0.0, 0.0], 1.0, 0.95, "NaN"),
        ([1.0, 1.0], [0.0, math.inf], 1.0, 0.95, "NaN or inf"),
        ([1.0], [0.0], 1.5, 0.95, "gamma"),
        ([1.0], [0.0], -0.1, 0.95, "gamma"),
        ([1.0], [0.0], 1.0, 1.01, "lam"),
        ([[1.0, 2.0]], [[0.0, 0.0]], 1.0, 0.95, "1-D"),
        (["a"], [0.0], 1.0, 0.95, "numbers"),
    ],
)
def test_gae_rejects_bad_input(rewards, values, gamma, lam, match) -> None:
    with pytest.raises(ValueError, match=match):
        gae(rewards, values, gamma=gamma, lam=lam)


# ---------------------------------------------------------------------------------------------- group


def test_group_relative_hand_example() -> None:
    rewards = [2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]  # mean 5, population std 2 (sample std 2.14)
    torch.testing.assert_close(
        group_relative_advantages(rewards), torch.tensor([-3.0, -1.0, -1.0, -1.0, 0.0, 0.0, 2.0, 4.0])
    )
    normalized_G = group_relative_advantages(rewards, normalize_std=True, eps=1e-6)
    expected_G = torch.tensor([-3.0, -1.0, -1.0, -1.0, 0.0, 0.0, 2.0, 4.0]) / (2.0 + 1e-6)
    torch.testing.assert_close(normalized_G, expected_G)
    assert normalized_G.dtype == torch.float32


def test_group_relative_eps_is_added_to_the_std() -> None:
    advantages_G = group_relative_advantages(np.array([0.0, 1.0]), normalize_std=True, eps=0.5)
    # mean 0.5, population std 0.5: ±0.5 / (0.5 + 0.5)
    torch.testing.assert_close(advantages_G, torch.tensor([-0.5, 0.5]))


@pytest.mark.parametrize("normalize_std", [False, True])
@pytest.mark.parametrize("rewards", [[0.1, 0.1, 0.1], [1.0] * 7, [-3.7], [0.3] * 16])
def test_group_relative_identical_rewards_give_zeros(rewards, normalize_std) -> None:
    assert group_relative_advantages(rewards, normalize_std=normalize_std).tolist() == [0.0] * len(rewards)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_group_relative_output_has_zero_mean(normalize_std: bool) -> None:
    rewards_G = torch.randn(16, generator=torch.Generator().manual_seed(0)) * 3 + 5
    advantages_G = group_relative_advantages(rewards_G, normalize_std=normalize_std)
    assert abs(float(advantages_G.mean())) < 1e-5
    if normalize_std:
        assert float(advantages_G.std(unbiased=False)) == pytest.approx(1.0, abs=1e-4)


@pytest.mark.parametrize(
    "rewards, eps, match",
    [
        ([], 1e-6, "empty"),
        ([1.0, math.nan], 1e-6, "NaN"),
        ([1.0, 2.0], 0.0, "eps"),
        ([1.0, 2.0], -1.0, "eps"),
    ],
)
def test_group_relative_rejects_bad_input(rewards, eps, match) -> None:
    with pytest.raises(ValueError, match=match):
        group_relative_advantages(rewards, normalize_std=True, eps=eps)


# ---------------------------------------------------------------------------------------------- tokens


def test_completion_mask() -> None:
    assert completion_mask(2, 5).tolist() == [0.0, 0.0, 1.0, 1.0, 1.0]
    assert completion_mask(0, 3).tolist() == [1.0, 1.0, 1.0]
    assert completion_mask(3, 3).tolist() == [0.0, 0.0, 0.0]
    assert completion_mask(1, 2).dtype == torch.float32


@pytest.mark.parametrize("prompt_length, total_length", [(-1, 3), (4, 3), (0, 0), (1.0, 3), (True, 3)])
def test_completion_mask_rejects_bad_lengths(prompt_length, total_length) -> None:
    with pytest.raises(ValueError):
        completion_mask(prompt_length, total_length)


def test_broadcast_to_tokens() -> None:
    assert broadcast_to_tokens(0.5, [0, 0, 1, 1]).tolist() == [0.0, 0.0, 0.5, 0.5]
    assert broadcast_to_tokens(-2.0, completion_mask(1, 4)).tolist() == [0.0, -2.0, -2.0, -2.0]
    assert broadcast_to_tokens(3, np.array([True, False, True])).tolist() == [3.0, 0.0, 3.0]
    advantages_G = group_relative_advantages([1.0, 0.0])
    advantages_T = broadcast_to_tokens(advantages_G[0], torch.tensor([0.0, 2.0, 1.0]))
    assert advantages_T.tolist() == [0.0, 0.5, 0.5] and advantages_T.dtype == torch.float32


@pytest.mark.parametrize(
    "value, mask", [(math.nan, [1]), (math.inf, [1]), (1.0, []), (1.0, [math.nan]), ([1.0, 2.0], [1])]
)
def test_broadcast_rejects_bad_input(value, mask) -> None:
    with pytest.raises(ValueError):
        broadcast_to_tokens(value, mask)


# ---------------------------------------------------------------------------------------------- kl


def slow_kl_penalty(advantages, sampled, reference, masks, coef, discount):
    """The definition, one float at a time (discounted sums re-zeroed where the mask is 0)."""
    diffs = [
        [(s - r) * m for s, r, m in zip(s_d, r_d, m_d, strict=True)]
        for s_d, r_d, m_d in zip(sampled, reference, masks, strict=True)
    ]
    avg = sum(sum(d) for d in diffs) / sum(sum(m) for m in masks)
    out = []
    for adv, diff, mask in zip(advantages, diffs, masks, strict=True):
        kl = [coef * m * (avg - d) for m, d in zip(mask, diff, strict=True)]
        if discount > 0:
            kl = [
                sum(discount**k * kl[t + k] for k in range(len(kl) - t)) if mask[t] != 0 else 0.0
                for t in range(len(kl))
            ]
        out.append([a + k for a, k in zip(adv, kl, strict=True)])
    return out, avg


def random_batch(seed: int):
    rng = random.Random(seed)
    advantages, sampled, reference, masks = [], [], [], []
    for _ in range(rng.randint(1, 4)):
        prompt, completion = rng.randint(0, 4), rng.randint(1, 6)
        advantage = rng.uniform(-1, 1)
        advantages.append([0.0] * prompt + [advantage] * completion)
        sampled.append([0.0] * prompt + [rng.uniform(-4, 0) for _ in range(completion)])
        reference.append([rng.uniform(-4, 0) for _ in range(prompt + completion)])
        masks.append([0.0] * prompt + [1.0] * completion)
    return advantages, sampled, reference, masks


@pytest.mark.parametrize("discount", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_kl_penalty_matches_the_definition(seed: int, discount: float) -> None:
    advantages, sampled, reference, masks = random_batch(seed)
    new_advantages_D, metrics = kl_penalty(advantages, sampled, reference, masks, coef=0.3, discount=discount)
    expected, avg = slow_kl_penalty(advantages, sampled, reference, masks, 0.3, discount)
    assert len(new_advantages_D) == len(advantages)
    for got_T, want in zip(new_advantages_D, expected, strict=True):
        assert got_T.dtype == torch.float32
        torch.testing.assert_close(got_T, torch.tensor(want, dtype=torch.float32), atol=1e-5, rtol=1e-5)
    assert metrics == {"kl_policy_reference:mean": pytest.approx(avg, abs=1e-6)}


def test_kl_penalty_hand_example() -> None:
    # One prompt position, three completion positions; coef 0.5, discount 0.9.
    #   diff   = (sampled − reference) · mask = [0, 0.5, −1, 0.5]; avg = 0 / 3 = 0
    #   kl_adv = 0.5 · mask · (avg − diff)    = [0, −0.25, 0.5, −0.25]
    #   discounted, from the end: −0.25; 0.5 + 0.9·(−0.25) = 0.275; −0.25 + 0.9·0.275 = −0.0025;
    #   the prompt position stays 0 (it would be 0.9·(−0.0025) without the mask)
    advantages = [[0.0, 1.0, 1.0, 1.0]]
    sampled = [[0.0, -1.0, -2.0, -0.5]]
    reference = [[-3.0, -1.5, -1.0, -1.0]]
    masks = [[0.0, 1.0, 1.0, 1.0]]
    undiscounted_D, metrics = kl_penalty(advantages, sampled, reference, masks, coef=0.5)
    torch.testing.assert_close(undiscounted_D[0], torch.tensor([0.0, 0.75, 1.5, 0.75]))
    assert metrics == {"kl_policy_reference:mean": 0.0}
    discounted_D, _ = kl_penalty(advantages, sampled, reference, masks, coef=0.5, discount=0.9)
    torch.testing.assert_close(discounted_D[0], torch.tensor([0.0, 0.9975, 1.275, 0.75]))


def test_kl_penalty_metric_is_the_masked_batch_average() -> None:
    # diffs on mask: datum 0 → [1, 2], datum 1 → [3]; prompt positions (with large diffs) are ignored.
    sampled = [[0.0, 1.0, 2.0], [3.0, 9.0]]
    reference = [[-7.0, 0.0, 0.0], [0.0, 0.0]]
    masks = [[0, 1, 1], [1, 0]]
    advantages = [[0.0, 0.0, 0.0], [0.0, 0.0]]
    new_advantages_D, metrics = kl_penalty(advantages, sampled, reference, masks, coef=1.0)
    assert metrics["kl_policy_reference:mean"] == pytest.approx(2.0)
    assert new_advantages_D[0].tolist() == [0.0, 1.0, 0.0]
    assert new_advantages_D[1].tolist() == [-1.0, 0.0]


def test_kl_penalty_zero_coef_leaves_advantages_unchanged() -> None:
    advantages, sampled, reference, masks = random_batch(5)
    new_advantages_D, _ = kl_penalty(advantages, sampled, reference, masks, coef=0.0, discount=0.9)
    for got_T, want in zip(new_advantages_D, advantages, strict=True):
        torch.testing.assert_close(got_T, torch.tensor(want, dtype=torch.float32))


def test_kl_penalty_does_not_modify_its_inputs() -> None:
    advantages = [torch.tensor([0.0, 1.0, 1.0]), np.array([0.0, -1.0], dtype=np.float32)]
    sampled = [torch.tensor([0.0, -1.0, -2.0]), np.array([0.0, -0.5], dtype=np.float32)]
    reference = [torch.tensor([-1.0, -2.0, -1.0]), np.array([-1.0, -1.5], dtype=np.float32)]
    masks = [torch.tensor([0.0, 1.0, 1.0]), np.array([0.0, 1.0], dtype=np.float32)]
    before = [[x.tolist() for x in group] for group in (advantages, sampled, reference, masks)]
    new_advantages_D, _ = kl_penalty(advantages, sampled, reference, masks, coef=1.0, discount=0.5)
    for new_T in new_advantages_D:
        new_T += 100.0  # the outputs share no memory with the inputs
    after = [[x.tolist() for x in group] for group in (advantages, sampled, reference, masks)]
    assert before == after


def test_kl_penalty_all_masks_zero_gives_zero_average() -> None:
    new_advantages_D, metrics = kl_penalty([[1.0, 2.0]], [[-1.0, -1.0]], [[-2.0, -3.0]], [[0, 0]], coef=1.0)
    assert metrics == {"kl_policy_reference:mean": 0.0}
    assert new_advantages_D[0].tolist() == [1.0, 2.0]


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        (([], [], [], []), {"coef": 0.1}, "at least one datum"),
        (([[0.0]], [[0.0]], [[0.0]], []), {"coef": 0.1}, "same number"),
        (([[0.0, 0.0]], [[0.0]], [[0.0]], [[1.0]]), {"coef": 0.1}, "same length"),
        (([[0.0]], [[math.nan]], [[0.0]], [[1.0]]), {"coef": 0.1}, "NaN"),
        (([[0.0]], [[0.0]], [[-math.inf]], [[1.0]]), {"coef": 0.1}, "NaN or inf"),
        (([[]], [[]], [[]], [[]]), {"coef": 0.1}, "empty"),
        (([[0.0]], [[0.0]], [[0.0]], [[1.0]]), {"coef": -0.1}, "coef"),
        (([[0.0]], [[0.0]], [[0.0]], [[1.0]]), {"coef": math.nan}, "coef"),
        (([[0.0]], [[0.0]], [[0.0]], [[1.0]]), {"coef": 0.1, "discount": 1.5}, "discount"),
    ],
)
def test_kl_penalty_rejects_bad_input(args, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        kl_penalty(*args, **kwargs)
