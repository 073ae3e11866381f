"""The HF sampler's prompt cache across calls: a bounded LRU of prompts' keys and values, keyed by the
weights and the tokens, so a prompt that starts like an earlier one prefills only what follows.

A multi-turn rollout's turn k + 1 prompt is turn k's prompt, its reply and the next message; without
the cache every turn prefills the whole conversation again. Keys and values at a position depend only
on the tokens up to it (causal attention) and on the weights, so an entry is found by the longest
common token prefix among the entries of the same weights (`SamplerPin.weights_key`: run, version,
adapter), and its first tokens' keys and values are those of the new prompt. Entries of weights no
client can sample any more are dropped (`keep_only`); the total size is bounded by `max_bytes`, least
recently used first out.

Notation: H key-value heads, Q cached positions, D head size; one (keys, values) pair per layer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from torch import Tensor

from workbench.engine.model.shared_prefix import common_prefix_length

# Bytes of keys and values the cache holds at most: 512 MiB, about 11,000 tokens of SmolLM2-135M in fp32.
PREFIX_CACHE_BYTES = 512 * 2**20

LayerKeyValues = list[tuple[Tensor, Tensor]]
"""One prompt's keys and values, (H, Q, D) each, per layer."""


@dataclass
class PrefixCacheStats:
    """Since the sampler started: prompt tokens to prefill, those that came from the cache, those
    computed (fewer than the rest where prompts of one call shared a header, computed once:
    `HFSampler`), and the requests that found a cached prefix."""

    prompt_tokens: int = 0
    cached_tokens: int = 0
    computed_tokens: int = 0
    requests: int = 0
    hits: int = 0

    @property
    def hit_rate(self) -> float:
        """The share of prompt tokens the cache supplied."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class PromptPrefixCache:
    """An LRU of (weights, tokens) → per-layer keys and values, within `max_bytes`."""

    def __init__(self, max_bytes: int = PREFIX_CACHE_BYTES):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[tuple[Hashable, tuple[int, ...]], LayerKeyValues] = OrderedDict()
        self.bytes = 0
        self.stats = PrefixCacheStats()

    def longest(self, weights: Hashable, tokens: Sequence[int]) -> tuple[int, LayerKeyValues | None]:
        """The most leading `tokens` a cached entry of these weights shares, and that entry's keys and
        values cut to them (0 and None when none shares any); the entry becomes the most recent."""
        query = np.asarray(tokens)
        best, best_key = 0, None
        for key in self.entries:
            if key[0] != weights:
                continue
            shared = common_prefix_length(np.asarray(key[1]), query)
            if shared > best:
                best, best_key = shared, key
        if best_key is None:
            return 0, None
        self.entries.move_to_end(best_key)
        return best, [(k[:, :best], v[:, :best]) for k, v in self.entries[best_key]]

    def put(self, weights: Hashable, tokens: Sequence[int], keys_values: LayerKeyValues) -> None:
        """Keep a prompt's keys and values (detached copies are the caller's), evicting the least
        recently used entries beyond `max_bytes`; an entry larger than that is not kept."""
        size = sum(k.nbytes + v.nbytes for k, v in keys_values)
        key = (weights, tuple(tokens))
        if key in self.entries:
            self.entries.move_to_end(key)
            return
        if size > self.max_bytes:
            return
        self.entries[key] = keys_values
        self.bytes += size
        while self.bytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def keep_only(self, live: Iterable[Hashable]) -> None:
        """Drop every entry of weights not in `live` (weights no client can sample any more)."""
        keep = set(live)
        for key in [key for key in self.entries if key[0] not in keep]:
            self._drop(key)

    def _drop(self, key: tuple[Hashable, tuple[int, ...]]) -> None:
        self.bytes -= sum(k.nbytes + v.nbytes for k, v in self.entries.pop(key))

    def count(self, prompt_tokens: int, cached_tokens: int, shared_tokens: int) -> None:
        """Count one request's prefill: `prompt_tokens` to prefill, `cached_tokens` of them cached and
        `shared_tokens` computed for another prompt of its call."""
        self.stats.prompt_tokens += prompt_tokens
        self.stats.cached_tokens += cached_tokens
        self.stats.computed_tokens += prompt_tokens - cached_tokens - shared_tokens
        self.stats.requests += 1
        self.stats.hits += cached_tokens > 0
