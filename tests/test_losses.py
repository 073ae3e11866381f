"""Each loss against values worked out by hand on a few positions, including its gradient."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.losses import (
    LOSSES,
    cispo,
    cross_entropy,
    dppo,
    dro,
    gspo,
    importance_sampling,
    ppo,
    ppo_critic,
    resolve_loss,
    stable_reinforce,
)


def _row(*values: float, requires_grad: bool = False) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float32, requires_grad=requires_grad)


def _mask(n: int) -> torch.Tensor:
    return torch.ones((1, n), dtype=torch.bool)


def _grad(loss_sum: torch.Tensor, leaf: torch.Tensor) -> list[float]:
    (grad,) = torch.autograd.grad(loss_sum, leaf)
    return grad[0].tolist()


def test_cross_entropy_is_weighted_negative_logprob_sum() -> None:
    logprobs = _row(-1.0, -2.0, -3.0, requires_grad=True)
    out = cross_entropy(logprobs, {"weights": _row(0.0, 1.0, 0.5)}, _mask(3), {})
    # elementwise: -(-1)*0, -(-2)*1, -(-3)*0.5  ->  0, 2, 1.5
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([0.0, 2.0, 1.5])
    assert out.elementwise_loss_B_T.sum().item() == pytest.approx(3.5)
    assert out.active_B_T[0].tolist() == [False, True, True]
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == pytest.approx([0.0, -1.0, -0.5])


def test_importance_sampling_uses_the_ratio_times_advantage() -> None:
    logprobs = _row(-1.0, -1.0, -1.0, requires_grad=True)
    inputs = {"logprobs": _row(-1.2, -0.8, -1.0), "advantages": _row(1.0, -1.0, 0.0)}
    out = importance_sampling(logprobs, inputs, _mask(3), {})
    r1, r2 = math.exp(0.2), math.exp(-0.2)
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([-r1, r2, 0.0], rel=1e-6)
    # d/dlp of -r*A = -A*r
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == pytest.approx([-r1, r2, 0.0], rel=1e-6)
    assert out.active_B_T[0].tolist() == [True, True, False]


def test_ppo_clips_on_both_sides() -> None:
    # ratios 1.5, 0.5, 1.5, 0.5, 1.0 against advantages +1, +1, -1, -1, +1
    ratios = [1.5, 0.5, 1.5, 0.5, 1.0]
    sampling = _row(*[-1.0] * 5)
    logprobs = (sampling + torch.log(torch.tensor([ratios]))).detach().requires_grad_(True)
    inputs = {"logprobs": sampling, "advantages": _row(1.0, 1.0, -1.0, -1.0, 1.0)}
    out = ppo(logprobs, inputs, _mask(5), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    # min(r*A, clip(r)*A): 1.2 (clipped), 0.5, -1.5, -0.8 (clipped), 1.0; loss is its negative
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([-1.2, -0.5, 1.5, 0.8, -1.0], rel=1e-6)
    # gradient -A*r where the unclipped term is taken, 0 where the clipped one is
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == pytest.approx(
        [0.0, -0.5, 1.5, 0.0, -1.0], rel=1e-6, abs=1e-7
    )
    assert out.diagnostics["clip_fraction"][0].tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]


def test_cispo_keeps_a_detached_clipped_weight() -> None:
    ratios = [1.5, 0.5, 5.0]
    logprobs_values = [-1.0, -2.0, -0.5]
    logprobs = _row(*logprobs_values, requires_grad=True)
    sampling = torch.tensor([[lp - math.log(r) for lp, r in zip(logprobs_values, ratios, strict=True)]])
    inputs = {"logprobs": sampling, "advantages": _row(1.0, 1.0, -1.0)}
    out = cispo(logprobs, inputs, _mask(3), {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0})
    # weights clip(r) = 1.5, 0.5, 4.0; loss = -w*A*lp = 1.5, 1.0, -2.0
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([1.5, 1.0, -2.0], rel=1e-5)
    # gradient -w*A, even where the ratio is clipped
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == pytest.approx([-1.5, -0.5, 4.0], rel=1e-5)


def test_dro_adds_a_quadratic_penalty_everywhere() -> None:
    logprobs = _row(-1.0, -2.0, requires_grad=True)
    inputs = {"logprobs": _row(-1.5, -2.5), "advantages": _row(1.0, 0.0)}
    out = dro(logprobs, inputs, _mask(2), {"beta": 0.1})
    # -(lp*A - 0.5*beta*(lp-q)^2): -(-1 - 0.05*0.25) = 1.0125 ; -(0 - 0.05*0.25) = 0.0125
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([1.0125, 0.0125], rel=1e-6)
    # d/dlp = -(A - beta*(lp-q)) = -(1 - 0.05) = -0.95 ; -(0 - 0.05) = 0.05
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == pytest.approx([-0.95, 0.05], rel=1e-6)


def test_ppo_critic_clipped_and_unclipped() -> None:
    values = _row(1.0, 0.0, 1.1, requires_grad=True)
    inputs = {"values": _row(0.5, 0.5, 1.0), "returns": _row(2.0, 0.0, 0.0), "weights": _row(1.0, 1.0, 1.0)}
    out = ppo_critic(values, inputs, _mask(3), {"value_clip": 0.2})
    # pos 0: V-Vold = 0.5 -> clipped V 0.7: max((1-2)^2, (0.7-2)^2) = 1.69 -> 0.845 (clipped term wins)
    # pos 1: clipped V 0.3: max(0, 0.09) -> 0.045 (clipped term wins)
    # pos 2: within the clip: (1.1-0)^2 = 1.21 -> 0.605
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([0.845, 0.045, 0.605], rel=1e-5)
    assert out.diagnostics["value_clip_fraction"][0].tolist() == [1.0, 1.0, 0.0]
    # the clipped branch has no gradient wrt V; the unclipped one has (V - R)
    assert _grad(out.elementwise_loss_B_T.sum(), values) == pytest.approx([0.0, 0.0, 1.1], rel=1e-5, abs=1e-7)

    unclipped = ppo_critic(values, inputs, _mask(3), {"value_clip": 100.0})
    assert unclipped.elementwise_loss_B_T[0].tolist() == pytest.approx([0.5, 0.0, 0.605], rel=1e-5)


def test_ppo_critic_counts_a_value_inside_the_band_as_unclipped() -> None:
    """V_old + (V − V_old) rounds away from V for these float32 values (enough to make its squared error
    the larger); a value inside the clip band must tie its unclipped term exactly and never count as
    clipped."""
    values = _row(0.1, -0.03, 0.01)
    old = _row(0.02, -0.08, -0.14)
    returns = _row(0.1, 0.7, 0.0)
    # the rounding the loss must not see: the old form's clipped term beats the unclipped one
    assert ((old + (values - old) - returns) ** 2 > (values - returns) ** 2).all()
    inputs = {"values": old, "returns": returns, "weights": _row(1.0, 1.0, 1.0)}
    out = ppo_critic(values, inputs, _mask(3), {"value_clip": 0.2})
    assert out.diagnostics["value_clip_fraction"][0].tolist() == [0.0, 0.0, 0.0]
    assert out.elementwise_loss_B_T[0].tolist() == (0.5 * (values - inputs["returns"]) ** 2)[0].tolist()


def test_ppo_critic_weights_scale_the_loss() -> None:
    values = _row(1.0, 3.0)
    inputs = {"values": values.clone(), "returns": _row(0.0, 0.0), "weights": _row(2.0, 0.0)}
    out = ppo_critic(values, inputs, _mask(2), {"value_clip": 0.2})
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([1.0, 0.0])
    assert out.active_B_T[0].tolist() == [True, False]


@pytest.mark.parametrize("name", ["importance_sampling", "ppo", "cispo", "dro"])
def test_zero_advantage_gives_zero_gradient(name: str) -> None:
    spec, config = resolve_loss(name, None)
    logprobs = _row(-1.0, -0.3, -2.0, requires_grad=True)
    inputs = {
        "logprobs": logprobs.detach().clone(),
        "advantages": _row(0.0, 0.0, 0.0),
        "target_tokens": torch.zeros((1, 3)),
    }
    out = spec.fn(logprobs, inputs, _mask(3), config)
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("name", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro"])
def test_padding_positions_carry_no_loss_or_gradient(name: str) -> None:
    spec, config = resolve_loss(name, None)
    logprobs = _row(-1.0, -0.5, -3.0, requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    inputs = {
        "logprobs": _row(-1.5, -0.1, 0.0),
        "advantages": _row(1.0, -2.0, 0.0),
        "weights": _row(1.0, 1.0, 0.0),
    }
    out = spec.fn(logprobs, inputs, mask, config)
    assert out.elementwise_loss_B_T[0, 2].item() == 0.0
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs)[2] == 0.0
    assert not out.active_B_T[0, 2]


def test_tinker_default_configs() -> None:
    assert resolve_loss("ppo", None)[1] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss("cispo", None)[1] == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert resolve_loss("ppo", {"clip_high_threshold": 1.3})[1]["clip_high_threshold"] == 1.3
    assert resolve_loss("cross_entropy", {})[1] == {}
    assert resolve_loss("gspo", None)[1] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert resolve_loss("dppo", None)[1] == {"delta_low": 0.2, "delta_high": 0.2}
    assert resolve_loss("stable_reinforce", None)[1] == {"clip_high_threshold": 2.0}
    assert set(LOSSES) == {
        "cross_entropy",
        "importance_sampling",
        "ppo",
        "cispo",
        "dro",
        "gspo",
        "dppo",
        "stable_reinforce",
        "ppo_critic",
    }


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("nope", None, "unknown loss 'nope'"),
        ("cross_entropy", {"clip_low_threshold": 0.8}, "unknown loss_fn_config key 'clip_low_threshold'"),
        ("ppo", {"epsilon": 0.2}, "unknown loss_fn_config key 'epsilon'"),
        ("ppo", {"clip_low_threshold": 1.5}, "clip_low_threshold <= 1"),
        ("ppo", {"clip_high_threshold": float("nan")}, "finite number"),
        ("dro", {"beta": -1.0}, "beta must be >= 0"),
        ("ppo_critic", {"value_clip": 0.0}, "value_clip must be > 0"),
        ("dppo", {"delta_low": 0.0}, "delta_low is a probability difference in (0, 1]"),
        ("dppo", {"clip_low_threshold": 0.8}, "unknown loss_fn_config key 'clip_low_threshold'"),
        ("stable_reinforce", {"clip_high_threshold": 0.5}, "clip_high_threshold >= 1"),
        ("gspo", {"clip_low_threshold": 1.1}, "clip_low_threshold <= 1"),
    ],
)
def test_bad_loss_names_and_configs_raise(name: str, config: dict | None, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resolve_loss(name, config)


def test_gspo_uses_one_sequence_ratio_per_datum_with_each_tokens_own_gradient() -> None:
    # learner -1, -1, -1, -1; sampler -1.3, -0.9, -1.0, -2.0; the mask leaves out the last position.
    # sequence log-ratio = mean(0.3, -0.1, 0.0) = 0.2/3, so s = exp(0.0667) ~ 1.069 on every position.
    logprobs = _row(-1.0, -1.0, -1.0, -1.0, requires_grad=True)
    inputs = {
        "logprobs": _row(-1.3, -0.9, -1.0, -2.0),
        "advantages": _row(1.0, -1.0, 2.0, 0.0),
        "sequence_ratio_mask": _row(1.0, 1.0, 1.0, 0.0),
    }
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    out = gspo(logprobs, inputs, _mask(4), config)
    s = math.exp(0.2 / 3)
    # min(s*A, clip(s)*A) = s*A for s inside [0.8, 1.2]; the loss is its negative
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([-s, s, -2 * s, 0.0], rel=1e-6)
    # value s, gradient of the token's own logprob: d(s_t)/d(lp_t) = s_t  ->  d loss/d lp_t = -A_t * s
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == pytest.approx([-s, s, -2 * s, 0.0], rel=1e-6)
    assert out.active_B_T[0].tolist() == [True, True, True, False]


def test_gspo_clips_the_whole_sequence() -> None:
    # sequence log-ratio 0.5 on both positions: s = 1.6487 > 1.2, so positive advantages are clipped
    # (zero gradient) and negative ones are not (the unclipped term is the minimum).
    logprobs = _row(-1.0, -1.0, requires_grad=True)
    inputs = {
        "logprobs": _row(-1.5, -1.5),
        "advantages": _row(1.0, -1.0),
        "sequence_ratio_mask": _row(1.0, 1.0),
    }
    out = gspo(logprobs, inputs, _mask(2), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2})
    s = math.exp(0.5)
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([-1.2, s], rel=1e-6)
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == pytest.approx([0.0, s], rel=1e-6)


def test_dppo_masks_by_probability_difference_not_ratio() -> None:
    # sampler probability q = 0.5 everywhere; learner p = 0.8, 0.6, 0.2, 0.45 (delta 0.2 each side).
    # pos 0: A>0, p-q = 0.3 > 0.2 -> masked.  pos 1: A>0, 0.1 -> kept.
    # pos 2: A<0, q-p = 0.3 > 0.2 -> masked.  pos 3: A<0, 0.05 -> kept.
    p = [0.8, 0.6, 0.2, 0.45]
    logprobs = torch.log(torch.tensor([p])).requires_grad_(True)
    inputs = {"logprobs": torch.log(torch.full((1, 4), 0.5)), "advantages": _row(1.0, 2.0, -1.0, -1.0)}
    out = dppo(logprobs, inputs, _mask(4), {"delta_low": 0.2, "delta_high": 0.2})
    ratios = [x / 0.5 for x in p]
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx(
        [0.0, -2 * ratios[1], 0.0, ratios[3]], rel=1e-6
    )
    # d(-r*A)/d lp = -r*A where kept, 0 where masked
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == pytest.approx(
        [0.0, -2 * ratios[1], 0.0, ratios[3]], rel=1e-6
    )
    assert out.diagnostics["clip_fraction"][0].tolist() == [1.0, 0.0, 1.0, 0.0]


def test_stable_reinforce_is_reinforce_with_a_capped_detached_weight() -> None:
    # learner -1 everywhere; recorded sampler logprobs -1 (ratio 1), -2 (ratio e, capped at 2),
    # -0.5 (ratio e^-0.5); the last position is a prompt token (not sampled): no loss there.
    logprobs = _row(-1.0, -1.0, -1.0, -1.0, requires_grad=True)
    inputs = {
        "recorded_logprobs": _row(-1.0, -2.0, -0.5, 0.0),
        "sampled": _row(1.0, 1.0, 1.0, 0.0),
        "advantages": _row(1.0, 1.0, -2.0, 0.0),
    }
    out = stable_reinforce(logprobs, inputs, _mask(4), {"clip_high_threshold": 2.0})
    w = [1.0, 2.0, math.exp(-0.5), 0.0]
    # loss_t = -w_t * A_t * lp_t with lp = -1
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([w[0], w[1], -2 * w[2], 0.0], rel=1e-6)
    # the weight is detached: d loss/d lp_t = -w_t * A_t
    assert _grad(out.elementwise_loss_B_T.sum(), logprobs) == pytest.approx(
        [-w[0], -w[1], 2 * w[2], 0.0], rel=1e-6
    )
    assert out.diagnostics["truncated_fraction"][0].tolist() == [0.0, 1.0, 0.0, 0.0]
    assert out.active_B_T[0].tolist() == [True, True, True, False]


@pytest.mark.parametrize(
    "name", [name for name, spec in LOSSES.items() if spec.gradient_scale and spec.head == "logprobs"]
)
def test_a_position_whose_gradient_scale_is_zero_gets_no_gradient(name: str) -> None:
    """Every logprob loss with a `gradient_scale` is position-wise in it: a position whose scale is 0
    gets no gradient whatever the others' are, so the engine computes its logprob without autograd
    (`call_plan.trained_positions`)."""
    spec, config = resolve_loss(name, None)
    torch.manual_seed(0)
    logprobs = (-3 * torch.rand(1, 6)).requires_grad_(True)
    scale = _row(0.0, 1.5, 0.0, -0.7, 2.0, 0.0)
    inputs = {
        "target_tokens": torch.zeros((1, 6)),
        "logprobs": logprobs.detach() - 0.05 * torch.rand(1, 6),  # ratios inside every clip
        "recorded_logprobs": logprobs.detach() - 0.05 * torch.rand(1, 6),
        "sampled": torch.ones(1, 6),
        "sequence_ratio_mask": torch.ones(1, 6),
        "advantages": torch.randn(1, 6),
        "weights": torch.rand(1, 6) + 0.5,
    }
    inputs[spec.gradient_scale] = scale
    out = spec.fn(logprobs, inputs, _mask(6), config)
    gradient = _grad(out.elementwise_loss_B_T.sum(), logprobs)
    assert [gradient[i] for i in (0, 2, 5)] == [0.0, 0.0, 0.0]
    assert all(gradient[i] != 0.0 for i in (1, 3, 4))
