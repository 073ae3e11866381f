"""Training semantics on the tiny model: Tinker's forward_backward / forward / optim_step contract."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import torch

import workbench as wb
from tests.datums import ce_datum, ragged_ce_batch, random_tokens, rl_datum, sft_datum


def _params(sess: wb.Session) -> dict[str, torch.Tensor]:
    return sess.engine.inspect(sess.model_id, wb.Role.POLICY).parameters


def _grads(sess: wb.Session) -> dict[str, torch.Tensor]:
    """The policy's accumulated gradient (every parameter has one after a forward_backward)."""
    gradients = sess.engine.inspect(sess.model_id, wb.Role.POLICY).gradients
    assert all(g is not None for g in gradients.values())
    return gradients  # type: ignore[return-value]


def _policy_logits(sess: wb.Session, tokens: list[int]) -> torch.Tensor:
    """The policy's logits, from the module the engine runs, with the policy's adapter active."""
    model = sess.engine.torch_model
    model.set_adapter(sess.engine.model_status(sess.model_id).adapter)
    with torch.no_grad():
        return model(input_ids=torch.tensor([tokens])).logits[0]


def _batch(tokenizer) -> list[wb.Datum]:
    return [
        sft_datum(tokenizer, "Question: What is two plus two?", " Answer: Two plus two is four."),
        sft_datum(tokenizer, "User: Hello!", " Assistant: I am well, thank you."),
        sft_datum(tokenizer, "The quick brown fox", " jumps over the lazy dog."),
        sft_datum(tokenizer, "Red, orange, yellow,", " green, blue, indigo and violet."),
    ]


def test_forward_backward_outputs_align_with_targets(tiny: wb.Session) -> None:
    data = _batch(tiny.tokenizer)
    out = tiny.policy.forward_backward(data, "cross_entropy").result()
    assert len(out.loss_fn_outputs) == len(data)
    total = 0.0
    for datum, output in zip(data, out.loss_fn_outputs, strict=True):
        n = datum.model_input.length
        logprobs = output["logprobs"].tolist()
        assert len(logprobs) == n == len(output["elementwise_loss"].tolist())
        weights = datum.loss_fn_inputs["weights"].tolist()
        assert output["elementwise_loss"].tolist() == pytest.approx(
            [-lp * w for lp, w in zip(logprobs, weights, strict=True)], abs=1e-6
        )
        total += sum(-lp * w for lp, w in zip(logprobs, weights, strict=True))
        assert all(lp <= 0 for lp in logprobs)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert out.metrics["num_tokens:sum"] == sum(
        sum(1 for w in d.loss_fn_inputs["weights"].tolist() if w) for d in data
    )
    assert "entropy:mean" not in out.metrics  # an RL diagnostic; SFT does not pay for it


def test_logprobs_match_a_plain_transformers_forward(tiny: wb.Session) -> None:
    datum = _batch(tiny.tokenizer)[0]
    out = tiny.policy.forward([datum], "cross_entropy").result()
    tokens = torch.tensor([datum.model_input.to_ints()])
    with torch.no_grad():
        logits = tiny.engine.torch_model.get_base_model()(tokens).logits[0]
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
    expected = torch.log_softmax(logits, -1)[torch.arange(len(targets)), targets]
    assert out.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(expected.tolist(), abs=1e-5)


def test_forward_changes_nothing(tiny: wb.Session) -> None:
    data = _batch(tiny.tokenizer)
    before = tiny.state_digest()
    first = tiny.policy.forward(data, "cross_entropy").result()
    second = tiny.policy.forward(data, "cross_entropy").result()
    assert tiny.state_digest() == before
    assert first.metrics == second.metrics
    assert tiny.policy.optim_step().result().applied is False


