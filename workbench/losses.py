"""Loss functions with Tinker's exact semantics: token-level, summed (never averaged).

Notation: B datums in a micro-batch, T positions. `logprobs_B_T` are the learner's log-probabilities of
`target_tokens` (log p_θ), `sampling_logprobs_B_T` the sampler's (log q, the `logprobs` input), A the
`advantages`. `mask_B_T` is True on real (non-padding) positions. Every loss returns its per-position
loss (zero where it does not apply), the positions that count, and per-position diagnostics that the
session averages over those positions into `name:mean` metrics. The total loss is the sum of the
per-position losses over positions and datums; "If you would like to explore different aggregation
schemes, you can include that in the advantage tensor computation" (Tinker docs).

| loss                 | needs                                   | config (Tinker default)                        |
|----------------------|-----------------------------------------|------------------------------------------------|
| cross_entropy        | target_tokens, [weights=1]; both (N,)   | -                                              |
|                      | or both (N, K) (soft targets)           |                                                |
| importance_sampling  | target_tokens, logprobs, advantages     | -                                              |
| ppo                  | target_tokens, logprobs, advantages     | clip_low_threshold 0.8, clip_high_threshold 1.2 |
| cispo                | target_tokens, logprobs, advantages     | clip_low_threshold 0.0, clip_high_threshold 4.0 |
| dro                  | target_tokens, logprobs, advantages     | beta 0.05                                      |
| gspo                 | target_tokens, logprobs, advantages,    | clip_low_threshold 0.8, clip_high_threshold 1.2 |
|                      | sequence_ratio_mask                     |                                                |
| dppo (SkyRL)         | target_tokens, logprobs, advantages     | delta_low 0.2, delta_high 0.2                  |
| stable_reinforce     | target_tokens, advantages, [logprobs];  | clip_high_threshold 2.0                        |
|                      | provenance spans naming sampled         |                                                |
|                      | sequences (`record_stability_info`)     |                                                |
| ppo_critic (critic)  | values (old), returns, [weights=1]      | value_clip 0.2                                 |

`importance_sampling`, `ppo`, `cispo` and `dro` also report the sampler-vs-trainer mismatch,
`kl_sample_train_v1:mean` and `kl_sample_train_v2:mean` (`_sampler_mismatch`), so every RL step shows
whether the sampler and the trainer still compute the same model.

`stable_reinforce` reads what the engine recorded when it sampled (`recorded_logprobs`, `sampled`):
the engine fills those two inputs from the datum's provenance spans before the call is queued
(`workbench.engine.local.provenance`); a caller never passes them.

Custom losses are plain functions `fn(data, logprobs_list) -> (loss, metrics)` passed to
`TrainingClient.forward_backward_custom`; they need no entry here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor


@dataclass(frozen=True)
class LossOutput:
    """What a loss returns for one micro-batch."""

    elementwise_loss_B_T: Tensor  # summed into `loss:sum`; zero on padding
    active_B_T: Tensor  # bool: positions that carry loss; `:mean` diagnostics average over them
    diagnostics: dict[str, Tensor] = field(default_factory=dict)  # name -> (B, T) per-position values


FLOAT32_MAX = float(torch.finfo(torch.float32).max)
"""The largest loss_fn_config value: the losses compute in float32, where a larger one is infinite."""

LossFn = Callable[[Tensor, Mapping[str, Tensor], Tensor, Mapping[str, float]], LossOutput]


@dataclass(frozen=True)
class LossSpec:
    """A loss and what it needs.

    `head` is what the model predicts for it: the policy's `logprobs` of `target_tokens`, or the
    critic's `values`. `required_inputs` must be in every datum; `training_inputs` are required by
    `forward_backward` but may be left out of `forward`, which then returns predictions only.
    `optional_inputs` maps each optional input to the value used where a datum leaves it out (None:
    left out of the inputs).
    `summarize` derives batch-level metrics from the averaged diagnostics. `reports_entropy` adds the
    policy's mean next-token entropy (`entropy:mean`), the RL losses' usual collapse signal.
    `check_datum` returns what is wrong with one datum's inputs beyond their shapes (None when nothing
    is). `uses_sampling_records` marks a loss that trains on what the engine recorded at sampling time:
    its datums name the sampled sequences with provenance spans, and the engine adds
    `recorded_logprobs` and `sampled` to their inputs. `soft_targets` marks a loss that also takes K
    targets per position: `target_tokens` and `weights` of shape (N, K), its logprobs then (B, T, K).
    `gradient_scale` names the input that multiplies every term of the loss (the advantages of a
    policy-gradient loss, the weights of cross-entropy): a datum whose values of it are all 0 has no
    gradient, and `forward_backward` computes it forward only. None where some term is not scaled by
    one input (DRO's quadratic penalty).
    """

    fn: LossFn
    head: Literal["logprobs", "values"]
    required_inputs: tuple[str, ...]
    optional_inputs: Mapping[str, float | None] = field(default_factory=dict)
    training_inputs: tuple[str, ...] = ()
    config_defaults: Mapping[str, float] = field(default_factory=dict)
    summarize: Callable[[dict[str, float]], dict[str, float]] | None = None
    reports_entropy: bool = False
    check_datum: Callable[[Mapping[str, Tensor]], str | None] | None = None
    uses_sampling_records: bool = False
    soft_targets: bool = False
    gradient_scale: str | None = None


def cross_entropy(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor, config: Mapping[str, float]
) -> LossOutput:
    """Supervised learning: weighted negative log-likelihood of the targets.

    loss = Σ_t −w_t · log p_θ(x_t). Weights are usually 0 on the prompt and 1 on the completion; any
    float works (negative weights push probability down).

    Soft targets (Tinker's multi-target form, used for top-K distillation): with K targets per position,
    `target_tokens` and `weights` of shape (N, K) and the logprobs (B, T, K),

        loss = Σ_t Σ_k −w_{t,k} · log p_θ(x_{t,k} | prefix_t),

    the cross-entropy from the target distribution w_t (e.g. a teacher's renormalised top-K
    probabilities) to the model, i.e. the forward KL(w_t ‖ p_θ) up to w_t's entropy, which does not
    depend on θ. Nothing is normalised: a position's loss is its weighted sum over its K targets, and
    (target 0, weight 0) pads a row that has fewer than K. A position's elementwise loss is that sum.
    """
    if logprobs_B_T.dim() == 3:
        weights_B_T_K = inputs["weights"] * mask_B_T[..., None]
        return LossOutput(
            elementwise_loss_B_T=-(logprobs_B_T * weights_B_T_K).sum(dim=-1),
            active_B_T=(weights_B_T_K != 0).any(dim=-1),
        )
    weights_B_T = inputs["weights"] * mask_B_T
    return LossOutput(
        elementwise_loss_B_T=-logprobs_B_T * weights_B_T,
        active_B_T=(weights_B_T != 0),
    )


def _ratio(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """r_t = p_θ(x_t) / q(x_t), the advantages, and the positions with a non-zero advantage."""
    advantages_B_T = inputs["advantages"] * mask_B_T
    ratio_B_T = torch.exp(logprobs_B_T - inputs["logprobs"]) * mask_B_T
    return ratio_B_T, advantages_B_T, (advantages_B_T != 0) & mask_B_T


def _sampler_mismatch(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor
) -> dict[str, Tensor]:
    """How far the sampler's logprobs q are from the trainer's p on the same tokens, d_t = log q − log p,
    as tinker-cookbook's `compute_kl_sample_train` estimates KL(sampler ‖ trainer): `kl_sample_train_v1`
    = d_t (first order) and `kl_sample_train_v2` = ½·d_t² (second order), averaged by the engine over
    the positions the loss trains on. Both are ~0 when the two compute the same model; a growing value
    means stale samples or a sampler whose numerics differ from the trainer's."""
    difference_B_T = (inputs["logprobs"] - logprobs_B_T.detach()) * mask_B_T
    return {"kl_sample_train_v1": difference_B_T, "kl_sample_train_v2": 0.5 * difference_B_T**2}


def importance_sampling(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor, config: Mapping[str, float]
) -> LossOutput:
    """REINFORCE with an importance-sampling correction for sampler/learner mismatch.

    loss = −Σ_t r_t · A_t with r_t = p_θ(x_t)/q(x_t); gradient −A_t · r_t · ∇log p_θ(x_t).
    (Williams 1992; off-policy correction as in the Tinker docs.)
    """
    ratio_B_T, advantages_B_T, active_B_T = _ratio(logprobs_B_T, inputs, mask_B_T)
    return LossOutput(
        elementwise_loss_B_T=-ratio_B_T * advantages_B_T,
        active_B_T=active_B_T,
        diagnostics={"ratio": ratio_B_T.detach(), **_sampler_mismatch(logprobs_B_T, inputs, mask_B_T)},
    )


def _clip_fraction(ratio_B_T: Tensor, low: float, high: float) -> Tensor:
    return ((ratio_B_T < low) | (ratio_B_T > high)).float()


def ppo(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor, config: Mapping[str, float]
) -> LossOutput:
    """Clipped surrogate objective (Schulman et al. 2017, https://arxiv.org/abs/1707.06347).

    loss = −Σ_t min(r_t·A_t, clip(r_t, low, high)·A_t), thresholds given as absolute ratio bounds
    (Tinker: `clip_low_threshold` 0.8, `clip_high_threshold` 1.2, i.e. ε = 0.2 on both sides).
    """
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio_B_T, advantages_B_T, active_B_T = _ratio(logprobs_B_T, inputs, mask_B_T)
    clipped_B_T = torch.clamp(ratio_B_T, low, high)
    objective_B_T = torch.minimum(ratio_B_T * advantages_B_T, clipped_B_T * advantages_B_T)
    return LossOutput(
        elementwise_loss_B_T=-objective_B_T * mask_B_T,
        active_B_T=active_B_T,
        diagnostics={
            "ratio": ratio_B_T.detach(),
            "clip_fraction": _clip_fraction(ratio_B_T.detach(), low, high),
            **_sampler_mismatch(logprobs_B_T, inputs, mask_B_T),
        },
    )


def cispo(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor, config: Mapping[str, float]
) -> LossOutput:
    """Clipped IS-weight policy optimisation (MiniMax-M1, https://arxiv.org/abs/2506.13585).

    loss = −Σ_t sg(clip(r_t, low, high)) · A_t · log p_θ(x_t): the IS weight is clipped and detached,
    so every token keeps a gradient (PPO zeroes the clipped ones). Tinker defaults: 0.0 and 4.0.
    """
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    ratio_B_T, advantages_B_T, active_B_T = _ratio(logprobs_B_T, inputs, mask_B_T)
    weight_B_T = torch.clamp(ratio_B_T, low, high).detach()
    return LossOutput(
        elementwise_loss_B_T=-weight_B_T * advantages_B_T * logprobs_B_T * mask_B_T,
        active_B_T=active_B_T,
        diagnostics={
            "ratio": ratio_B_T.detach(),
            "clip_fraction": _clip_fraction(ratio_B_T.detach(), low, high),
            **_sampler_mismatch(logprobs_B_T, inputs, mask_B_T),
        },
    )


def dro(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor, config: Mapping[str, float]
) -> LossOutput:
    """Direct Reward Optimisation (Richemond et al. 2024, https://arxiv.org/abs/2405.19107).

    loss = −Σ_t (log p_θ(x_t)·A_t − ½·β·(log p_θ(x_t) − log q(x_t))²): a policy-gradient term plus a
    quadratic proximal penalty towards the sampler. The penalty applies at every position, advantage or
    not, as in Tinker.
    """
    beta = config["beta"]
    advantages_B_T = inputs["advantages"] * mask_B_T
    log_ratio_B_T = (logprobs_B_T - inputs["logprobs"]) * mask_B_T
    objective_B_T = logprobs_B_T * advantages_B_T - 0.5 * beta * log_ratio_B_T**2
    return LossOutput(
        elementwise_loss_B_T=-objective_B_T * mask_B_T,
        active_B_T=mask_B_T,
        diagnostics={
            "ratio": torch.exp(log_ratio_B_T.detach()) * mask_B_T,
            **_sampler_mismatch(logprobs_B_T, inputs, mask_B_T),
        },
    )


def gspo(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor, config: Mapping[str, float]
) -> LossOutput:
    """Group Sequence Policy Optimisation, token-level variant (Zheng et al. 2025,
    https://arxiv.org/abs/2507.18071), as Tinker computes it.

    One ratio per datum, over the positions M that `sequence_ratio_mask` marks:
    s = exp(mean_{t∈M}(log p_θ(x_t) − log q(x_t))) with the learner's logprobs detached; every position
    carries s's value and its own logprob's gradient, s_t = sg(s)·p_θ(x_t)/sg(p_θ(x_t));
    loss = −Σ_t min(s_t·A_t, clip(s_t, low, high)·A_t). Clipping the sequence ratio keeps or drops whole
    sequences where PPO clips single tokens.
    """
    low, high = config["clip_low_threshold"], config["clip_high_threshold"]
    in_ratio_B_T = (inputs["sequence_ratio_mask"] != 0) & mask_B_T
    token_log_ratio_B_T = (logprobs_B_T.detach() - inputs["logprobs"]) * in_ratio_B_T
    count_B = in_ratio_B_T.sum(dim=-1).clamp_min(1)
    sequence_log_ratio_B_1 = (token_log_ratio_B_T.sum(dim=-1) / count_B)[:, None]
    ratio_B_T = torch.exp(sequence_log_ratio_B_1 + logprobs_B_T - logprobs_B_T.detach()) * mask_B_T
    advantages_B_T = inputs["advantages"] * mask_B_T
    clipped_B_T = torch.clamp(ratio_B_T, low, high)
    objective_B_T = torch.minimum(ratio_B_T * advantages_B_T, clipped_B_T * advantages_B_T)
    return LossOutput(
        elementwise_loss_B_T=-objective_B_T * mask_B_T,
        active_B_T=(advantages_B_T != 0) & mask_B_T,
        diagnostics={
            "sequence_ratio": ratio_B_T.detach(),
            "clip_fraction": _clip_fraction(ratio_B_T.detach(), low, high),
        },
    )


def _check_sequence_ratio_mask(inputs: Mapping[str, Tensor]) -> str | None:
    if not bool((inputs["sequence_ratio_mask"] != 0).any()):
        return "loss_fn_inputs['sequence_ratio_mask'] marks no position: gspo needs the tokens its sequence ratio averages over"
    return None


def dppo(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor, config: Mapping[str, float]
) -> LossOutput:
    """Divergence PPO, Binary-TV variant (Qi et al. 2026, "Rethinking the Trust Region in LLM
    Reinforcement Learning", https://arxiv.org/abs/2602.04879), with SkyRL's `dppo` config.

    The trust region is on probabilities, not ratios: with δ_t = p_θ(x_t) − q(x_t), a position whose
    advantage is positive and whose δ_t > delta_high, or whose advantage is negative and whose
    −δ_t > delta_low, is masked (m_t = 0, no gradient through the mask); loss = −Σ_t m_t · r_t · A_t with
    r_t = p_θ(x_t)/q(x_t), the log-ratio clamped to ±20 before exponentiating (as SkyRL does).
    """
    delta_low, delta_high = config["delta_low"], config["delta_high"]
    log_ratio_B_T = torch.clamp(logprobs_B_T - inputs["logprobs"], -20.0, 20.0) * mask_B_T
    ratio_B_T = torch.exp(log_ratio_B_T) * mask_B_T
    advantages_B_T = inputs["advantages"] * mask_B_T
    with torch.no_grad():
        probability_gap_B_T = torch.exp(logprobs_B_T) - torch.exp(inputs["logprobs"])
        outside_B_T = ((advantages_B_T > 0) & (probability_gap_B_T > delta_high)) | (
            (advantages_B_T < 0) & (-probability_gap_B_T > delta_low)
        )
        keep_B_T = (~outside_B_T).float() * mask_B_T
    active_B_T = (advantages_B_T != 0) & mask_B_T
    return LossOutput(
        elementwise_loss_B_T=-ratio_B_T * advantages_B_T * keep_B_T,
        active_B_T=active_B_T,
        diagnostics={"ratio": ratio_B_T.detach(), "clip_fraction": outside_B_T.float()},
    )


def stable_reinforce(
    logprobs_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor, config: Mapping[str, float]
) -> LossOutput:
    """REINFORCE on sampled tokens, corrected by what the sampler recorded (Tinker's `stable_reinforce`,
    alpha: https://tinker-docs.thinkingmachines.ai/tinker/losses/stable-reinforce/).

    Tinker documents the contract (sample with `record_stability_info=True`, name the sampled sequences
    in the datum's provenance spans, non-zero advantages only on sampled tokens) but not the objective.
    Ours is REINFORCE with a truncated, detached importance weight (TIS, Yao et al. 2025,
    https://fengyao.notion.site/off-policy-rl) computed against the engine's own record of the sampler:

        loss = −Σ_{t∈S} sg(min(p_θ(x_t)/q(x_t), C)) · A_t · log p_θ(x_t)

    with S the positions whose target is a recorded sampled token, q(x_t) the logprob the sampler
    recorded for it (never a value that went through client code), C = `clip_high_threshold`. The weight
    is capped and never differentiated, so stale or numerically different samples cannot blow up the
    update; on-policy (ratio 1) it is plain REINFORCE.
    """
    cap = config["clip_high_threshold"]
    sampled_B_T = (inputs["sampled"] != 0) & mask_B_T
    log_ratio_B_T = (logprobs_B_T.detach() - inputs["recorded_logprobs"]) * sampled_B_T
    ratio_B_T = torch.exp(torch.clamp(log_ratio_B_T, max=20.0)) * sampled_B_T
    weight_B_T = torch.clamp(ratio_B_T, max=cap)
    advantages_B_T = inputs["advantages"] * sampled_B_T
    return LossOutput(
        elementwise_loss_B_T=-weight_B_T * advantages_B_T * logprobs_B_T * sampled_B_T,
        active_B_T=(advantages_B_T != 0) & sampled_B_T,
        diagnostics={"ratio": ratio_B_T, "truncated_fraction": (ratio_B_T > cap).float()},
    )


def ppo_critic(
    values_B_T: Tensor, inputs: Mapping[str, Tensor], mask_B_T: Tensor, config: Mapping[str, float]
) -> LossOutput:
    """Clipped value loss for the critic (as in PPO's reference implementation, and SkyRL's `ppo_critic`).

    loss = Σ_t w_t · ½ · max((V_t − R_t)², (clip(V_t, V_old,t − c, V_old,t + c) − R_t)²), with V_old the
    `values` input (from when the data was collected), R the `returns`, c = `value_clip`.
    """
    clip = config["value_clip"]
    weights_B_T = inputs["weights"] * mask_B_T
    old_values_B_T, returns_B_T = inputs["values"], inputs["returns"]
    # V itself inside the band, not V_old + (V − V_old), which can miss V by a rounding: the clipped
    # term then ties the unclipped one exactly, and a token counts as clipped only where it was
    clipped_values_B_T = torch.clamp(values_B_T, old_values_B_T - clip, old_values_B_T + clip)
    unclipped_sq_B_T = (values_B_T - returns_B_T) ** 2
    clipped_sq_B_T = (clipped_values_B_T - returns_B_T) ** 2
    residual_B_T = (returns_B_T - values_B_T).detach()
    return LossOutput(
        elementwise_loss_B_T=0.5 * torch.maximum(unclipped_sq_B_T, clipped_sq_B_T) * weights_B_T,
        active_B_T=(weights_B_T != 0),
        diagnostics={
            "value_clip_fraction": (clipped_sq_B_T > unclipped_sq_B_T).float(),
            "_returns": returns_B_T,
            "_returns_sq": returns_B_T**2,
            "_residual": residual_B_T,
            "_residual_sq": residual_B_T**2,
        },
    )


def _explained_variance(means: dict[str, float]) -> dict[str, float]:
    """1 − Var(R − V) / Var(R) over the loss positions, from the averaged moments."""
    var_returns = means.pop("_returns_sq") - means.pop("_returns") ** 2
    var_residual = means.pop("_residual_sq") - means.pop("_residual") ** 2
    if var_returns > 1e-12:
        means["explained_variance"] = 1.0 - var_residual / var_returns
    return means


_POLICY_INPUTS = ("target_tokens", "logprobs", "advantages")

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(
        cross_entropy,
        "logprobs",
        ("target_tokens",),
        optional_inputs={"weights": 1.0},
        soft_targets=True,
        gradient_scale="weights",
    ),
    "importance_sampling": LossSpec(
        importance_sampling, "logprobs", _POLICY_INPUTS, reports_entropy=True, gradient_scale="advantages"
    ),
    "ppo": LossSpec(
        ppo,
        "logprobs",
        _POLICY_INPUTS,
        config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        reports_entropy=True,
        gradient_scale="advantages",
    ),
    "cispo": LossSpec(
        cispo,
        "logprobs",
        _POLICY_INPUTS,
        config_defaults={"clip_low_threshold": 0.0, "clip_high_threshold": 4.0},
        reports_entropy=True,
        gradient_scale="advantages",
    ),
    "dro": LossSpec(dro, "logprobs", _POLICY_INPUTS, config_defaults={"beta": 0.05}, reports_entropy=True),
    "gspo": LossSpec(
        gspo,
        "logprobs",
        (*_POLICY_INPUTS, "sequence_ratio_mask"),
        config_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2},
        reports_entropy=True,
        check_datum=_check_sequence_ratio_mask,
        gradient_scale="advantages",
    ),
    "dppo": LossSpec(
        dppo,
        "logprobs",
        _POLICY_INPUTS,
        config_defaults={"delta_low": 0.2, "delta_high": 0.2},
        reports_entropy=True,
        gradient_scale="advantages",
    ),
    "stable_reinforce": LossSpec(
        stable_reinforce,
        "logprobs",
        ("target_tokens", "advantages"),
        optional_inputs={"logprobs": None},
        config_defaults={"clip_high_threshold": 2.0},
        reports_entropy=True,
        uses_sampling_records=True,
        gradient_scale="advantages",
    ),
    "ppo_critic": LossSpec(
        ppo_critic,
        "values",
        (),
        optional_inputs={"weights": 1.0},
        training_inputs=("values", "returns"),
        config_defaults={"value_clip": 0.2},
        summarize=_explained_variance,
        gradient_scale="weights",
    ),
}


