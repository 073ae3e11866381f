"""RL health signals (`workbench.loops.health`) against hand-computed values, the cookbook's own
sampler-vs-trainer estimators, and `Session.record_rollouts` end to end on the tiny model."""

from __future__ import annotations

import dataclasses
import math

import pytest
import tinker
import torch
from tinker_cookbook.rl.metrics import compute_kl_sample_train

import workbench as wb
from workbench.loops.health import rollout_health
from workbench.loops.rollout_groups import RolloutGroup, attach_trainer_logprobs, rollout_data
from workbench.notebook.rollout_log import RolloutLog


def _sequence(n: int, stop: str = "stop") -> wb.SampledSequence:
    return wb.SampledSequence(tokens=list(range(10, 10 + n)), logprobs=[-0.5] * n, stop_reason=stop)


def _groups() -> list[RolloutGroup]:
    """Group A: rewards 1 0 0 1, lengths 2 3 1 2 (the 3 truncated); group B: all 0, lengths 4 1 1 1 (the
    4 truncated). Every sampled logprob is −0.5 and every reference logprob −1."""
    a = RolloutGroup.of(
        [1, 2, 3],
        [_sequence(2), _sequence(3, "length"), _sequence(1), _sequence(2)],
        [1.0, 0.0, 0.0, 1.0],
        reference_logprobs=[[-1.0] * 2, [-1.0] * 3, [-1.0], [-1.0] * 2],
    )
    b = RolloutGroup.of(
        [4, 5],
        [_sequence(4, "length"), _sequence(1), _sequence(1), _sequence(1)],
        [0.0, 0.0, 0.0, 0.0],
        reference_logprobs=[[-1.0] * 4, [-1.0], [-1.0], [-1.0]],
    )
    return [a, b]


def test_reward_length_and_entropy_signals_match_hand_computed_values() -> None:
    metrics = rollout_health(_groups())
    # rewards 1 0 0 1 0 0 0 0: mean 0.25, variance (2·0.75² + 6·0.25²)/8 = 0.1875
    assert metrics["reward:mean"] == pytest.approx(0.25)
    assert metrics["reward:std"] == pytest.approx(math.sqrt(0.1875))
    assert metrics["group_reward_std:mean"] == pytest.approx((0.5 + 0.0) / 2)
    assert metrics["zero_variance_groups:fraction"] == pytest.approx(0.5)
    assert metrics["pass_rate:mean"] == pytest.approx(2 / 8)
    assert metrics["group_pass_rate:mean"] == pytest.approx(1 / 2)
    assert metrics["reply_length:mean"] == pytest.approx(15 / 8)
    assert metrics["reply_length:max"] == 4.0
    assert metrics["truncated:fraction"] == pytest.approx(2 / 8)
    assert metrics["sampler_entropy:mean"] == pytest.approx(0.5)
    assert "kl_sample_train_v1:mean" not in metrics  # no trainer logprobs yet


def test_a_pass_threshold_counts_partial_rewards() -> None:
    group = RolloutGroup.of([1], [_sequence(1)] * 4, [0.2, 0.6, 0.7, 1.0])
    assert rollout_health([group], pass_threshold=0.5)["pass_rate:mean"] == pytest.approx(0.75)
    assert rollout_health([group])["pass_rate:mean"] == pytest.approx(0.25)


def test_kl_to_the_reference_k1_and_k3() -> None:
    metrics = rollout_health(_groups())
    # log q − log r = −0.5 − (−1) = 0.5 on every token; k3 = (e^{−0.5} − 1) + 0.5
    assert metrics["kl_policy_reference:mean"] == pytest.approx(0.5)
    assert metrics["kl_policy_reference_k3:mean"] == pytest.approx(math.exp(-0.5) - 1 + 0.5)
    no_reference = [dataclasses.replace(g, reference_logprobs=None) for g in _groups()]
    assert "kl_policy_reference:mean" not in rollout_health(no_reference)


