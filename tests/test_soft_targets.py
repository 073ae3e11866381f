"""Soft-target cross-entropy: `target_tokens` and `weights` of shape (N, K), Tinker's multi-target form
(top-K distillation), against hand-computed values, the full-vocabulary cross-entropy and KL when K = V,
and K hard-target datums accumulated."""

from __future__ import annotations

import random

import pytest
import torch

import workbench as wb
from tests.datums import ce_datum
from workbench.engine.model import logprobs
from workbench.engine.model.logprobs import target_logprobs
from workbench.losses import cross_entropy


def _grads(sess: wb.Session) -> dict[str, torch.Tensor]:
    gradients = sess.engine.inspect(sess.model_id, wb.Role.POLICY).gradients
    return {name: grad for name, grad in gradients.items() if grad is not None}


def test_soft_cross_entropy_sums_weighted_logprobs_over_targets_and_positions() -> None:
    # one datum, 2 positions, K = 3 targets each
    logprobs = torch.tensor([[[-1.0, -2.0, -3.0], [-0.5, -4.0, -1.5]]], requires_grad=True)
    weights = torch.tensor([[[0.5, 0.25, 0.25], [0.0, 0.0, 0.0]]])
    out = cross_entropy(logprobs, {"weights": weights}, torch.ones((1, 2), dtype=torch.bool), {})
    # position 0: 0.5*1 + 0.25*2 + 0.25*3 = 1.75; position 1 carries no weight
    assert out.elementwise_loss_B_T[0].tolist() == pytest.approx([1.75, 0.0])
    assert out.active_B_T[0].tolist() == [True, False]
    (grad,) = torch.autograd.grad(out.elementwise_loss_B_T.sum(), logprobs)
    assert grad[0].tolist() == [[-0.5, -0.25, -0.25], [0.0, 0.0, 0.0]]
    # padding positions (mask False) carry nothing, whatever their weights
    padded = cross_entropy(logprobs, {"weights": weights.flip(1)}, torch.tensor([[True, False]]), {})
    assert padded.elementwise_loss_B_T[0].tolist() == [0.0, 0.0]


def _soft_datum(tokens: list[int], targets_N_K: torch.Tensor, weights_N_K: torch.Tensor) -> wb.Datum:
    return wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": targets_N_K, "weights": weights_N_K},
    )


def test_with_every_token_as_a_target_it_is_the_full_vocabulary_cross_entropy(tiny: wb.Session) -> None:
    vocab = tiny.base_info.vocab_size
    rng = random.Random(0)
    tokens = [rng.randrange(3, vocab) for _ in range(12)]
    n = len(tokens)
    generator = torch.Generator().manual_seed(0)
    teacher_N_V = torch.softmax(3 * torch.randn(n, vocab, generator=generator), dim=-1)
    everything_N_V = torch.arange(vocab).repeat(n, 1)
    datum = _soft_datum(tokens, everything_N_V, teacher_N_V)

    out = tiny.policy.forward_backward([datum], "cross_entropy").result()
    logprobs_N_V = out.loss_fn_outputs[0]["logprobs"].to_torch()
    assert list(logprobs_N_V.shape) == [n, vocab]
    with torch.no_grad():
        logits = tiny.engine.torch_model(input_ids=torch.tensor([tokens])).logits[0].float()
    full_N_V = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(logprobs_N_V, full_N_V, atol=1e-5, rtol=0)
    cross_entropy_sum = float(-(teacher_N_V * full_N_V).sum())
    assert out.metrics["loss:sum"] == pytest.approx(cross_entropy_sum, rel=1e-5)
    # = forward KL(teacher || model) + the teacher's entropy
    kl = float(torch.nn.functional.kl_div(full_N_V, teacher_N_V, reduction="sum"))
    entropy = float(-(teacher_N_V * teacher_N_V.log()).sum())
    assert out.metrics["loss:sum"] == pytest.approx(kl + entropy, rel=1e-5)
    assert out.loss_fn_outputs[0]["elementwise_loss"].to_torch().tolist() == pytest.approx(
        (-(teacher_N_V * full_N_V).sum(-1)).tolist(), rel=1e-5
    )


def test_soft_targets_train_as_their_hard_targets_accumulated() -> None:
    """Σ_k w_k·CE(target_k) is linear in the targets: one (N, K) datum gives the gradient of K (N,)
    datums with the k-th column of targets and weights, and the same loss. Gradients are matched in
    parameter order (two models on one engine name their adapters apart)."""
    rng = random.Random(1)
    tokens = [rng.randrange(3, 900) for _ in range(10)]
    k = 4
    generator = torch.Generator().manual_seed(1)
    targets_N_K = torch.randint(3, 900, (len(tokens), k), generator=generator)
    weights_N_K = torch.rand(len(tokens), k, generator=generator)
    weights_N_K[0] = 0.0  # a position without loss, as the prompt is in distillation
    results = []
    for data in (
        [_soft_datum(tokens, targets_N_K, weights_N_K)],
        [
            wb.Datum(
                model_input=wb.ModelInput.from_ints(tokens),
                loss_fn_inputs={"target_tokens": targets_N_K[:, j], "weights": weights_N_K[:, j]},
            )
            for j in range(k)
        ],
    ):
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0) as sess:
            out = sess.policy.forward_backward(data, "cross_entropy").result()
            results.append((out, _grads(sess)))
    (soft, soft_grads), (hard, hard_grads) = results
    assert soft.metrics["loss:sum"] == pytest.approx(hard.metrics["loss:sum"], rel=1e-5)
    assert soft.metrics["num_tokens:sum"] == len(tokens) - 1
    columns = torch.stack([o["logprobs"].to_torch() for o in hard.loss_fn_outputs], dim=-1)
    torch.testing.assert_close(soft.loss_fn_outputs[0]["logprobs"].to_torch(), columns, atol=1e-6, rtol=0)
    for (name, grad), hard_grad in zip(soft_grads.items(), hard_grads.values(), strict=True):
        torch.testing.assert_close(hard_grad, grad, atol=1e-5, rtol=1e-3, msg=name)