def test_training_lowers_the_loss_and_bumps_versions(tiny: wb.Session) -> None:
    data = _batch(tiny.tokenizer)
    losses = []
    for _ in range(6):
        losses.append(tiny.policy.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        response = tiny.policy.optim_step(wb.AdamParams(learning_rate=3e-2)).result()
        assert response.applied
    assert losses[-1] < 0.7 * losses[0]
    assert tiny.policy.step == 6 and tiny.policy.weights_version == 6


def test_only_lora_parameters_change(tiny: wb.Session) -> None:
    base_before = {
        name: t.clone()
        for name, t in tiny.engine.torch_model.get_base_model().state_dict().items()
        if "lora_" not in name
    }
    adapter_before = _params(tiny)
    tiny.policy.forward_backward(_batch(tiny.tokenizer), "cross_entropy").result()
    tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
    base_after = {
        name: t
        for name, t in tiny.engine.torch_model.get_base_model().state_dict().items()
        if "lora_" not in name
    }
    assert base_before.keys() == base_after.keys()
    for name, tensor in base_before.items():
        assert torch.equal(tensor, base_after[name]), f"base weight {name} changed"
    changed = [name for name, t in _params(tiny).items() if not torch.equal(t, adapter_before[name])]
    assert changed, "no adapter parameter changed"
    assert all("lora_" in name for name in changed)
    trainable = [name for name, p in tiny.engine.torch_model.named_parameters() if p.requires_grad]
    assert all("lora_" in name for name in trainable)


def test_gradient_accumulation_equals_one_big_batch() -> None:
    """One batch, two halves or eight single datums: the same accumulated gradient, and the same weights
    after two optimizer steps, up to float rounding.

    Summing in another order changes the last bits of the gradient, and Adam divides each update by the
    gradient's own size, so a parameter whose gradient is small moves by a relatively larger amount: with
    another seed an element differed by 1.6e-6 (1.4e-4 relative) after two steps of lr 1e-2. The weights
    are therefore compared to 1e-5, a thousandth of a step, and the gradients, which the lesson is about,
    as the micro-batch test compares them. Tensors are matched in parameter order: on an engine that
    holds several models (tests/promises/test_invariants_two_ranks.py) each adapter has its own name."""
    data = ragged_ce_batch(seed=1, count=8, min_len=4, max_len=40, vocab=900)
    gradients = []
    weights = []
    for split in ([data], [data[:4], data[4:]], [[d] for d in data]):
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0) as sess:
            for step in range(2):
                for part in split:
                    sess.policy.forward_backward(part, "cross_entropy")
                if step == 1:
                    gradients.append(_grads(sess))
                sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
            weights.append(_params(sess))
    for other in gradients[1:]:
        for (name, gradient), theirs in zip(gradients[0].items(), other.values(), strict=True):
            torch.testing.assert_close(theirs, gradient, atol=1e-5, rtol=1e-4, msg=name)
    for other in weights[1:]:
        for (name, tensor), theirs in zip(weights[0].items(), other.values(), strict=True):
            torch.testing.assert_close(theirs, tensor, atol=1e-5, rtol=0, msg=name)


def test_microbatch_split_equals_one_pass_and_keeps_input_order() -> None:
    data = ragged_ce_batch(seed=2, count=9, min_len=3, max_len=60, vocab=900)
    outputs = []
    grads = []
    for budget in (100_000, 64):
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, max_tokens_per_microbatch=budget) as sess:
            outputs.append(sess.policy.forward_backward(data, "cross_entropy").result())
            grads.append(_grads(sess))
    whole, split = outputs
    assert whole.metrics["loss:sum"] == pytest.approx(split.metrics["loss:sum"], rel=1e-5)
    for datum, a, b in zip(data, whole.loss_fn_outputs, split.loss_fn_outputs, strict=True):
        assert len(a["logprobs"].tolist()) == datum.model_input.length
        assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4)


def _reference_adamw(
    params: dict[str, torch.Tensor],
    grads_per_step: list[dict[str, torch.Tensor]],
    settings: list[wb.AdamParams],
) -> dict[str, torch.Tensor]:
    """AdamW written out by hand (Loshchilov & Hutter 2019) with global-norm clipping, per-step settings."""
    p = {n: t.clone().double() for n, t in params.items()}
    m = {n: torch.zeros_like(t) for n, t in p.items()}
    v = {n: torch.zeros_like(t) for n, t in p.items()}
    for t, (grads, s) in enumerate(zip(grads_per_step, settings, strict=True), start=1):
        g = {n: grads[n].double() for n in p}
        norm = math.sqrt(sum(float((x**2).sum()) for x in g.values()))
        if s.grad_clip_norm > 0 and norm > s.grad_clip_norm:
            g = {n: x * (s.grad_clip_norm / (norm + 1e-6)) for n, x in g.items()}
        for n in p:
            p[n] = p[n] * (1 - s.learning_rate * s.weight_decay)
            m[n] = s.beta1 * m[n] + (1 - s.beta1) * g[n]
            v[n] = s.beta2 * v[n] + (1 - s.beta2) * g[n] ** 2
            m_hat = m[n] / (1 - s.beta1**t)
            v_hat = v[n] / (1 - s.beta2**t)
            p[n] = p[n] - s.learning_rate * m_hat / (v_hat.sqrt() + s.eps)
    return {n: x.float() for n, x in p.items()}


