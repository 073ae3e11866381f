"""A shared-prefix pass through an HF decoder: the P prefixes once, then the R suffixes attending to
their group's prefix keys and values (Prefix Grouper, Liu et al. 2025, arXiv 2506.05433).

Two passes, each an ordinary call of the model with a `transformers` cache object:

1. the prefixes, (P, L_max), with a `_CapturingCache`: each attention layer hands it its keys and
   values and gets them straight back, so the pass computes what a pass without a cache does, and the
   cache keeps them (with their autograd history: not detached).
2. the suffixes, (R, S), with a `_PrefixedCache` over the captured keys and values, each datum's row
   taken from its group (`expand` for one group, so no copy): each layer attends to
   cat(prefix, suffix) keys, the attention mask covers prefix and suffix padding, and the position ids
   continue after each prefix.

Prefixes of different lengths are right-padded in the first pass (no query there sees only padding)
and left-aligned in the second: each group's keys and values are rotated so that its padding comes
first and its last prefix token sits just before its suffix. A sliding-window layer (Mistral, Gemma,
gpt-oss, Qwen2 with `use_sliding_window`) masks by the distance between a query's and a key's columns
in the cache, which is then their distance in the datum; right-padded, a suffix of a shorter prefix
would lose the window's first keys and see keys beyond it. Full attention is the same either way.

Backward through the second pass reaches the captured keys and values, and through them the prefix
pass: the prefix's gradient is the sum over its datums, as in G separate passes. Neither cache changes
what it holds during a pass, so a layer recomputed by activation checkpointing in backward gets the same
keys and values it got in forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import Cache, DynamicLayer

from workbench.engine.model.shared_prefix import SharedPrefixMicroBatch


class _CapturingLayer(DynamicLayer):
    """Keeps the keys and values of the layer's last call and returns them unchanged (no past)."""

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        self.keys, self.values = key_states, value_states
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0


class _CapturingCache(Cache):
    def __init__(self) -> None:
        super().__init__(layer_class_to_replicate=_CapturingLayer)


class _PrefixedLayer(DynamicLayer):
    """Puts fixed prefix keys and values before each call's own, keeping nothing of the call."""

    def __init__(self, keys: Tensor, values: Tensor):
        super().__init__()
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(
        self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any
    ) -> tuple[Tensor, Tensor]:
        assert self.keys is not None and self.values is not None
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def _left_aligned(states_P_H_L_D: Tensor, order_P_L: Tensor | None) -> Tensor:
    """A layer's captured keys or values with each group's columns in `order_P_L` (None: as they are)."""
    if order_P_L is None:
        return states_P_H_L_D
    heads, width = states_P_H_L_D.shape[1], states_P_H_L_D.shape[3]
    return states_P_H_L_D.gather(2, order_P_L[:, None, :, None].expand(-1, heads, -1, width))


def _prefixed_cache(keys_values: list[Tensor], row_group_R: Tensor, order_P_L: Tensor | None) -> Cache:
    """The prefixes' (P, …) keys and values, [keys, values] per layer, as (R, …), left-aligned by
    `order_P_L`: each datum's row from its group."""
    rows = row_group_R.shape[0]
    layers = []
    for keys, values in zip(keys_values[::2], keys_values[1::2], strict=True):
        keys, values = _left_aligned(keys, order_P_L), _left_aligned(values, order_P_L)
        if keys.shape[0] == 1:
            keys, values = keys.expand(rows, *keys.shape[1:]), values.expand(rows, *values.shape[1:])
        else:
            keys, values = keys.index_select(0, row_group_R), values.index_select(0, row_group_R)
        layers.append(_PrefixedLayer(keys, values))
    return Cache(layers=layers)


def _left_alignment(micro: SharedPrefixMicroBatch) -> Tensor | None:
    """For each group, the columns of its right-padded prefix in left-aligned order, (P, L_max): its
    padding, then its L tokens (column j reads column (j + L) mod L_max). None when every prefix of the
    pass fills L_max."""
    lengths = [group.prefix_length for group in micro.groups]
    longest = micro.prefix_ids_P_L.shape[1]
    if min(lengths) == longest:
        return None
    columns_P_L = torch.arange(longest)[None, :] + torch.tensor(lengths)[:, None]
    return (columns_P_L % longest).to(micro.prefix_ids_P_L.device)


def prefix_pass(forward: Callable[..., Tensor], micro: SharedPrefixMicroBatch) -> tuple[Tensor, list[Tensor]]:
    """`forward(**model_kwargs)` (a decoder's final hidden states, or a model's logits) for the
    prefixes, (P, L_max, F), and every layer's keys and values, [keys, values] per layer, as the layer
    made them (with their autograd history)."""
    captured = _CapturingCache()
    prefix_P_L_F = forward(
        input_ids=micro.prefix_ids_P_L,
        attention_mask=micro.prefix_mask_P_L,
        past_key_values=captured,
        use_cache=True,
    )
    keys_values = []
    for layer in captured.layers:
        assert layer.keys is not None and layer.values is not None
        keys_values.extend((layer.keys, layer.values))
    return prefix_P_L_F, keys_values


def suffix_pass(
    forward: Callable[..., Tensor], micro: SharedPrefixMicroBatch, keys_values: list[Tensor]
) -> Tensor:
    """`forward(**model_kwargs)` for the suffixes, (R, S, F), attending to their group's prefix keys and
    values (`prefix_pass`'s, or tensors equal to them)."""
    rows = micro.row_group_R
    order_P_L = _left_alignment(micro)
    prefix_mask_P_L = (
        micro.prefix_mask_P_L if order_P_L is None else micro.prefix_mask_P_L.gather(1, order_P_L)
    )
    return forward(
        input_ids=micro.suffix_ids_R_S,
        attention_mask=torch.cat([prefix_mask_P_L.index_select(0, rows), micro.suffix_mask_R_S], dim=1),
        position_ids=micro.position_ids_R_S,
        past_key_values=_prefixed_cache(keys_values, rows, order_P_L),
        use_cache=True,
    )
