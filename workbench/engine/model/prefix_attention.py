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


def _prefixed_cache(captured: _CapturingCache, row_group_R: Tensor) -> Cache:
    """The captured (P, …) keys and values as (R, …): each datum's row from its group."""
    rows = row_group_R.shape[0]
    layers = []
    for layer in captured.layers:
        assert layer.keys is not None and layer.values is not None
        if layer.keys.shape[0] == 1:
            keys = layer.keys.expand(rows, *layer.keys.shape[1:])
            values = layer.values.expand(rows, *layer.values.shape[1:])
        else:
            keys, values = layer.keys.index_select(0, row_group_R), layer.values.index_select(0, row_group_R)
        layers.append(_PrefixedLayer(keys, values))
    return Cache(layers=layers)


def shared_prefix_pass(
    forward: Callable[..., Tensor], micro: SharedPrefixMicroBatch
) -> tuple[Tensor, Tensor]:
    """`forward(**model_kwargs)` (a decoder's final hidden states, or a model's logits) for the
    prefixes, (P, L_max, F), and for the suffixes after them, (R, S, F)."""
    captured = _CapturingCache()
    prefix_P_L_F = forward(
        input_ids=micro.prefix_ids_P_L,
        attention_mask=micro.prefix_mask_P_L,
        past_key_values=captured,
        use_cache=True,
    )
    rows = micro.row_group_R
    suffix_R_S_F = forward(
        input_ids=micro.suffix_ids_R_S,
        attention_mask=torch.cat([micro.prefix_mask_P_L.index_select(0, rows), micro.suffix_mask_R_S], dim=1),
        position_ids=micro.position_ids_R_S,
        past_key_values=_prefixed_cache(captured, rows),
        use_cache=True,
    )
    return prefix_P_L_F, suffix_R_S_F
