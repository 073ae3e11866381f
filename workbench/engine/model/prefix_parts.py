"""A shared-prefix training pass in parts, so that it keeps less than a plain pass of its datums.

A shared pass (`workbench.engine.model.prefix_attention`) keeps, for backward, the activations of its
prefix and of all its suffixes: a long-prompt group of G = 8 completions of 64 tokens after a 512-token
prompt keeps 1,024 tokens' worth where a plain stream keeps one 576-token datum. So a training pass of
one group over `kept_tokens` computed tokens runs in parts:

1. the prefix once, with autograd, its first k layers under activation checkpointing (Chen et al.
   2016, https://arxiv.org/abs/1604.06174): its outputs (the targets' logprobs or the critic's values)
   and every layer's keys and values, each also as a detached leaf copy;
2. the suffixes a few datums at a time against the leaves, each part's loss and backward before the
   next part's forward: the part's gradient for the adapter, and for the leaves, summed over the parts;
3. the prefix's backward, from its outputs, keys and values, with the leaves' summed gradients.

The gradient is the one pass's, summed in another order (within 5e-6 of it on the long case). The rule:
a part's suffixes are at most a quarter of `kept_tokens` (at least one datum), and the prefix checkpoints
the fewest layers that bring what it keeps (L_max · (1 − k / layers) tokens' worth) to `kept_tokens`
less a part. On that group (SmolLM2-135M, fp32, `kept_tokens` = 512: parts of 2 datums, 8 of 30 layers
checkpointed), one `forward_backward` on one thread peaked 1.19 GB over the loaded model, against 1.75
GB in parts before the engine handed each part's freed memory back to the system
(`workbench.engine.local.heap`), 2.5–2.9 GB in one pass, and 1.38–1.44 GB for one plain 576-token datum
(what a plain stream holds). Parts without checkpointing kept about what the plain datum keeps; more
checkpointing (15 layers) kept little less for more time.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from workbench.engine.model.shared_prefix import SharedPrefixMicroBatch


def runs_in_parts(micro: SharedPrefixMicroBatch, kept_tokens: int) -> bool:
    """Whether a training pass over `micro` runs in parts: one group, over `kept_tokens` computed tokens."""
    return len(micro.groups) == 1 and micro.computed_tokens > kept_tokens


def part_members(members: int, suffix_length: int, kept_tokens: int) -> list[list[int]]:
    """A group's `members` (suffixes padded to `suffix_length`) in parts, in order: as many per part as
    keep a quarter of `kept_tokens` of suffix tokens, at least one."""
    per_part = max(1, kept_tokens // 4 // suffix_length)
    return [list(range(start, min(members, start + per_part))) for start in range(0, members, per_part)]


def checkpointed_prefix_layers(
    prefix_tokens: int, part_tokens: int, kept_tokens: int, num_layers: int
) -> int:
    """k, the prefix's layers run under checkpointing: the fewest that bring what its `prefix_tokens`
    keep, prefix_tokens · (1 − k / num_layers) tokens' worth, within `kept_tokens` less a part's
    `part_tokens`."""
    room = max(0, kept_tokens - part_tokens)
    if prefix_tokens <= room:
        return 0
    return min(num_layers, math.ceil(num_layers * (1 - room / prefix_tokens)))


def add_gradients(totals: list[Tensor | None], gradients: Sequence[Tensor | None]) -> None:
    """Add `gradients` into `totals`, entry by entry, in place (None: no gradient)."""
    for index, gradient in enumerate(gradients):
        if gradient is not None:
            total = totals[index]
            totals[index] = gradient if total is None else total.add_(gradient)


@dataclass
class PrefixStage:
    """A shared pass's prefix, run once: its outputs and keys and values with their autograd history,
    and what the suffix parts read in their place (leaf copies, or the same tensors in one pass).

    `outputs` is the targets' logprobs, (P, L_max, G, …), or the critic's values, (P, L_max);
    `keys_values` is [keys, values] per layer; `entropy_P_L` the detached entropy when asked."""

    outputs: Tensor
    keys_values: list[Tensor]
    entropy_P_L: Tensor | None
    read_outputs: Tensor
    read_keys_values: list[Tensor]
    leaf_gradients: list[Tensor | None] = field(default_factory=list)  # the parts' sums, for `leaves`

    @staticmethod
    def of(
        outputs: Tensor, keys_values: list[Tensor], entropy_P_L: Tensor | None, in_parts: bool
    ) -> PrefixStage:
        """The stage; `in_parts`: the parts read detached leaf copies, whose gradients they return."""
        if not in_parts:
            return PrefixStage(outputs, keys_values, entropy_P_L, outputs, keys_values)
        outputs_leaf = outputs.detach().requires_grad_(True)
        leaves = [tensor.detach().requires_grad_(True) for tensor in keys_values]
        return PrefixStage(
            outputs, keys_values, entropy_P_L, outputs_leaf, leaves, [None] * (1 + len(leaves))
        )

    @property
    def leaves(self) -> list[Tensor]:
        """What a part differentiates besides the adapter (in parts only)."""
        return [self.read_outputs, *self.read_keys_values]

    def backward(self, parameters: list[nn.Parameter]) -> tuple[Tensor | None, ...]:
        """The adapter's gradient through the prefix, from the parts' summed gradients at its outputs,
        keys and values (the checkpointed layers recomputed here). Outputs computed without autograd (no
        position of the prefix trains: `logprobs.target_logprobs`) pass nothing back."""
        pairs = [
            (tensor, gradient)
            for tensor, gradient in zip([self.outputs, *self.keys_values], self.leaf_gradients, strict=True)
            if gradient is not None and tensor.requires_grad
        ]
        if not pairs:
            return (None,) * len(parameters)
        return torch.autograd.grad(
            [tensor for tensor, _ in pairs],
            parameters,
            grad_outputs=[gradient for _, gradient in pairs],
            allow_unused=True,
        )


def kept_tokens(full_activation_limit: int) -> int:
    """The most a shared training pass keeps, in tokens' worth: half of F, the model's full-activation
    limit (`workbench.engine.model.activation_checkpointing`), which for SmolLM2-135M in fp32 is 512
    tokens, what a plain pass's chunk on a CPU stream keeps (`streams.CHUNK_TOKENS`)."""
    return full_activation_limit // 2
