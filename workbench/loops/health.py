"""RL health signals of one step, from its rollout groups: what to watch to catch a run going wrong.

Each is a number per step, recorded in the history (hence the panel, the plots, W&B and pause
triggers) by `Session.record_rollouts`. With G_j the rewards of group j, N replies in all, and the
token sums taken over every sampled token of every reply:

- `reward:mean`, `reward:std`: mean and population standard deviation of all N rewards.
- `group_reward_std:mean`: mean over groups of std(G_j). Near 0, the groups agree within themselves
  and group-relative advantages vanish.
- `zero_variance_groups:fraction`: share of groups whose rewards are all equal (they train nothing).
- `pass_rate:mean`: share of replies with reward >= `pass_threshold`; `group_pass_rate:mean`: share of
  groups with at least one such reply (pass@G).
- `reply_length:mean`, `reply_length:max`: sampled tokens per reply; `truncated:fraction`: share of
  replies that hit `max_tokens` (stop reason `length`).
- `sampler_entropy:mean`: −mean log q(x_t) over the sampled tokens, an unbiased estimate of the
  sampler's per-token entropy (the cookbook's `optim/entropy`). A collapse towards 0 means the policy
  has stopped exploring.
- With the trainer's logprobs p of the trained replies (`attach_trainer_logprobs`), the
  sampler-vs-trainer mismatch, as tinker-cookbook's `compute_kl_sample_train` estimates it over those
  tokens with d_t = log q(x_t) − log p(x_t): `kl_sample_train_v1:mean` = mean d_t (first order),
  `kl_sample_train_v2:mean` = ½·mean d_t² (second order). Right after sampling both are ~0; a
  growing value means the sampler and the trainer no longer compute the same model (numerics, a
  stale or mismatched sampler).
- With the reference's logprobs r of the sampled tokens, the KL of the policy to the reference,
  estimated from the policy's own samples (Schulman, "Approximating KL divergence", 2020):
  `kl_policy_reference:mean` = mean (log q − log r) (k1, the estimator `kl_penalty` uses) and
  `kl_policy_reference_k3:mean` = mean ((ρ − 1) − log ρ) with ρ = r/q (k3: never negative, lower
  variance).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from workbench.loops.rollout_groups import RolloutGroup


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _std(values: Sequence[float]) -> float:
    """Population standard deviation (divides by the count)."""
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / len(values)) if values else math.nan


def rollout_health(groups: Sequence[RolloutGroup], pass_threshold: float = 1.0) -> dict[str, float]:
    """The step's health signals (see the module docstring for each formula).

    Args:
        groups: The step's rollout groups; the mismatch and reference signals appear only when every
            group carries the trainer's or the reference's logprobs.
        pass_threshold: The reward at or above which a reply counts as passed.

    Raises:
        ValueError: for an empty list of groups.
    """
    if not groups:
        raise ValueError("rollout_health needs at least one rollout group")
    rewards = [r for group in groups for r in group.rewards]
    lengths = [len(s.tokens) for group in groups for s in group.sequences]
    sampled_logprobs = [lp for group in groups for s in group.sequences for lp in s.logprobs]
    metrics = {
        "reward:mean": _mean(rewards),
        "reward:std": _std(rewards),
        "group_reward_std:mean": _mean([_std(group.rewards) for group in groups]),
        "zero_variance_groups:fraction": _mean(
            [float(all(r == group.rewards[0] for r in group.rewards)) for group in groups]
        ),
        "pass_rate:mean": _mean([float(r >= pass_threshold) for r in rewards]),
        "group_pass_rate:mean": _mean(
            [float(any(r >= pass_threshold for r in group.rewards)) for group in groups]
        ),
        "reply_length:mean": _mean(lengths),
        "reply_length:max": float(max(lengths)),
        "truncated:fraction": _mean(
            [float(s.stop_reason == "length") for group in groups for s in group.sequences]
        ),
        "sampler_entropy:mean": -_mean(sampled_logprobs),
    }
    if all(group.trainer_logprobs is not None for group in groups):
        differences = [
            q - p
            for group in groups
            for sequence, trainer in zip(group.sequences, group.trainer_logprobs or [], strict=True)
            if trainer is not None
            for q, p in zip(sequence.logprobs, trainer, strict=True)
        ]
        if differences:
            metrics["kl_sample_train_v1:mean"] = _mean(differences)
            metrics["kl_sample_train_v2:mean"] = 0.5 * _mean([d * d for d in differences])
    if all(group.reference_logprobs is not None for group in groups):
        log_ratios = [
            q - r
            for group in groups
            for sequence, reference in zip(group.sequences, group.reference_logprobs or [], strict=True)
            for q, r in zip(sequence.logprobs, reference, strict=True)
        ]
        if log_ratios:
            metrics["kl_policy_reference:mean"] = _mean(log_ratios)
            metrics["kl_policy_reference_k3:mean"] = _mean(
                [math.expm1(-d) + d for d in log_ratios]  # (ρ − 1) − log ρ with log ρ = −d
            )
    return metrics