def test_sampler_trainer_mismatch_by_hand_and_as_the_cookbook_computes_it() -> None:
    a, b = _groups()
    # group B is all-equal: advantages 0, nothing trained; A's four replies are trained
    assert a.trained == [True] * 4 and b.trained == [False] * 4
    trainer = [[-0.4, -0.7], [-0.5] * 3, [-0.3], [-0.5] * 2]
    groups = [
        dataclasses.replace(a, trainer_logprobs=trainer),
        dataclasses.replace(b, trainer_logprobs=[None] * 4),
    ]
    metrics = rollout_health(groups)
    # d = q − p: −0.1 0.2 | 0 0 0 | −0.2 | 0 0  → mean −0.1/8, ½·mean d² = ½·0.09/8
    assert metrics["kl_sample_train_v1:mean"] == pytest.approx(-0.1 / 8)
    assert metrics["kl_sample_train_v2:mean"] == pytest.approx(0.5 * 0.09 / 8)

    # the cookbook's estimator on the same tokens (its datums carry the sampler logprobs and a mask)
    cookbook_data, trainer_D = [], []
    for sequence, p in zip(a.sequences, trainer, strict=True):
        n = len(sequence.tokens)
        cookbook_data.append(
            tinker.Datum(
                model_input=tinker.ModelInput.from_ints([1] * n),
                loss_fn_inputs={
                    "logprobs": tinker.TensorData.from_torch(torch.tensor(sequence.logprobs)),
                    "mask": tinker.TensorData.from_torch(torch.ones(n)),
                },
            )
        )
        trainer_D.append(torch.tensor(p))
    cookbook = compute_kl_sample_train(cookbook_data, trainer_D)
    assert metrics["kl_sample_train_v1:mean"] == pytest.approx(cookbook["optim/kl_sample_train_v1"], abs=1e-7)
    assert metrics["kl_sample_train_v2:mean"] == pytest.approx(cookbook["optim/kl_sample_train_v2"], abs=1e-7)


def test_bad_groups_are_refused() -> None:
    with pytest.raises(ValueError, match="rewards has 1 values for 2"):
        RolloutGroup.of([1], [_sequence(1)] * 2, [1.0])
    with pytest.raises(ValueError, match="NaN"):
        RolloutGroup.of([1], [_sequence(1)] * 2, [1.0, math.nan])
    with pytest.raises(ValueError, match=r"reference_logprobs\[0\] has 1 values for 2"):
        RolloutGroup.of([1], [_sequence(2)], [1.0], reference_logprobs=[[-1.0]])
    with pytest.raises(ValueError, match="at least one"):
        rollout_health([])


def test_record_rollouts_on_a_real_step(tiny: wb.Session) -> None:
    """Sample, train on `rollout_data`, record: the row carries the signals at the sampling step, the
    trainer's logprobs reproduce the sampler's (mismatch ~0), and the file reads back the same groups."""
    tok = tiny.tokenizer
    prompt = wb.ModelInput.from_ints(tok.encode("Hello there"))
    sampler = tiny.policy.save_weights_and_get_sampling_client()
    response = sampler.sample(prompt, 4, wb.SamplingParams(max_tokens=6, temperature=1.0, seed=3)).result()
    group = RolloutGroup.of(prompt, response, [1.0, 0.0, 0.0, 1.0])
    assert group.weights_version == response.weights_version
    data = rollout_data([group])
    assert len(data) == 4
    out = tiny.policy.forward_backward(data, "importance_sampling").result()
    tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result()
    metrics = tiny.record_rollouts([group], trained=out)
    assert abs(metrics["kl_sample_train_v1:mean"]) < 1e-3 and metrics["kl_sample_train_v2:mean"] < 1e-4
    row = [r for r in tiny.history if r["op"] == "rollouts"][-1]
    assert row["step"] == 1 and row["reward:mean"] == pytest.approx(0.5)  # outside a run: the current step
    # the loss's row has the mismatch already: one line for it in a plot, not two
    assert "kl_sample_train_v1:mean" not in row and "kl_sample_train_v1:mean" in out.metrics
    assert {r["op"] for r in tiny.history if "kl_sample_train_v1:mean" in r} == {"forward_backward"}

    recorded = tiny.rollouts[0][0]
    assert recorded.step == 1 and recorded.trainer_logprobs is not None
    assert [len(t or []) for t in recorded.trainer_logprobs] == [len(s.tokens) for s in response.sequences]
    assert RolloutLog.load(tiny.model_dir)[0] == tiny.rollouts[0]
    with pytest.raises(ValueError, match="gives 4 datums"):
        attach_trainer_logprobs([group], dataclasses.replace(out, loss_fn_outputs=out.loss_fn_outputs[:2]))