def test_optim_step_honours_every_adam_field_on_every_call(tiny: wb.Session) -> None:
    data = _batch(tiny.tokenizer)
    settings = [
        wb.AdamParams(
            learning_rate=1e-2, beta1=0.5, beta2=0.9, eps=1e-3, weight_decay=0.1, grad_clip_norm=0.5
        ),
        wb.AdamParams(
            learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.0, grad_clip_norm=0.0
        ),
        wb.AdamParams(
            learning_rate=5e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.5, grad_clip_norm=1e6
        ),
    ]
    start = _params(tiny)
    grads_per_step = []
    for s in settings:
        tiny.policy.forward_backward(data, "cross_entropy").result()
        grads_per_step.append(_grads(tiny))
        metrics = tiny.policy.optim_step(s).result().metrics
        assert tiny.history.rows[-1]["learning_rate"] == s.learning_rate
        expected_norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads_per_step[-1].values()))
        assert metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
    expected = _reference_adamw(start, grads_per_step, settings)
    for name, tensor in _params(tiny).items():
        torch.testing.assert_close(tensor, expected[name], atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    "change",
    [
        {"learning_rate": 2e-2},
        {"beta1": 0.5},
        {"beta2": 0.5},
        {"eps": 1e-1},
        {"weight_decay": 0.5},
        {"grad_clip_norm": 1e-3},
    ],
)
def test_each_adam_field_has_an_effect(change: dict[str, float]) -> None:
    data = ragged_ce_batch(seed=3, count=3, min_len=5, max_len=20, vocab=900)
    outcomes = []
    for params in (wb.AdamParams(learning_rate=1e-2), wb.AdamParams(**{"learning_rate": 1e-2, **change})):
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0) as sess:
            # two steps, so that the second moment and momentum (beta1, beta2) matter
            for _ in range(2):
                sess.policy.forward_backward(data, "cross_entropy").result()
                sess.policy.optim_step(params).result()
            outcomes.append(_params(sess))
    assert any(not torch.equal(outcomes[0][n], outcomes[1][n]) for n in outcomes[0])


def test_tinker_sdk_objects_are_accepted_unchanged(tiny: wb.Session) -> None:
    tinker = pytest.importorskip("tinker")
    tokens = tiny.tokenizer("The quick brown fox jumps over the lazy dog").input_ids
    n = len(tokens) - 1
    sdk_datum = tinker.Datum(
        model_input=tinker.ModelInput(
            chunks=[tinker.EncodedTextChunk(tokens=tokens[:3]), tinker.EncodedTextChunk(tokens=tokens[3:-1])]
        ),
        loss_fn_inputs={
            "target_tokens": tinker.TensorData.from_numpy(__import__("numpy").array(tokens[1:])),
            "weights": [1.0] * n,
        },
    )
    ours = ce_datum(tokens)
    sdk_out = tiny.policy.forward([sdk_datum], "cross_entropy").result()
    our_out = tiny.policy.forward([ours], "cross_entropy").result()
    dict_out = tiny.policy.forward(
        [{"model_input": tokens[:-1], "loss_fn_inputs": {"target_tokens": tokens[1:], "weights": [1.0] * n}}],
        "cross_entropy",
    ).result()
    assert sdk_out.metrics["loss:sum"] == our_out.metrics["loss:sum"] == dict_out.metrics["loss:sum"]
    tiny.policy.forward_backward([sdk_datum], "cross_entropy").result()
    response = tiny.policy.optim_step(tinker.AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)).result()
    assert response.applied and tiny.history.rows[-1]["learning_rate"] == 1e-3


def test_rl_losses_run_and_report_diagnostics(tiny: wb.Session) -> None:
    rng = random.Random(0)
    tokens = random_tokens(rng, 12, 900)
    reference = (
        tiny.policy.forward([ce_datum(tokens)], "cross_entropy")
        .result()
        .loss_fn_outputs[0]["logprobs"]
        .tolist()
    )
    data = [rl_datum(tokens, 5, [lp - 0.3 for lp in reference], 1.0), rl_datum(tokens, 5, reference, -0.5)]
    for loss in ("importance_sampling", "ppo", "cispo", "dro"):
        out = tiny.policy.forward(data, loss).result()
        assert math.isfinite(out.metrics["loss:sum"])
        assert out.metrics["num_tokens:sum"] > 0
        assert out.metrics["ratio:mean"] == pytest.approx((math.exp(0.3) + 1) / 2, rel=1e-4) or loss == "dro"
    ppo_metrics = tiny.policy.forward(data, "ppo").result().metrics
    # the first datum's ratio exp(0.3) = 1.35 is outside [0.8, 1.2]; the second's is 1
    assert ppo_metrics["clip_fraction:mean"] == pytest.approx(0.5)
    # entropy:mean is the mean next-token entropy over the positions with an advantage
    logits = _policy_logits(tiny, tokens[:-1])
    entropy = -(torch.softmax(logits, -1) * torch.log_softmax(logits, -1)).sum(-1)
    assert ppo_metrics["entropy:mean"] == pytest.approx(float(entropy[4:].mean()), rel=1e-5)


