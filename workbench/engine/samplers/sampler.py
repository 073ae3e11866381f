"""What every sampler backend is to the engine: a `Sampler`, and a `SamplerBackend` row to start one.

The engine prepares requests (`requests.prepare_request`) and pins the weights they sample
(`PinnedWeights`); a `Sampler` generates them, and answers the rest of what the engine asks of it the
same way whatever runs underneath: the prompt logprobs `compute_logprobs` returns, the time it spent
making a set of weights its own (`sync_ms`), dropping weights no client can sample any more (`forget`,
`keep_only`), the processes it runs beside the engine's (`processes`, counted as the engine's CPU time)
and `close`. A backend that keeps no copy of the weights (HF `generate` on the training model) has
nothing to sync, and reports None.

What must be known before a sampler starts (whether it can run on this device, the models it refuses,
whether it samples for an engine on several devices, the memory it takes beside the training model,
for a memory budget) is its `SamplerBackend` row in the
factory (`workbench.engine.samplers.factory.SAMPLERS`), with the function that starts it. Every backend
starts from the same `SamplerStart`, which includes the training model's own sampler (HF `generate`
in-process): what a backend cannot report itself (a logprob under another temperature, the prompt's
scores), it computes with that one, under the same pinned weights.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Hashable, Iterable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import psutil
import torch

from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.samplers.requests import PreparedRequest, RequestResult

if TYPE_CHECKING:
    from workbench.engine.samplers.hf import HFSampler

SamplerChoice = str
"""`"auto"` or a key of the factory's `SAMPLERS` (`"hf"`, `"vllm"`, ...)."""


WriteAdapter = Callable[[Path], None]
"""Writes the adapter for a set of weights, in peft's format, into the given folder."""


@dataclass(frozen=True)
class PinnedWeights:
    """The weights a sample call runs under, as the engine pinned them, in the two forms a backend
    may take them: the training model put in their state, or their adapter written as a folder."""

    key: Hashable  # names them in a sampler's caches and adapter slots (`SamplerPin.weights_key`)
    is_base: bool  # the base model, adapters off: there is no adapter to write
    applied: Callable[[], AbstractContextManager[None]]  # the training model in these weights' state
    write_adapter: WriteAdapter  # their adapter, in peft's format, into the given folder


@dataclass(frozen=True)
class SamplerStart:
    """What any backend starts from: the base model, where and how it runs, and the training model's
    own sampler (HF `generate` on the live model, also the scorer a backend may lean on)."""

    model_path: str  # the base model's folder (or HF id), as the engine loaded it
    device: torch.device
    dtype: torch.dtype
    max_lora_rank: int  # the largest rank among the engine's models (8 before any)
    max_length: int  # the base model's context
    seed: int  # the engine's seed
    interrupted: threading.Event  # set by `Engine.interrupt_sampling`: generation stops between steps
    model_sampler: HFSampler
    # the engine's devices (1, or its rank count on several): a backend that spans devices (vLLM's
    # tensor parallelism) runs on all of them, `device` first; the others only on `device`
    devices: int = 1


class Sampler(Protocol):
    """A started sampler backend (see the module)."""

    def generate(self, requests: Sequence[PreparedRequest], weights: PinnedWeights) -> list[RequestResult]:
        """Sample every request under `weights`, telling each request's `token_sink` its tokens as they
        are drawn; raises `SamplingInterrupted` once `interrupted` is set."""
        ...

    def compute_logprobs(self, prompt: tuple[int, ...], weights: PinnedWeights) -> list[float | None]:
        """log p(token_i | tokens_<i) for every prompt token (None for the first), under `weights`."""
        ...

    def sync_ms(self, key: Hashable) -> float | None:
        """Milliseconds spent so far making `key`'s weights the sampler's own; None for a sampler that
        samples the training model itself (nothing to sync)."""
        ...

    def forget(self, key: Hashable) -> None:
        """Drop whatever the sampler keeps for weights no client can sample any more."""
        ...

    def keep_only(self, live: Iterable[Hashable]) -> None:
        """Forget every set of weights but the `live` ones."""
        ...

    @property
    def processes(self) -> Collection[psutil.Process]:
        """The processes the sampler started and runs beside the engine's."""
        ...

    def close(self) -> None:
        """Stop the sampler's processes and free what it holds; safe to call twice."""
        ...


@dataclass(frozen=True)
class Unavailable:
    """Why a backend cannot run here; `quiet` when that is the expected state of this machine (the
    `"auto"` choice then passes it over without a notice)."""

    reason: str
    quiet: bool = False


def runs_anywhere(_device: torch.device) -> Unavailable | None:
    return None


def samples_any_model(_info: BaseModelInfo) -> str | None:
    return None


def spreads_over_ranks(_devices: Sequence[torch.device], _sharded: bool) -> str | None:
    """A sampler whose engine spreads each call over the ranks itself (HF `generate`) runs on any."""
    return None


def one_device_only(_devices: Sequence[torch.device], _sharded: bool) -> str | None:
    return "it samples on one device"


def no_memory_of_its_own(_weights_bytes: int, _device: torch.device) -> int:
    """A sampler that samples the training model itself takes no memory beside it."""
    return 0


@dataclass(frozen=True)
class SamplerBackend:
    """A row of the factory: a backend and what must be known about it before it starts."""

    title: str  # how notices and errors name it
    start: Callable[[SamplerStart], Sampler]  # may be slow (a vLLM engine: most of a minute)
    # bytes it takes beside the training model, from the base model's weights, for a memory budget
    memory_bytes: Callable[[int, torch.device], int] = no_memory_of_its_own
    unavailable: Callable[[torch.device], Unavailable | None] = runs_anywhere
    refuses: Callable[[BaseModelInfo], str | None] = samples_any_model  # why it cannot sample a model
    # why it cannot sample for an engine on several devices (each rank's, and whether the base is
    # sharded over them), or None when it can
    on_ranks: Callable[[Sequence[torch.device], bool], str | None] = one_device_only
    preferred_by_auto: bool = False  # `"auto"` takes it when it can run here