def test_custom_losses_get_n_by_k_logprobs(tiny: wb.Session) -> None:
    tokens = [5, 17, 42, 99, 100]
    targets_N_K = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]])
    seen = []

    def loss_fn(data, logprobs_list):
        seen.append(logprobs_list[0].shape)
        return -logprobs_list[0].sum(), {}

    datum = _soft_datum(tokens, targets_N_K, torch.ones(5, 2))
    custom = tiny.policy.forward_backward_custom([datum], loss_fn).result()
    assert seen == [torch.Size([5, 2])]
    plain = tiny.policy.forward([datum], "cross_entropy").result()
    assert custom.metrics["loss:sum"] == pytest.approx(plain.metrics["loss:sum"], rel=1e-5)


BAD = [
    (
        "soft targets for a loss that takes one target",
        lambda: [
            wb.Datum(
                model_input=wb.ModelInput.from_ints([1, 2, 3]),
                loss_fn_inputs={
                    "target_tokens": torch.tensor([[1, 2], [3, 4], [5, 6]]),
                    "logprobs": [-1.0] * 3,
                    "advantages": [1.0] * 3,
                },
            )
        ],
        "importance_sampling",
        r"datum 0: loss_fn_inputs\['target_tokens'\] has shape \[3, 2\]: K targets per position .* are for 'cross_entropy'",
    ),
    (
        "one weight per position with K targets",
        lambda: [_soft_datum([1, 2, 3], torch.tensor([[1, 2], [3, 4], [5, 6]]), torch.ones(3))],
        "cross_entropy",
        r"datum 0: loss_fn_inputs\['weights'\] has shape \[3\], but target_tokens has shape \[3, 2\]",
    ),
    (
        "K weights per position with one target",
        lambda: [_soft_datum([1, 2, 3], torch.tensor([1, 2, 3]), torch.ones(3, 2))],
        "cross_entropy",
        r"datum 0: loss_fn_inputs\['weights'\] has shape \[3, 2\], but model_input has 3 tokens",
    ),
    (
        "a target outside the vocabulary",
        lambda: [_soft_datum([1, 2, 3], torch.tensor([[1, 2], [3, 10**6], [5, 6]]), torch.ones(3, 2))],
        "cross_entropy",
        r"datum 0: loss_fn_inputs\['target_tokens'\]: token id 1000000 .* outside the vocabulary",
    ),
    (
        "different K in one call",
        lambda: [
            _soft_datum([1, 2, 3], torch.ones(3, 2, dtype=torch.long), torch.ones(3, 2)),
            _soft_datum([1, 2, 3], torch.ones(3, 3, dtype=torch.long), torch.ones(3, 3)),
        ],
        "cross_entropy",
        r"datum 1: .* K=3 .* datum 0 has K=2 .* the same K",
    ),
    (
        "rows of K targets for another number of positions",
        lambda: [_soft_datum([1, 2, 3], torch.ones(4, 2, dtype=torch.long), torch.ones(4, 2))],
        "cross_entropy",
        r"datum 0: loss_fn_inputs\['target_tokens'\] has shape \[4, 2\], but model_input has 3 tokens",
    ),
]


@pytest.mark.parametrize(("case", "build", "loss", "message"), BAD, ids=[c[0] for c in BAD])
def test_bad_soft_targets_raise_and_change_nothing(tiny: wb.Session, case, build, loss, message) -> None:
    tiny.policy.forward_backward([ce_datum([5, 17, 42, 99])], "cross_entropy").result()
    before = tiny.state_digest()
    with pytest.raises(ValueError, match=message):
        tiny.policy.forward_backward(build(), loss)
    assert tiny.state_digest() == before


@pytest.mark.parametrize("kept", [0, 10, 24])  # every position recomputed in backward, some, none
def test_k_targets_per_position_come_from_the_chunked_path_with_gradients(
    kept: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    vocab, hidden, k = 50, 8, 3
    monkeypatch.setattr(logprobs, "CHUNK_LOGITS_ELEMENTS", 7 * vocab)  # 7 positions a chunk
    torch.manual_seed(0)
    layer = torch.nn.Linear(hidden, vocab)
    hidden_B_T_H = torch.randn(2, 12, hidden, requires_grad=True)
    targets_B_T_K = torch.randint(0, vocab, (2, 12, k))
    upstream_B_T_K = torch.randn(2, 12, k)
    ours, _ = target_logprobs(
        hidden_B_T_H, layer, targets_B_T_K, vocab_size=vocab, kept_positions=kept, with_entropy=False
    )
    (ours * upstream_B_T_K).sum().backward()
    grads = [hidden_B_T_H.grad, layer.weight.grad]
    hidden_B_T_H.grad = None
    layer.weight.grad = None
    expected = torch.log_softmax(layer(hidden_B_T_H), dim=-1).gather(-1, targets_B_T_K)
    (expected * upstream_B_T_K).sum().backward()
    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    for got, want in zip(grads, [hidden_B_T_H.grad, layer.weight.grad], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