def test_gspo_and_dppo_run_on_the_engine(tiny: wb.Session) -> None:
    rng = random.Random(1)
    tokens = random_tokens(rng, 12, 900)
    reference = (
        tiny.policy.forward([ce_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    )
    datum = rl_datum(tokens, 5, [lp - 0.3 for lp in reference.tolist()], 1.0)
    completion = [float(a != 0) for a in datum.loss_fn_inputs["advantages"].tolist()]
    with_mask = wb.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={**datum.loss_fn_inputs, "sequence_ratio_mask": completion},
    )
    gspo = tiny.policy.forward([with_mask], "gspo").result().metrics
    # every completion token's sampler logprob is 0.3 below the learner's: sequence ratio e^0.3 = 1.35,
    # outside [0.8, 1.2] with a positive advantage, so every token is clipped
    assert gspo["sequence_ratio:mean"] == pytest.approx(math.exp(0.3), rel=1e-4)
    assert gspo["clip_fraction:mean"] == 1.0
    # the tiny model's probabilities are ~1/900: the probability gap is far inside delta 0.2
    dppo = tiny.policy.forward([datum], "dppo").result().metrics
    assert dppo["ratio:mean"] == pytest.approx(math.exp(0.3), rel=1e-4) and dppo["clip_fraction:mean"] == 0.0
    before = tiny.state_digest()
    with pytest.raises(ValueError, match=r"datum 0: loss_fn_inputs is missing \['sequence_ratio_mask'\]"):
        tiny.policy.forward_backward([datum], "gspo")
    no_tokens = wb.Datum(
        model_input=datum.model_input,
        loss_fn_inputs={**datum.loss_fn_inputs, "sequence_ratio_mask": [0.0] * len(completion)},
    )
    with pytest.raises(
        ValueError, match="datum 0: loss_fn_inputs\\['sequence_ratio_mask'\\] marks no position"
    ):
        tiny.policy.forward_backward([no_tokens], "gspo")
    assert tiny.state_digest() == before


def test_custom_loss_equals_the_builtin_loss() -> None:
    data = ragged_ce_batch(seed=4, count=6, min_len=4, max_len=50, vocab=900)

    def nll(batch: list[wb.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum(
            (-lp * torch.tensor(d.loss_fn_inputs["weights"].tolist())).sum()
            for d, lp in zip(batch, logprobs, strict=True)
        )
        return loss, {"custom/pieces:sum": float(len(logprobs))}

    grads = []
    for run in ("builtin", "custom-one-pass", "custom-two-pass"):
        budget = 64 if run == "custom-two-pass" else 100_000
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, max_tokens_per_microbatch=budget) as sess:
            if run == "builtin":
                out = sess.policy.forward_backward(data, "cross_entropy").result()
            else:
                out = sess.policy.forward_backward_custom(data, nll).result()
                assert out.metrics["custom/pieces:sum"] == 6
            grads.append((_grads(sess), out))
    (builtin_grads, builtin_out) = grads[0]
    for custom_grads, custom_out in grads[1:]:
        assert custom_out.metrics["loss:sum"] == pytest.approx(builtin_out.metrics["loss:sum"], rel=1e-5)
        for a, b in zip(builtin_out.loss_fn_outputs, custom_out.loss_fn_outputs, strict=True):
            assert a["logprobs"].tolist() == pytest.approx(b["logprobs"].tolist(), abs=1e-5)
        for name, grad in builtin_grads.items():
            torch.testing.assert_close(custom_grads[name], grad, atol=1e-5, rtol=1e-4)


def test_custom_loss_may_couple_datums(tiny: wb.Session) -> None:
    data = ragged_ce_batch(seed=5, count=3, min_len=5, max_len=9, vocab=900)

    def mean_of_means(
        batch: list[wb.Datum], logprobs: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        means = torch.stack([lp.mean() for lp in logprobs])
        return -(means - means.mean().detach()).pow(2).sum() - means.sum(), {}

    out = tiny.policy.forward_backward_custom(data, mean_of_means).result()
    assert math.isfinite(out.metrics["loss:sum"])
    assert tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result().applied


def _poisoned(batch: list[wb.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    return (logprobs[0] * float("nan")).sum(), {}


def _huge_advantage_datum(tokenizer) -> wb.Datum:
    """Finite inputs whose gradient is finite too, but so large its float32 norm overflows."""
    datum = _batch(tokenizer)[0]
    n = len(datum.model_input.to_ints())
    inputs = {
        "target_tokens": datum.loss_fn_inputs["target_tokens"],
        "logprobs": [-1.0] * n,
        "advantages": [3e38] * n,
    }
    return wb.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)


def test_a_non_finite_gradient_fails_its_call_and_keeps_the_accumulated_one() -> None:
    """The call that produced a NaN (or inf) gradient fails, naming itself; the gradient accumulated
    before it stays, and the next optim_step applies exactly that one."""
    with (
        wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False) as sess,
        wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False) as clean,
    ):
        data = _batch(sess.tokenizer)
        for session in (sess, clean):
            session.policy.forward_backward(data, "cross_entropy").result()
            session.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
            session.policy.forward_backward(data[:2], "cross_entropy").result()  # the good gradient
        before = sess.state_digest()
        with pytest.raises(
            wb.NonFiniteGradientError,
            match="forward_backward_custom on policy produced a non-finite gradient",
        ):
            sess.policy.forward_backward_custom(data, _poisoned).result()
        overflowing = [
            ce_datum([*d.model_input.to_ints(), 5], weights=[3e38] * len(d.model_input.to_ints()))
            for d in data
        ]
        with pytest.raises(
            wb.NonFiniteGradientError,
            match="forward_backward with 'cross_entropy' on policy produced a non-finite",
        ):
            sess.policy.forward_backward(overflowing, "cross_entropy").result()
        assert sess.state_digest() == before
        response = sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        assert response.applied
        clean.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        assert sess.state_digest() == clean.state_digest()
        # a NaN gradient with nothing accumulated before it leaves nothing to step on
        with pytest.raises(wb.NonFiniteGradientError):
            sess.policy.forward_backward_custom(data, _poisoned).result()
        skipped = sess.policy.optim_step().result()
        assert not skipped.applied and "no gradient accumulated" in skipped.skipped_reason


def test_finite_gradients_whose_float32_norm_overflows_are_kept_and_clipped(tiny: wb.Session) -> None:
    """Advantages of 3e38 give finite gradients whose float32 norm overflows: they were taken for
    non-finite and dropped, with the good gradient accumulated before them. The norm is now computed
    safely; the gradient stays; a step whose Adam moments would overflow is undone with its reason, and
    a clipped step applies."""
    data = _batch(tiny.tokenizer)
    tiny.policy.forward_backward(data, "cross_entropy").result()
    tiny.policy.forward_backward([_huge_advantage_datum(tiny.tokenizer)], "importance_sampling").result()
    status = tiny.engine.model_status(tiny.model_id)
    assert status.pending_backward_calls == 2
    gradients = [g for g in _grads(tiny).values()]
    assert all(bool(torch.isfinite(g).all()) for g in gradients)
    assert not math.isfinite(float(torch.nn.utils.get_total_norm(gradients)))  # float32 overflows
    expected_norm = float(
        torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in gradients])
        )
    )
    before = tiny.state_digest()

    unclipped = tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result()
    assert not unclipped.applied
    assert "non-finite weights or optimizer moments" in unclipped.skipped_reason
    assert unclipped.metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-6)
    assert tiny.state_digest() == before  # undone whole: weights, Adam state, the gradient, counters

    clipped = tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-3, grad_clip_norm=1.0)).result()
    assert clipped.applied and clipped.metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-6)
    assert all(bool(torch.isfinite(p).all()) for p in _params(tiny).values())
    assert math.isfinite(tiny.policy.forward(data, "cross_entropy").result().metrics["loss:sum"])


