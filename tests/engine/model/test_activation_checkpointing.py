"""Activation checkpointing chosen from a training micro-batch's size: the same numbers, less kept."""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

import workbench as wb
from workbench.engine.model.activation_checkpointing import (
    FULL_ACTIVATION_BYTES,
    checkpointed_layer_count,
    full_activation_limit,
    full_activation_tokens,
)

SMOLLM2_LIMIT = 1024  # F for SmolLM2-135M in fp32


def test_the_rule_keeps_full_activations_for_f_squared_over_n_tokens_beyond_f() -> None:
    assert checkpointed_layer_count(1024, 30, SMOLLM2_LIMIT) == 0
    assert checkpointed_layer_count(1025, 30, SMOLLM2_LIMIT) == 1
    assert checkpointed_layer_count(2048, 30, SMOLLM2_LIMIT) == 23  # ceil(30 · (1 − 1/4))
    assert checkpointed_layer_count(4096, 30, SMOLLM2_LIMIT) == 29
    assert [full_activation_tokens(n, SMOLLM2_LIMIT) for n in (100, 1024, 2048, 4096)] == [
        100,
        1024,
        512,
        256,
    ]
    assert checkpointed_layer_count(10**6, 30, SMOLLM2_LIMIT) == 30


def test_f_is_1024_tokens_or_the_tokens_that_keep_as_much() -> None:
    """F: 1024 for SmolLM2-135M in fp32 and for anything larger; a model whose tokens keep less gets as
    many tokens as keep FULL_ACTIVATION_BYTES."""
    assert full_activation_limit(576, 30, 49_152, 4) == SMOLLM2_LIMIT
    assert full_activation_limit(576, 30, 151_936, 4) == SMOLLM2_LIMIT  # a larger vocabulary
    assert full_activation_limit(4096, 32, 128_256, 2) == SMOLLM2_LIMIT  # an 8B model in bf16
    assert full_activation_limit(576, 30, 49_152, 2) == 1779  # SmolLM2 in bf16 keeps less per token
    tiny = full_activation_limit(64, 2, 1024, 4)
    assert tiny == FULL_ACTIVATION_BYTES // (4 * 2 * 16 * 64 + 4 * 1024) > 100_000


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


def _counting(counts: list[int], index: int) -> Callable[..., None]:
    """A forward pre-hook that adds one to `counts[index]` (under a lock: passes may run on two streams)."""
    lock = threading.Lock()

    def count(*_: object) -> None:
        with lock:
            counts[index] += 1

    return count


@contextlib.contextmanager
def _mlp_calls(sess: wb.Session) -> Iterator[list[int]]:
    """Within the block, how many times each decoder layer's MLP is entered (a recomputation stops at the
    last tensor it needs, so a checkpointed layer's MLP is entered again in backward)."""
    layers = sess.engine.torch_model.get_decoder().layers
    calls = [0] * len(layers)
    hooks = [layer.mlp.register_forward_pre_hook(_counting(calls, i)) for i, layer in enumerate(layers)]
    try:
        yield calls
    finally:
        for hook in hooks:
            hook.remove()


def _train(budget: int, data: list[wb.Datum]) -> tuple[list[int], dict, dict[str, torch.Tensor]]:
    """Layer-by-layer MLP call counts of one training call, its output, and the gradient it leaves."""
    # one thread: on streams a batch is cut into chunks within F, which checkpoint nothing
    with wb.Session(
        "tiny", wb.LoraConfig(rank=4), seed=0, max_tokens_per_microbatch=budget, threads=1
    ) as sess:
        # the tiny model's own F is above 100,000 tokens: take SmolLM2's, so that these small batches
        # exercise the rule
        sess.engine._state.model.full_activation_limit = SMOLLM2_LIMIT
        with _mlp_calls(sess) as calls:
            out = sess.policy.forward_backward(data, "importance_sampling").result()
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


@contextlib.contextmanager
def _decoder_passes(sess: wb.Session) -> Iterator[list[int]]:
    """Within the block, how many forward passes the decoder makes (one per micro-batch or stream chunk)."""
    passes = [0]
    hook = sess.engine.torch_model.get_decoder().register_forward_pre_hook(_counting(passes, 0))
    try:
        yield passes
    finally:
        hook.remove()


def test_the_tiny_model_trains_4096_tokens_without_recomputation(tiny: wb.Session) -> None:
    with _mlp_calls(tiny) as calls, _decoder_passes(tiny) as passes:
        tiny.policy.forward_backward(_data(32, 128), "importance_sampling").result()
    assert calls == [passes[0]] * 2


def test_forward_passes_never_checkpoint(tiny: wb.Session) -> None:
    tiny.engine._state.model.full_activation_limit = SMOLLM2_LIMIT  # 1200 tokens are past it
    with _mlp_calls(tiny) as calls, _decoder_passes(tiny) as passes:
        tiny.policy.forward(_data(6, 200), "importance_sampling").result()
    assert calls == [passes[0]] * 2
