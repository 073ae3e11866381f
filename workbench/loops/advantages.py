"""Advantages for policy-gradient losses: GAE, group-relative baselines, and a KL penalty.

The policy losses (`importance_sampling`, `ppo`, `cispo`, `dro`) read one advantage per position of a
datum; how those numbers are made is the researcher's choice, and these are the usual ones.

- `gae`: Generalized Advantage Estimation (Schulman et al. 2015, https://arxiv.org/abs/1506.02438) from
  per-step rewards and a critic's values. δ_t = r_t + γ·V_{t+1} − V_t with V_T = 0 (the episode ends
  after the last step), A_t = Σ_{k≥0} (γλ)^k · δ_{t+k}, and the critic's target R_t = A_t + V_t.
  λ = 1 gives the Monte-Carlo return minus the value; λ = 0 the one-step TD error.
- `group_relative_advantages`: GRPO's baseline (Shao et al. 2024, DeepSeekMath,
  https://arxiv.org/abs/2402.03300): sample G completions of one prompt, A_i = r_i − mean(r), optionally
  divided by the group's standard deviation. No critic needed.
- `broadcast_to_tokens` and `completion_mask`: put one sequence-level advantage on the completion
  positions of a datum, 0 on the prompt.
- `kl_penalty`: fold a penalty towards a reference policy into the advantages, as the tinker-cookbook's
  `incorporate_kl_penalty` does. With diff_t = log π(x_t) − log π_ref(x_t) on the sampled tokens, the
  batch average of diff is a (k1) estimate of KL(π ‖ π_ref), and each token gets coef · (avg − diff_t):
  a reward of −coef · diff_t with the batch average as baseline.

Sequence arguments may be python lists, numpy arrays, torch tensors or `TensorData`; results are float32 CPU tensors.
Inputs are never modified. Bad input (empty, NaN or inf, mismatched lengths, a rate outside [0, 1])
raises ValueError.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from workbench.types import TensorData

Vector = Sequence[float] | np.ndarray | Tensor | TensorData


def _as_vector(name: str, value: Vector) -> Tensor:
    """`value` as a non-empty, finite, 1-D float32 CPU tensor. It may share memory with `value`: read only."""
    if isinstance(value, TensorData):  # e.g. a critic's `values` output, used as is
        value = value.to_numpy()
    try:
        tensor = torch.as_tensor(
            value.detach() if isinstance(value, Tensor) else value, dtype=torch.float32, device="cpu"
        )
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"{name} must be a 1-D sequence of numbers ({error})") from None
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(tensor.shape)}")
    if tensor.numel() == 0:
        raise ValueError(f"{name} is empty")
    if not torch.isfinite(tensor).all():
        raise ValueError(f"{name} contains NaN or inf")
    return tensor


def _check_rate(name: str, value: float) -> float:
    """A discount-like factor, which must be a number in [0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")
    return float(value)


def _discounted_future_sum(x_T: Tensor, discount: float) -> Tensor:
    """out_t = Σ_{k≥0} discount^k · x_{t+k}, by the backward recursion out_t = x_t + discount · out_{t+1}.

    Runs in python floats (double precision); T is a sequence length, so the loop is short.
    """
    out = [0.0] * len(x_T)
    running = 0.0
    for t, x in reversed(list(enumerate(x_T.tolist()))):
        running = x + discount * running
        out[t] = running
    return torch.tensor(out, dtype=torch.float32)


def gae(rewards_T: Vector, values_T: Vector, gamma: float = 1.0, lam: float = 0.95) -> tuple[Tensor, Tensor]:
    """Generalized Advantage Estimation over one episode of T steps that ends after the last step.

    δ_t = r_t + γ·V_{t+1} − V_t (with V_T = 0), A_t = Σ_{k≥0} (γλ)^k · δ_{t+k}, R_t = A_t + V_t.

    Args:
        rewards_T: Reward received at each step (often 0 everywhere but the last token).
        values_T: The critic's value estimate V_t at each step.
        gamma: Discount γ in [0, 1]; 1 is usual for language-model episodes.
        lam: GAE's λ in [0, 1]: 0 is the one-step TD error (low variance, biased by the critic),
            1 the Monte-Carlo return minus V_t (unbiased, high variance).

    Returns:
        `(advantages_T, returns_T)`: the policy's advantages and the critic's regression targets.

    Raises:
        ValueError: on empty or non-finite inputs, unequal lengths, or γ, λ outside [0, 1].
    """
    gamma, lam = _check_rate("gamma", gamma), _check_rate("lam", lam)
    rewards_T, values_T = _as_vector("rewards_T", rewards_T), _as_vector("values_T", values_T)
    if len(rewards_T) != len(values_T):
        raise ValueError(
            f"rewards_T and values_T must have the same length, got {len(rewards_T)} and {len(values_T)}"
        )
    rewards_f64_T, values_f64_T = rewards_T.double(), values_T.double()
    next_values_T = torch.cat([values_f64_T[1:], values_f64_T.new_zeros(1)])
    deltas_T = rewards_f64_T + gamma * next_values_T - values_f64_T
    advantages_T = _discounted_future_sum(deltas_T, gamma * lam)
    return advantages_T, advantages_T + values_T


def group_relative_advantages(rewards_G: Vector, normalize_std: bool = False, eps: float = 1e-6) -> Tensor:
    """GRPO advantages for G completions of one prompt: each reward minus the group's mean.

    A_i = r_i − mean(r), or (r_i − mean(r)) / (std(r) + eps) with `normalize_std`, where std is the
    population standard deviation (divides by G, i.e. `unbiased=False`). A group whose rewards are all
    equal carries no learning signal and gets exactly zero advantages. Dr. GRPO (Liu et al. 2025,
    https://arxiv.org/abs/2503.20783) argues against the std division, hence the default.

    Args:
        rewards_G: One scalar reward per completion in the group.
        normalize_std: Divide by the group's standard deviation plus `eps`.
        eps: Added to the standard deviation; must be > 0.

    Returns:
        `advantages_G`, float32.

    Raises:
        ValueError: on an empty or non-finite group, or `eps <= 0`.
    """
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    rewards_G = _as_vector("rewards_G", rewards_G)
    if torch.all(rewards_G == rewards_G[0]):
        return torch.zeros_like(rewards_G)
    rewards_f64_G = rewards_G.double()
    advantages_G = rewards_f64_G - rewards_f64_G.mean()
    if normalize_std:
        advantages_G = advantages_G / (rewards_f64_G.std(unbiased=False) + eps)
    return advantages_G.float()


def completion_mask(prompt_length: int, total_length: int) -> Tensor:
    """1.0 on the positions after the first `prompt_length`, 0.0 on those: `[0]*prompt_length + [1]*rest`.

    With a Tinker datum built from `tokens = prompt + completion` as `model_input = tokens[:-1]` and
    `target_tokens = tokens[1:]`, position i predicts token i + 1, so the first completion token is
    predicted at position `len(prompt) - 1`: pass `prompt_length = len(prompt) - 1` and
    `total_length = len(tokens) - 1`.

    Raises:
        ValueError: unless `0 <= prompt_length <= total_length` and `total_length >= 1` (integers).
    """
    for name, value in (("prompt_length", prompt_length), ("total_length", total_length)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{name} must be an integer, got {value!r}")
    if total_length < 1:
        raise ValueError(f"total_length must be >= 1, got {total_length}")
    if not 0 <= prompt_length <= total_length:
        raise ValueError(f"prompt_length must be in [0, total_length={total_length}], got {prompt_length}")
    mask_T = torch.ones(int(total_length), dtype=torch.float32)
    mask_T[: int(prompt_length)] = 0.0
    return mask_T


def broadcast_to_tokens(value: float, mask_T: Vector) -> Tensor:
    """One sequence-level scalar (e.g. a GRPO advantage) on every position where `mask_T` is nonzero.

    Args:
        value: The number to place, e.g. `float(advantages_G[i])`.
        mask_T: Nonzero on the completion positions (see `completion_mask`), zero elsewhere.

    Returns:
        A float32 length-T tensor: `value` where the mask is nonzero, 0.0 elsewhere.

    Raises:
        ValueError: on a non-finite `value` or an empty or non-finite mask.
    """
    try:
        value = float(value)
    except (TypeError, ValueError, RuntimeError):
        raise ValueError(f"value must be a single number, got {value!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"value must be finite, got {value}")
    mask_T = _as_vector("mask_T", mask_T)
    return torch.where(mask_T != 0, torch.tensor(value, dtype=torch.float32), torch.tensor(0.0))


def kl_penalty(
    advantages_D: Sequence[Vector],
    sampled_logprobs_D: Sequence[Vector],
    reference_logprobs_D: Sequence[Vector],
    masks_D: Sequence[Vector],
    coef: float,
    discount: float = 0.0,
) -> tuple[list[Tensor], dict[str, float]]:
    """Add a KL penalty towards a reference policy to each datum's per-token advantages.

    For D datums, each with T_d positions:

        diff_d = (sampled_logprobs_d − reference_logprobs_d) · mask_d
        avg = Σ_d Σ_t diff_d / Σ_d Σ_t mask_d                (0 when every mask is 0)
        kl_adv_d = coef · mask_d · (avg − diff_d)
        advantages_d + kl_adv_d                               (returned)

    With `discount > 0` each token's KL term also charges the tokens before it: kl_adv_d is replaced by
    its discounted future sum, out_t = Σ_{k≥0} discount^k · kl_adv_{t+k}, and then set to 0 where the
    mask is 0, so prompt and observation positions keep their advantage (the cookbook leaves the sum
    there too, which would train on prompt tokens).

    Args:
        advantages_D: Per-datum advantages, one 1-D sequence per datum.
        sampled_logprobs_D: log π(x_t) of the sampled tokens (the `logprobs` loss input).
        reference_logprobs_D: log π_ref(x_t) of the same tokens under the reference policy.
        masks_D: 1 on the sampled (completion) positions, 0 on the prompt and observations.
        coef: Penalty strength, >= 0; 0 leaves the advantages as they are.
        discount: Discount in [0, 1] for the future sum; 0 keeps each token's own term.

    Returns:
        The new per-datum advantages (float32; the inputs are not modified), and the metrics
        `{"kl_policy_reference:mean": avg}`.

    Raises:
        ValueError: on an empty batch, lists of different lengths, a datum whose sequences differ in
            length, empty or non-finite sequences, a negative or non-finite `coef`, or `discount`
            outside [0, 1].
    """
    if (
        isinstance(coef, bool)
        or not isinstance(coef, (int, float))
        or not (math.isfinite(coef) and coef >= 0)
    ):
        raise ValueError(f"coef must be a finite number >= 0, got {coef!r}")
    discount = _check_rate("discount", discount)
    num_datums = (len(advantages_D), len(sampled_logprobs_D), len(reference_logprobs_D), len(masks_D))
    if len(set(num_datums)) != 1:
        raise ValueError(
            "advantages_D, sampled_logprobs_D, reference_logprobs_D and masks_D must hold the same number "
            f"of datums, got {num_datums}"
        )
    if num_datums[0] == 0:
        raise ValueError("kl_penalty needs at least one datum")

    advantages_f64_D, diffs_f64_D, masks_f64_D = [], [], []
    for d in range(len(advantages_D)):
        advantages_T = _as_vector(f"advantages_D[{d}]", advantages_D[d])
        sampled_T = _as_vector(f"sampled_logprobs_D[{d}]", sampled_logprobs_D[d])
        reference_T = _as_vector(f"reference_logprobs_D[{d}]", reference_logprobs_D[d])
        mask_T = _as_vector(f"masks_D[{d}]", masks_D[d])
        if not len(advantages_T) == len(sampled_T) == len(reference_T) == len(mask_T):
            raise ValueError(
                f"datum {d}: advantages, sampled_logprobs, reference_logprobs and mask must have the same "
                f"length, got {len(advantages_T)}, {len(sampled_T)}, {len(reference_T)} and {len(mask_T)}"
            )
        advantages_f64_D.append(advantages_T.double())
        masks_f64_D.append(mask_T.double())
        diffs_f64_D.append((sampled_T.double() - reference_T.double()) * mask_T.double())

    total_mask = sum(float(mask_T.sum()) for mask_T in masks_f64_D)
    avg = sum(float(diff_T.sum()) for diff_T in diffs_f64_D) / total_mask if total_mask != 0 else 0.0

    new_advantages_D = []
    for advantages_T, diff_T, mask_T in zip(advantages_f64_D, diffs_f64_D, masks_f64_D, strict=True):
        kl_advantages_T = coef * mask_T * (avg - diff_T)
        if discount > 0:
            kl_advantages_T = _discounted_future_sum(kl_advantages_T, discount).double() * (mask_T != 0)
        new_advantages_D.append((advantages_T + kl_advantages_T).float())
    return new_advantages_D, {"kl_policy_reference:mean": avg}