def test_a_step_that_would_leave_nan_weights_is_undone(tiny: wb.Session) -> None:
    """The last line of defence behind AdamParams' validation: an eps that rounds to 0 in float32 makes
    Adam divide 0 by 0 for weights whose gradient is 0 (every LoRA A matrix at the first step, B being
    zero). Such a step was reported applied with NaN weights; it is now undone and says why."""
    data = _batch(tiny.tokenizer)
    tiny.policy.forward_backward(data, "cross_entropy").result()
    before = tiny.state_digest()
    slipped_past_validation = wb.AdamParams(learning_rate=1e-3)
    object.__setattr__(slipped_past_validation, "eps", 1e-46)
    response = tiny.policy.optim_step(slipped_past_validation).result()
    assert not response.applied and "non-finite weights or optimizer moments" in response.skipped_reason
    assert tiny.state_digest() == before and tiny.policy.step == 0
    assert tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result().applied
    assert all(bool(torch.isfinite(p).all()) for p in _params(tiny).values())


def test_failure_inside_an_operation_leaves_the_accumulated_gradient(tiny: wb.Session) -> None:
    data = _batch(tiny.tokenizer)
    tiny.policy.forward_backward(data, "cross_entropy").result()
    before = tiny.state_digest()

    def broken(batch: list[wb.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        logprobs[0].sum().backward(retain_graph=True)  # a partial gradient, then a failure
        raise RuntimeError("bug in my loss")

    with pytest.raises(RuntimeError, match="bug in my loss"):
        tiny.policy.forward_backward_custom(data, broken).result()
    assert tiny.state_digest() == before


def test_out_of_memory_mid_batch_restores_gradients_and_recovers() -> None:
    data = ragged_ce_batch(seed=6, count=6, min_len=10, max_len=60, vocab=900)
    # one thread: the micro-batches run one after another (on streams, see the test after this one)
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, max_tokens_per_microbatch=80, threads=1) as sess:
        sess.policy.forward_backward(data[:2], "cross_entropy").result()
        before = sess.state_digest()
        calls = {"n": 0}

        def failing_forward(
            module: torch.nn.Module, args: object
        ) -> None:  # the second micro-batch's forward fails
            calls["n"] += 1
            if calls["n"] == 2:
                raise torch.OutOfMemoryError("simulated: out of memory")

        hook = sess.engine.torch_model.get_decoder().register_forward_pre_hook(failing_forward)
        try:
            with pytest.raises(torch.OutOfMemoryError):
                sess.policy.forward_backward(data, "cross_entropy").result()
        finally:
            hook.remove()
        assert calls["n"] == 2
        assert sess.state_digest() == before
        sess.policy.forward_backward(data[2:3], "cross_entropy").result()
        assert calls["n"] == 2  # the hook is gone
        assert sess.policy.optim_step().result().applied


def test_futures_run_in_order_and_are_awaitable(tiny: wb.Session) -> None:
    data = _batch(tiny.tokenizer)
    fb = tiny.policy.forward_backward(data, "cross_entropy")
    step = tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-2))
    after = tiny.policy.forward(data, "cross_entropy")
    assert step.result(timeout=60).applied
    assert after.result().metrics["loss:sum"] < fb.result().metrics["loss:sum"]

    async def train() -> float:
        out = await tiny.policy.forward_backward(data, "cross_entropy")
        await tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result_async()
        return out.metrics["loss:sum"]

    assert math.isfinite(asyncio.run(train()))
    assert tiny.policy.step == 2


