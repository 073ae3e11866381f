"""What a training micro-batch keeps for backward, chosen from its size: activation checkpointing of the
decoder's layers, and recomputation of the output layer's logits.

A decoder layer keeps, for backward, a dozen tensors per token as wide as the hidden or the MLP size
(about 40 KB per token per layer for SmolLM2-135M in fp32; 170 KB for an 8B model in bf16), and the output
layer a log-softmax as wide as the vocabulary (200 KB per token for SmolLM2, 600 KB for a 152k
vocabulary). A checkpointed layer keeps only its input hidden states and recomputes the rest in backward
(Chen et al. 2016, https://arxiv.org/abs/1604.06174): a few percent of the memory for one more forward
pass of that layer.

The rule: a training micro-batch of n padded tokens keeps full activations for about
`FULL_ACTIVATION_TOKENS` tokens. With L layers, the first k = ceil(L · (1 − FULL_ACTIVATION_TOKENS / n))
layers are checkpointed (none when n <= FULL_ACTIVATION_TOKENS), and the positions beyond the first
FULL_ACTIVATION_TOKENS recompute their logits in backward (`workbench.logprobs`). So the memory a step
keeps stays near that of a FULL_ACTIVATION_TOKENS-token micro-batch however long the sequence, plus each
checkpointed layer's input (L · H values per token), and the recomputation grows smoothly with n: half
the layers at 2 × FULL_ACTIVATION_TOKENS, three quarters at 4 ×. `batching.plan_microbatches` counts the
recomputation's cost when it groups datums for training. Forward passes without gradients keep nothing
and recompute nothing.
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

# Padded tokens of a training micro-batch whose activations are kept whole. At SmolLM2-135M's size on a
# CPU, a forward pass over 1024 tokens already runs its matmuls at full speed: a longer micro-batch
# would gain no speed for the memory it keeps.
FULL_ACTIVATION_TOKENS = 1024


def decoder_layers(decoder: nn.Module) -> list[nn.Module]:
    """The decoder's layers, in order: transformers' checkpointable layer blocks (none for a model that
    has no such blocks, which then runs unchanged)."""
    return [module for module in decoder.modules() if isinstance(module, GradientCheckpointingLayer)]


def checkpointed_layer_count(tokens: int, num_layers: int) -> int:
    """k, how many of `num_layers` layers a training micro-batch of `tokens` padded tokens checkpoints."""
    if tokens <= FULL_ACTIVATION_TOKENS:
        return 0
    return math.ceil(num_layers * (1 - FULL_ACTIVATION_TOKENS / tokens))


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