def test_record_rollouts_inside_a_run_uses_the_step_the_run_started_from(tiny: wb.Session) -> None:
    prompt = wb.ModelInput.from_ints(tiny.tokenizer.encode("Hi"))

    def step(sess: wb.Session, i: int) -> None:
        sampler = sess.policy.save_weights_and_get_sampling_client()
        response = sampler.sample(prompt, 2, wb.SamplingParams(max_tokens=3, seed=i)).result()
        group = RolloutGroup.of(prompt, response, [1.0, 0.0])
        out = sess.policy.forward_backward(rollout_data([group]), "importance_sampling").result()
        sess.policy.optim_step(sess.current_run.adam_params).result()
        sess.record_rollouts([group], trained=out)

    run = tiny.run(step, 2)
    assert run.wait(60) is wb.RunState.FINISHED, run.traceback
    assert [r["step"] for r in tiny.history if r["op"] == "rollouts"] == [0, 1]
    assert [batch[0].step for batch in tiny.rollouts] == [0, 1]


def test_record_rollouts_follows_the_model_that_sampled(tiny: wb.Session) -> None:
    """A loop that trains another model of the session (a tinker SDK client through `sess.serve()`, here
    the in-process service client) leaves the session's policy at step 0: the rows and the explorer go by
    that model's steps and weights, and its groups, built from bare sequences as the SDK's responses
    give them, take its weights version."""
    from workbench.notebook.panel.rollouts_tab import RolloutExplorer

    service = tiny.service_client()
    student = service.create_lora_training_client(base_model="tiny", rank=4)
    prompt = wb.ModelInput.from_ints(tiny.tokenizer.encode("Hi"))
    versions = []
    for i in range(2):
        sampler = student.save_weights_and_get_sampling_client()
        response = sampler.sample(prompt, 2, wb.SamplingParams(max_tokens=3, seed=i)).result()
        versions.append(response.weights_version)
        group = RolloutGroup.of(prompt, list(response.sequences), [1.0, 0.0])  # no weights version
        student.forward_backward(rollout_data([group]), "importance_sampling").result()
        tiny.record_rollouts(
            [group], model_id=student.model_id
        )  # before optim_step: the weights that sampled
        student.optim_step(wb.AdamParams(learning_rate=1e-3)).result()
    label = tiny.engine.model_status(student.model_id).adapter
    rows = [r for r in tiny.history if r["op"] == "rollouts"]
    assert tiny.step == 0 and [(r["step"], r["model"]) for r in rows] == [(0, label), (1, label)]
    assert [batch[0].weights_version for batch in tiny.rollouts] == versions == [0, 1]
    explorer = RolloutExplorer(tiny.rollouts, tiny.tokenizer)
    explorer.select_batch(1)
    assert "optimizer step 1</span> · weights v1 ·" in explorer.summary.value
    service.close("success")


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo", "dro"])
def test_policy_losses_report_the_sampler_trainer_mismatch(tiny: wb.Session, loss: str) -> None:
    """Sampler logprobs q = trainer logprobs p + δ_t on the trained tokens: the loss's metrics are
    mean δ and ½·mean δ² over the positions it trains on, as the cookbook estimates them."""
    tokens = [5, 9, 14, 3, 7]
    probe = wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    trainer_T = tiny.policy.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    deltas_T = [0.0, 0.1, -0.2, 0.3]
    advantages_T = [0.0, 1.0, 1.0, 1.0]  # the first position is the prompt's: no advantage, not trained
    datum = wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": [p + d for p, d in zip(trainer_T, deltas_T, strict=True)],
            "advantages": advantages_T,
        },
    )
    metrics = tiny.policy.forward_backward([datum], loss).result().metrics
    trained = deltas_T if loss == "dro" else deltas_T[1:]  # dro's penalty trains every position
    assert metrics["kl_sample_train_v1:mean"] == pytest.approx(sum(trained) / len(trained), abs=1e-5)
    assert metrics["kl_sample_train_v2:mean"] == pytest.approx(
        0.5 * sum(d * d for d in trained) / len(trained), abs=1e-5
    )