def test_history_records_every_operation(tiny: wb.Session) -> None:
    data = _batch(tiny.tokenizer)
    tiny.policy.forward_backward(data, "cross_entropy").result()
    tiny.policy.optim_step().result()
    tiny.policy.forward(data, "cross_entropy").result()
    ops = [(row["op"], row["model"], row["step"]) for row in tiny.history]
    assert ops == [("forward_backward", "policy", 0), ("optim_step", "policy", 1), ("forward", "policy", 1)]
    steps, values = tiny.history.series("loss:sum", op="forward_backward")
    assert steps == [0] and len(values) == 1


def test_reference_is_the_base_model_and_forward_only(tiny: wb.Session) -> None:
    data = _batch(tiny.tokenizer)
    for _ in range(3):
        tiny.policy.forward_backward(data, "cross_entropy").result()
        tiny.policy.optim_step(wb.AdamParams(learning_rate=3e-2)).result()
    reference = tiny.reference.forward(data, "cross_entropy").result()
    policy = tiny.policy.forward(data, "cross_entropy").result()
    assert reference.metrics["loss:sum"] > policy.metrics["loss:sum"]
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0) as fresh:
        untrained = fresh.policy.forward(data, "cross_entropy").result()
    assert reference.metrics["loss:sum"] == pytest.approx(untrained.metrics["loss:sum"], rel=1e-6)
    with pytest.raises(ValueError, match="reference is not trainable"):
        tiny.reference.forward_backward(data, "cross_entropy")
    with pytest.raises(ValueError, match="reference is not trainable"):
        tiny.reference.optim_step()


