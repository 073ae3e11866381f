"""Activation checkpointing chosen from a training micro-batch's size: the same numbers, less kept."""

from __future__ import annotations

import random

import pytest
import torch

import workbench as wb
from workbench.activation_checkpointing import (
    FULL_ACTIVATION_TOKENS,
    checkpointed_layer_count,
    full_activation_tokens,
)


def test_the_rule_keeps_full_activations_for_f_squared_over_n_tokens_beyond_f() -> None:
    assert FULL_ACTIVATION_TOKENS == 1024
    assert checkpointed_layer_count(1024, 30) == 0
    assert checkpointed_layer_count(1025, 30) == 1
    assert checkpointed_layer_count(2048, 30) == 23  # ceil(30 · (1 − 1/4))
    assert checkpointed_layer_count(4096, 30) == 29
    assert [full_activation_tokens(n) for n in (100, 1024, 2048, 4096)] == [100, 1024, 512, 256]
    assert checkpointed_layer_count(10**6, 30) == 30


def _data(count: int, length: int) -> list[wb.Datum]:
    rng = random.Random(0)
    data = []
    for _ in range(count):
        tokens = [rng.randrange(3, 900) for _ in range(length + 1)]
        data.append(
            wb.Datum(
                model_input=tokens[:-1],
                loss_fn_inputs={
                    "target_tokens": tokens[1:],
                    "logprobs": [-2.0] * length,
                    "advantages": [rng.uniform(-1, 1) for _ in range(length)],
                },
            )
        )
    return data


def _train(budget: int, data: list[wb.Datum]) -> tuple[list[int], dict, dict[str, torch.Tensor]]:
    """Layer-by-layer MLP call counts (entered: a recomputation stops at the last tensor it needs) of one training call, its output, and the gradient it leaves."""
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, max_tokens_per_microbatch=budget) as sess:
        layers = sess.engine.torch_model.get_decoder().layers
        calls = [0] * len(layers)
        hooks = [
            layer.mlp.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
            for i, layer in enumerate(layers)
        ]
        out = sess.policy.forward_backward(data, "importance_sampling").result()
        for hook in hooks:
            hook.remove()
        gradients = sess.engine.inspect(sess.model_id, wb.Role.POLICY).gradients
    return calls, out, gradients  # type: ignore[return-value]


def test_a_long_training_microbatch_checkpoints_layers_and_gives_the_same_numbers() -> None:
    # one micro-batch of 1080 tokens: ceil(2 · (1 − (1024/1080)²)) = 1 layer checkpointed
    data = _data(6, 180)
    calls, out, gradients = _train(8192, data)
    assert calls == [2, 1]  # the first layer ran again in backward
    alone_calls, alone_out, alone_gradients = _train(180, data)  # one datum per micro-batch: none
    assert alone_calls == [6, 6]
    assert out.metrics["loss:sum"] == pytest.approx(alone_out.metrics["loss:sum"], rel=1e-5)
    assert out.metrics["entropy:mean"] == pytest.approx(alone_out.metrics["entropy:mean"], rel=1e-5)
    for ours, alone in zip(out.loss_fn_outputs, alone_out.loss_fn_outputs, strict=True):
        torch.testing.assert_close(
            ours["logprobs"].to_torch(), alone["logprobs"].to_torch(), rtol=0, atol=1e-5
        )
    for name, gradient in gradients.items():
        torch.testing.assert_close(gradient, alone_gradients[name], rtol=1e-4, atol=1e-6, msg=name)


def test_forward_passes_never_checkpoint() -> None:
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0) as sess:
        mlp = sess.engine.torch_model.get_decoder().layers[0].mlp
        calls = []
        hook = mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        sess.policy.forward(_data(6, 200), "importance_sampling").result()
        hook.remove()
    assert len(calls) == 1