def resolve_loss(name: str, config: Mapping[str, float] | None) -> tuple[LossSpec, dict[str, float]]:
    """Look up a loss by name and complete its config with Tinker's defaults.

    Raises ValueError for an unknown loss, an unknown config key, or a value out of range.
    """
    if not isinstance(name, str) or name not in LOSSES:
        raise ValueError(
            f"unknown loss {name!r}; choose one of {sorted(LOSSES)} or use forward_backward_custom"
        )
    spec = LOSSES[name]
    if config is not None and not isinstance(config, Mapping):
        raise ValueError(f"loss_fn_config must be a dict of {{name: number}} or None, got {config!r}")
    resolved = dict(spec.config_defaults)
    for key, value in dict(config or {}).items():
        if key not in spec.config_defaults:
            known = sorted(spec.config_defaults) or "none"
            raise ValueError(f"unknown loss_fn_config key {key!r} for {name!r}; it takes: {known}")
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or abs(value) > FLOAT32_MAX
        ):
            raise ValueError(
                f"loss_fn_config[{key!r}] must be a finite number that fits in float32 (|x| <= {FLOAT32_MAX:.3g}: "
                f"the losses compute in float32), got {value!r}"
            )
        resolved[key] = float(value)
    _check_config_ranges(name, resolved)
    return spec, resolved


def _check_config_ranges(name: str, resolved: Mapping[str, float]) -> None:
    """The ranges where the config keys of loss `name` mean what their formulas say: PPO's clip interval
    around a ratio of 1, a probability difference, a non-negative DRO penalty, a positive value clip."""
    if "clip_low_threshold" in resolved:
        low, high = resolved["clip_low_threshold"], resolved["clip_high_threshold"]
        if not 0.0 <= low <= 1.0 <= high:
            raise ValueError(
                f"{name} needs 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low} and {high}"
            )
    elif "clip_high_threshold" in resolved and resolved["clip_high_threshold"] < 1.0:
        raise ValueError(f"{name} needs clip_high_threshold >= 1, got {resolved['clip_high_threshold']}")
    for key in ("delta_low", "delta_high"):
        if key in resolved and not 0.0 < resolved[key] <= 1.0:
            raise ValueError(f"{name} {key} is a probability difference in (0, 1], got {resolved[key]}")
    if "beta" in resolved and resolved["beta"] < 0:
        raise ValueError(f"dro beta must be >= 0, got {resolved['beta']}")
    if "value_clip" in resolved and resolved["value_clip"] <= 0:
        raise ValueError(f"ppo_critic value_clip must be > 0, got {resolved['value_clip']}")