def test_close_frees_and_a_new_session_works() -> None:
    import gc
    import weakref

    sess = wb.Session("tiny", wb.LoraConfig(rank=2), critic=True)
    client = sess.sampling_client()
    client.sample([1, 2, 3], 1, wb.SamplingParams(max_tokens=2)).result()
    model = weakref.ref(sess.engine.torch_model)
    base = weakref.ref(sess.engine.torch_model.get_base_model())
    sess.close()
    gc.collect()
    assert model() is None and base() is None, "the model is still referenced after close()"
    sess.close()
    with pytest.raises(wb.SessionClosedError):
        sess.policy.forward([ce_datum([1, 2, 3])], "cross_entropy")
    with wb.Session("tiny", wb.LoraConfig(rank=2)) as again:
        assert (
            again.policy.forward([ce_datum([1, 2, 3])], "cross_entropy").result().metrics["num_tokens:sum"]
            == 2
        )


def test_service_client_entry_point() -> None:
    with wb.ServiceClient(base_url="http://unused", api_key="tml-unused") as service:
        tc = service.create_lora_training_client(base_model="tiny", rank=8, train_unembed=False)
        assert tc.get_info().lora_rank == 8
        tokens = tc.get_tokenizer()("two plus two is four").input_ids
        out = tc.forward_backward([ce_datum(tokens)], "cross_entropy").result()
        assert out.metrics["loss:sum"] > 0
        assert tc.optim_step(wb.AdamParams(learning_rate=1e-3)).result().applied
        names = [n for n, _ in tc.engine.torch_model.named_parameters() if "lora_" in n]
        assert names and not any("lm_head" in n for n in names)


