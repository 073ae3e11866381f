"""Weight versions that sampling clients are pinned to (Tinker's snapshot semantics).

A sampling client samples the weights it was created from, even after later optimizer steps. Pinning
the current weights costs nothing: the live adapter is used in place. Only when the weights are about
to change while a client is pinned to them (`before_change`, called right before an optimizer step or
a load) are the adapter's tensors copied, once per version; the copy is dropped when the last client
pinned to that version is released. Sampling an older version swaps its copy into the adapter for the
duration of the call and restores the live tensors afterwards, bit for bit, whatever happens in between.

Every method but `pinned_versions` and `held_bytes` runs on the engine's worker thread, in order with
the optimizer steps: a pin taken there always sees the version the queued operations before it left,
and no release can drop weights a later pin was promised. Releases reach the worker through its
lock-free `post`, so a client collected by the garbage collector at any moment never takes a lock the
worker may hold.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator

import torch
from torch import Tensor, nn


class WeightSnapshots:
    """Copy-on-write copies of one adapter's tensors, for the versions live clients are pinned to."""

    def __init__(self, parameters: dict[str, nn.Parameter]):
        self._parameters = parameters
        self._pins: Counter[int] = Counter()
        self._copies: dict[int, dict[str, Tensor]] = {}

    def pin(self, version: int) -> None:
        self._pins[version] += 1

    def unpin(self, version: int) -> None:
        self._pins[version] -= 1
        if self._pins[version] <= 0:
            del self._pins[version]
            self._copies.pop(version, None)

    def pinned_versions(self) -> list[int]:
        """The versions live clients are pinned to (safe to call from any thread)."""
        return sorted(self._pins.copy())

    def held_bytes(self) -> int:
        """Memory held by copies of past versions (safe to call from any thread)."""
        return sum(
            t.numel() * t.element_size() for copy in list(self._copies.values()) for t in copy.values()
        )

    def before_change(self, current_version: int) -> None:
        """Keep a copy of the current weights if a live client is pinned to them."""
        if self._pins[current_version] > 0 and current_version not in self._copies:
            self._copies[current_version] = {name: p.detach().clone() for name, p in self._parameters.items()}

    def is_available(self, version: int, current_version: int) -> bool:
        return version == current_version or version in self._copies

    @contextlib.contextmanager
    def weights(self, version: int, current_version: int) -> Iterator[None]:
        """Run the body with the adapter holding `version`'s weights; the live ones come back after."""
        if version == current_version:
            yield
            return
        copy = self._copies.get(version)
        if copy is None:
            raise ValueError(
                f"the weights of version {version} are no longer held (no live client is pinned to them)"
            )
        live = {name: p.detach().clone() for name, p in self._parameters.items()}
        try:
            with torch.no_grad():
                for name, param in self._parameters.items():
                    param.copy_(copy[name])
            yield
        finally:
            with torch.no_grad():
                for name, param in self._parameters.items():
                    param.copy_(live[name])
