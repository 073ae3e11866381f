"""What a training micro-batch keeps for backward, chosen from its size: activation checkpointing of the
decoder's layers, and recomputation of the output layer's logits.

A decoder layer keeps, for backward, a dozen tensors per token as wide as the hidden or the MLP size
(about 40 KB per token per layer for SmolLM2-135M in fp32; 170 KB for an 8B model in bf16), and the output
layer a log-softmax as wide as the vocabulary (200 KB per token for SmolLM2, 600 KB for a 152k
vocabulary). A checkpointed layer keeps only its input hidden states and recomputes the rest in backward
(Chen et al. 2016, https://arxiv.org/abs/1604.06174): a few percent of the memory for one more forward
pass of that layer.

The rule: a training micro-batch of n padded tokens keeps full activations for f(n) tokens' worth, with
F = `FULL_ACTIVATION_TOKENS`: f(n) = n up to F (nothing recomputed), and f(n) = F²/n beyond. With L
layers, the first k = ceil(L · (1 − f(n)/n)) = ceil(L · (1 − (F/n)²)) layers are checkpointed, and the
positions beyond the first f(n) recompute their logits in backward (`workbench.logprobs`). So the memory
a step keeps peaks at that of an F-token micro-batch and falls beyond it as F²/n (plus each checkpointed
layer's input, L · H values per token): a quarter of the full activations at 2 × F, while the
recomputation grows smoothly with n (three quarters of the layers at 2 × F). A fixed f(n) = F would keep
the memory flat, which at n = 2 × F is still half of what a plain step keeps. `batching.plan_microbatches`
counts the recomputation's cost when it groups datums for training. Forward passes without gradients
keep nothing and recompute nothing.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers.modeling_layers import GradientCheckpointingLayer

# F: the largest training micro-batch (padded tokens) whose activations are kept whole. At SmolLM2-135M's
# size on a CPU, a forward pass over 1024 tokens already runs its matmuls at full speed, so a smaller F
# only adds recomputation to the usual batches: F = 512 (a flat rule, f(n) = F) took the equal-length
# training benchmark (8 × 128 tokens) from 0.97x to 0.89x the raw loop. Measured with `bench/memory.py`
# (one 2048-token sequence, SmolLM2-135M fp32; the raw transformers + peft loop: 6.5 GB): the flat rule
# with F = 1024 kept 3.4 GB (0.55x), F = 512 2.9 GB (0.45x); this rule with F = 1024 keeps the layers
# of F = 512 at that length.
FULL_ACTIVATION_TOKENS = 1024


def decoder_layers(decoder: nn.Module) -> list[nn.Module]:
    """The decoder's layers, in order: transformers' checkpointable layer blocks (none for a model that
    has no such blocks, which then runs unchanged)."""
    return [module for module in decoder.modules() if isinstance(module, GradientCheckpointingLayer)]


def full_activation_tokens(tokens: int) -> int:
    """f(n): how many of a training micro-batch's `tokens` padded tokens keep full activations (all of
    them up to F, F²/n beyond)."""
    if tokens <= FULL_ACTIVATION_TOKENS:
        return tokens
    return FULL_ACTIVATION_TOKENS * FULL_ACTIVATION_TOKENS // tokens


def checkpointed_layer_count(tokens: int, num_layers: int) -> int:
    """k, how many of `num_layers` layers a training micro-batch of `tokens` padded tokens checkpoints."""
    if tokens <= FULL_ACTIVATION_TOKENS:
        return 0
    return math.ceil(num_layers * (1 - (FULL_ACTIVATION_TOKENS / tokens) ** 2))


def _checkpointed(forward: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    # No RNG state to preserve: the model runs in eval mode (no dropout), so the recomputation is the
    # same computation. Non-reentrant: gradients reach the adapters inside the layer directly.
    return checkpoint(forward, *args, use_reentrant=False, preserve_rng_state=False, **kwargs)


@contextlib.contextmanager
def checkpointing(layers: Sequence[nn.Module]) -> Iterator[None]:
    """Within the block, each of `layers` runs under activation checkpointing.

    Each layer's `forward` is shadowed by a checkpointed call of its class's own `forward` for the
    duration (the module tree, its names and its hooks stay as they are). The recomputation in backward
    calls the same function with the same inputs, after the block has ended.
    """
    for layer in layers:
        layer.forward = functools.partial(_checkpointed, type(layer).forward.__get__(layer))
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward
