"""What a training micro-batch keeps for backward, chosen from its size: activation checkpointing of the
decoder's layers, and recomputation of the output layer's logits.

A decoder layer keeps, for backward, a dozen tensors per token as wide as the hidden or the MLP size
(about 40 KB per token per layer for SmolLM2-135M in fp32; 170 KB for an 8B model in bf16), and the output
layer a log-softmax as wide as the vocabulary (200 KB per token for SmolLM2, 600 KB for a 152k
vocabulary). A checkpointed layer keeps only its input hidden states and recomputes the rest in backward
(Chen et al. 2016, https://arxiv.org/abs/1604.06174): a few percent of the memory for one more forward
pass of that layer.

The rule: a training micro-batch of n padded tokens keeps full activations for f(n) tokens' worth, with
F the model's `full_activation_limit`: f(n) = n up to F (nothing recomputed), and f(n) = F²/n beyond.
With L layers, the first k = ceil(L · (1 − f(n)/n)) = ceil(L · (1 − (F/n)²)) layers are checkpointed,
and the positions beyond the first f(n) recompute their logits in backward (`workbench.engine.model.logprobs`). So
the memory a step keeps peaks at that of an F-token micro-batch and falls beyond it as F²/n (plus each
checkpointed layer's input, L · H values per token): a quarter of the full activations at 2 × F, while
the recomputation grows smoothly with n (three quarters of the layers at 2 × F). A fixed f(n) = F would
keep the memory flat, which at n = 2 × F is still half of what a plain step keeps.
`batching.plan_microbatches` counts the recomputation's cost when it groups datums for training. Forward
passes without gradients keep nothing and recompute nothing.

F is 1024 tokens, or more for a model whose tokens keep less than SmolLM2-135M's in fp32: as many as keep
what 1024 of those do (`FULL_ACTIVATION_BYTES`, 1.24 GiB). A small model then never pays for
recomputation that saves it next to nothing: the tiny test model (H = 64, two layers) keeps 12 KB per
token, F = 108,000, and checkpointing at 1024 took its equal-length training benchmark from 0.98x to
0.61x the raw loop, one forward pass per 1024 tokens costing more than the pass's arithmetic.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

# The least F, in padded tokens: the largest training micro-batch whose activations are kept whole. At
# SmolLM2-135M's size on a CPU, a forward pass over 1024 tokens already runs its matmuls at full speed, so
# a smaller F only adds recomputation to the usual batches: F = 512 (a flat rule, f(n) = F) took the
# equal-length training benchmark (8 × 128 tokens) from 0.97x to 0.89x the raw loop. Measured with
# `bench/memory.py` (one 2048-token sequence, SmolLM2-135M fp32; the raw transformers + peft loop: 6.5
# GB): the flat rule with F = 1024 kept 3.4 GB (0.55x), F = 512 2.9 GB (0.45x); this rule with F = 1024
# keeps the layers of F = 512 at that length.
MIN_FULL_ACTIVATION_TOKENS = 1024


def activation_bytes_per_token(hidden_size: int, num_layers: int, vocab_size: int, element_size: int) -> int:
    """Roughly what one training token keeps for backward: per decoder layer about 16 values as wide as
    the hidden size (the attention's inputs and outputs, and the MLP's, which are wider), in the model's
    precision, and its fp32 log-softmax row over the vocabulary."""
    return element_size * num_layers * 16 * hidden_size + 4 * vocab_size


# What MIN_FULL_ACTIVATION_TOKENS tokens of SmolLM2-135M (H = 576, 30 layers, V = 49,152) keep in fp32.
FULL_ACTIVATION_BYTES = MIN_FULL_ACTIVATION_TOKENS * activation_bytes_per_token(576, 30, 49_152, 4)


def full_activation_limit(hidden_size: int, num_layers: int, vocab_size: int, element_size: int) -> int:
    """F for a model: the tokens that keep FULL_ACTIVATION_BYTES, and never fewer than
    MIN_FULL_ACTIVATION_TOKENS."""
    per_token = activation_bytes_per_token(hidden_size, num_layers, vocab_size, element_size)
    return max(MIN_FULL_ACTIVATION_TOKENS, FULL_ACTIVATION_BYTES // per_token)


def decoder_layers(decoder: nn.Module) -> list[nn.Module]:
    """The decoder's layers, in order: transformers' checkpointable layer blocks (none for a model that
    has no such blocks, which then runs unchanged)."""
    return [module for module in decoder.modules() if isinstance(module, GradientCheckpointingLayer)]


def full_activation_tokens(tokens: int, limit: int) -> int:
    """f(n): how many of a training micro-batch's `tokens` padded tokens keep full activations (all of
    them up to F = `limit`, F²/n beyond)."""
    if tokens <= limit:
        return tokens
    return limit * limit // tokens


def checkpointed_layer_count(tokens: int, num_layers: int, limit: int) -> int:
    """k, how many of `num_layers` layers a training micro-batch of `tokens` padded tokens checkpoints,
    for F = `limit`."""
    if tokens <= limit:
        return 0
    return math.ceil(num_layers * (1 - (limit / tokens) ** 2))


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # No RNG state to preserve: the model runs in eval mode (no dropout), so the recomputation is the
    # same computation. Non-reentrant: gradients reach the adapters inside the layer directly.
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


class _Selection(threading.local):
    """The layers that the calling thread's passes checkpoint: each thread its own, since passes run on
    several streams at once, each with its own choice."""

    def __init__(self) -> None:
        self.layers: frozenset[nn.Module] = frozenset()


_selected = _Selection()


def _layer_forward(layer_ref: weakref.ref[nn.Module], *args: Any, **kwargs: Any) -> Any:
    """A layer's `forward`: its class's own, checkpointed where the calling thread's `checkpointing`
    block names the layer."""
    layer = layer_ref()
    assert layer is not None
    forward = type(layer).forward.__get__(layer)
    if layer in _selected.layers:
        return _checkpointed(forward, *args, **kwargs)
    return forward(*args, **kwargs)


def install_checkpointing(layers: Sequence[nn.Module]) -> None:
    """Let `checkpointing` choose, per thread, which of `layers` run under activation checkpointing: each
    layer's `forward` becomes `_layer_forward` (the module tree, its names and its hooks stay as they
    are; the layer is held weakly, so the model is freed as before). Once, when the model is loaded."""
    for layer in layers:
        layer.forward = functools.partial(_layer_forward, weakref.ref(layer))


@contextlib.contextmanager
def checkpointing(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, the calling thread's passes run each of `layers` (installed by
    `install_checkpointing`) under activation checkpointing; other threads' passes are unchanged. The
    recomputation in backward calls the layer's own function with the same inputs, after the block
    has ended."""
    previous = _selected.layers
    _selected.layers = frozenset(layers)
    try:
        yield
    finally:
        _selected.layers = previous