def _group_rl_batch(sess: wb.Session, advantages_G: list[list[float]]) -> list[wb.Datum]:
    """Groups of completions of one random prompt each, one group per row of `advantages_G`; the sampler's
    logprobs are the policy's own, shifted so that the ratios are not all 1."""
    rng = random.Random(3)
    data = []
    for advantages in advantages_G:
        prompt = random_tokens(rng, 9, 900)
        for advantage in advantages:
            tokens = prompt + random_tokens(rng, rng.randint(3, 7), 900)
            own = sess.policy.forward([ce_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]
            sampled = [lp - 0.1 * rng.random() for lp in own["logprobs"].tolist()]
            data.append(rl_datum(tokens, len(prompt), sampled, advantage))
    return data


def _recording_grad_mode(sess: wb.Session) -> tuple[list[bool], torch.utils.hooks.RemovableHandle]:
    """A forward pre-hook on the decoder that records whether each pass builds a graph for backward."""
    seen: list[bool] = []

    def record(module: torch.nn.Module, args: object) -> None:
        seen.append(torch.is_grad_enabled())

    return seen, sess.engine.torch_model.get_decoder().register_forward_pre_hook(record)


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo"])
def test_datums_without_gradient_are_computed_forward_only(
    loss: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group whose completions all got the same reward has advantages 0, so its datums' loss has no
    gradient: they run forward only, and the call's outputs, metrics and gradient are those of the same
    call with every datum run backward (the loss without `gradient_scale`). A call of such datums only
    runs no backward pass and still accumulates a gradient of zeros, as the full call does."""
    from dataclasses import replace

    from workbench import losses

    advantages_G = [[0.5, -0.5, 0.25, -0.25], [0.0] * 4, [1.0, -1.0, 0.0, 0.0]]
    results, gradients = [], []
    for skipping in (True, False):
        if not skipping:
            monkeypatch.setitem(losses.LOSSES, loss, replace(losses.LOSSES[loss], gradient_scale=None))
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0) as sess:
            data = _group_rl_batch(sess, advantages_G)
            seen, hook = _recording_grad_mode(sess)
            results.append(sess.policy.forward_backward(data, loss).result())
            hook.remove()
            assert (False in seen) is skipping and True in seen
            gradients.append(_grads(sess))
    (skipped, full), (skipped_grads, full_grads) = results, gradients
    assert skipped.metrics == pytest.approx(full.metrics, rel=1e-5, abs=1e-6)
    for ours, theirs in zip(skipped.loss_fn_outputs, full.loss_fn_outputs, strict=True):
        for name in ("logprobs", "elementwise_loss"):
            torch.testing.assert_close(ours[name].to_torch(), theirs[name].to_torch(), rtol=1e-5, atol=1e-6)
    for name, gradient in full_grads.items():  # summed in other passes: equal up to float rounding
        scale = float(gradient.abs().max())
        torch.testing.assert_close(skipped_grads[name], gradient, rtol=1e-5, atol=1e-5 * scale)

    monkeypatch.undo()
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0) as sess:
        data = _group_rl_batch(sess, [[0.0] * 4, [0.0] * 3])
        seen, hook = _recording_grad_mode(sess)
        out = sess.policy.forward_backward(data, loss).result()
        hook.remove()
        assert seen and not any(seen)
        assert out.metrics["loss:sum"] == 0.0
        assert all(float(g.abs().max()) == 0.0 for g in _grads(sess).values())
        assert sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm"] == 0.0


def _recording_autograd_rows(sess: wb.Session) -> list[int]:
    """The rows the output layer runs with autograd on, pass by pass, from now on (the session's own)."""
    rows: list[int] = []

    def record(module: torch.nn.Module, args: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if torch.is_grad_enabled():
            rows.append(args[0].shape[0])

    sess.engine.torch_model.get_output_embeddings().register_forward_hook(record)
    return rows


@pytest.mark.parametrize("layout", ["plain", "shared", "in parts"])
def test_prompt_positions_run_the_output_layer_without_autograd(
    layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group RL datum's prompt positions have advantage 0, so their logprobs get no gradient: the output
    layer runs there without autograd (no backward through it), and the call's outputs and gradient are
    those of the same call with every position run backward (the loss without `gradient_scale`): in
    plain passes, in shared-prefix passes, and in a shared pass trained in parts."""
    from dataclasses import replace

    from workbench import losses
    from workbench.engine.model import shared_prefix

    if layout == "plain":
        monkeypatch.setattr(shared_prefix, "PREFIX_PASS_OVERHEAD_TOKENS", math.inf)
    results, gradients, rows = [], [], []
    for skipping in (True, False):
        spec = losses.LOSSES["importance_sampling"]
        monkeypatch.setitem(
            losses.LOSSES, "importance_sampling", spec if skipping else replace(spec, gradient_scale=None)
        )
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0) as sess:
            if layout == "in parts":
                monkeypatch.setattr(sess.engine._state.model, "full_activation_limit", 24)
            data = _group_rl_batch(sess, [[0.5, -0.5, 0.25], [1.0, -1.0, 0.5]])
            with_autograd = _recording_autograd_rows(sess)
            results.append(sess.policy.forward_backward(data, "importance_sampling").result())
            rows.append(sum(with_autograd))
            gradients.append(_grads(sess))
    (skipped, full), (skipped_grads, full_grads) = results, gradients
    prompt_positions = 2 * 8  # each group's 9-token prompt predicts 8 tokens with advantage 0
    assert rows[0] <= rows[1] - prompt_positions, rows
    assert skipped.metrics == pytest.approx(full.metrics, rel=1e-5, abs=1e-6)
    for ours, theirs in zip(skipped.loss_fn_outputs, full.loss_fn_outputs, strict=True):
        for name in ("logprobs", "elementwise_loss"):
            torch.testing.assert_close(ours[name].to_torch(), theirs[name].to_torch(), rtol=1e-5, atol=1e-6)
    assert any(float(gradient.abs().max()) > 0 for gradient in full_grads.values())
    for name, gradient in full_grads.items():
        scale = float(gradient.abs().max())
        torch.testing.assert_close(skipped_grads[name], gradient, rtol=1e-5, atol=1e-5 * scale)


def test_cross_entropy_datums_with_zero_weights_are_computed_forward_only(tiny: wb.Session) -> None:
    """Cross-entropy's terms are scaled by the weights: a datum weighted 0 everywhere contributes its
    logprobs and no gradient, computed without a backward pass."""
    rng = random.Random(5)
    trained, unweighted = ce_datum(random_tokens(rng, 20, 900)), ce_datum(random_tokens(rng, 30, 900))
    unweighted.loss_fn_inputs["weights"] = wb.TensorData.from_torch(torch.zeros(29))
    seen, hook = _recording_grad_mode(tiny)
    both = tiny.policy.forward_backward([trained, unweighted], "cross_entropy").result()
    hook.remove()
    assert True in seen and False in seen
    mixed = _grads(tiny)
    tiny.policy.optim_step(wb.AdamParams(learning_rate=0.0)).result()
    tiny.policy.forward_backward([trained], "cross_entropy").result()
    for name, gradient in _grads(tiny).items():
        torch.testing.assert_close(mixed[name], gradient, rtol=1e-5, atol=1e-5 * float(gradient.abs().max()))
    alone = tiny.policy.forward([unweighted], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    torch.testing.assert_close(
        both.loss_fn_outputs[1]["logprobs"].to_torch(), alone.to_torch(), rtol=1e-5, atol=1e-6
    )
    tiny.policy.optim_step(wb.AdamParams(learning_rate=0.0)).result()
