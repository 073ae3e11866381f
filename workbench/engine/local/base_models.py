"""The base models one process holds: an engine per base model, loaded on first use, within a budget.

A researcher's recipe names several base models (a student and its teacher, a policy and its grader,
a KL reference of another size), and one GPU holds them side by side. `BaseModels` is the one place
that maps a base model to its `Engine`: the in-process `ServiceClient`, a `Session`'s service clients
and the server all ask it, so a teacher loaded for one is there for the others (`sess.serve()` serves
what the session's service clients loaded).

A base model is named by its alias, folder or HF id; the key is the folder (`resolve_model_path`), so
`"tiny"` and the tiny model's folder are one engine. Which names a caller may load is the caller's
choice (in-process any; a server only those it allows). `memory_budget_bytes` bounds what the engines
hold together:

    held(engine) = Σ_tensors numel · element_size + share(engine)   (parameters and buffers, adapters
                                                                      included; its sampler's share)
    need(new) = weights + share(new),  weights = Σ_parameters numel · element_size(dtype)
                                                                     (counted on the meta device, nothing loaded;
                                                                      a quantized base's linear weights at their
                                                                      4 or 8 bits and scales)
    share = `samplers.factory.sampler_memory_bytes(sampler, weights, device)`: what the engine's
            sampler backend takes beside the training model (vLLM its own copy and KV cache; HF 0)

An engine is counted with its sampler's share from the start (a sampler with an engine of its own
starts at its first sample), so a budget that admits it holds it whenever it samples.

A load that would take `held + need` past the budget first closes idle engines (no model on them; the
least recently used first, never the first engine, the session's), then, if it still does not fit,
is refused with a `MemoryBudgetError` naming the budget and what holds it. A sampling client of an
evicted engine's base fails with the closed engine's error; a new one loads the base again.
"""

from __future__ import annotations

import functools
import threading
import time
from dataclasses import dataclass

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from workbench.engine.config import DEFAULT_MAX_MODELS, QuantizationConfig, to_quantization_config
from workbench.engine.local.engine import Engine
from workbench.engine.model.base_model import resolve_device_and_dtype, resolve_model_path
from workbench.engine.model.quantization import quantized_model_bytes
from workbench.engine.samplers import SamplerChoice
from workbench.engine.samplers.factory import SAMPLERS, choose_sampler, sampler_memory_bytes

GIB = 1024**3
SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 1024, "MIB": 1024**2, "GIB": GIB}


class MemoryBudgetError(ValueError):
    """A base model that would not fit in the memory budget beside the ones that must stay."""


def parse_size(text: str) -> int:
    """Bytes from `"24GiB"`, `"500MB"`, `"2e9"` (units: B, KB, MB, GB, KiB, MiB, GiB)."""
    stripped = text.strip().upper().replace(" ", "")
    number = stripped.rstrip("BKMGI")
    unit = stripped[len(number) :]
    if unit not in SIZE_UNITS or not number:
        raise ValueError(f"a memory size is a number with B, KB, MB, GB, KiB, MiB or GiB, got {text!r}")
    value = float(number) * SIZE_UNITS[unit]
    if not value > 0:
        raise ValueError(f"a memory size must be > 0, got {text!r}")
    return int(value)


def format_size(size: int) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB / 10 else f"{size / 1024**2:.1f} MiB"


def engine_bytes(engine: Engine) -> int:
    """What an engine holds: every parameter and buffer of its model (the base and its adapters), and
    its sampler's share (`sampler_bytes`)."""
    return model_bytes(engine) + sampler_bytes(engine)


def model_bytes(engine: Engine) -> int:
    """What an engine's model holds: every parameter and buffer (the base and its adapters)."""
    module = engine.torch_model
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def sampler_bytes(engine: Engine) -> int:
    """The sampler's share of an engine (see the module); 0 for one that samples the training model."""
    device, dtype = resolve_device_and_dtype(engine.config.device, engine.config.dtype)
    weights = base_model_bytes(engine.base_info.path, dtype, engine.config.quantization)
    return sampler_memory_bytes(engine.config.sampler, weights, device)


@functools.cache
def base_model_bytes(
    base_model: str, dtype: torch.dtype, quantization: QuantizationConfig | None = None
) -> int:
    """The weights a base model will hold in `dtype`, counted from its config on the meta device; a
    quantized base's linear weights as bitsandbytes stores them (`quantized_model_bytes`)."""
    config = AutoConfig.from_pretrained(resolve_model_path(base_model))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    if quantization is not None:
        return quantized_model_bytes(model, quantization, dtype)
    element = torch.empty((), dtype=dtype).element_size()
    return sum(p.numel() for p in model.parameters()) * element


@dataclass(frozen=True)
class Holding:
    """A loaded base model as the refusal, the panel and the capabilities describe it."""

    base_model: str
    path: str
    bytes: int
    sampler_bytes: int  # its sampler's share of `bytes`
    models: int
    evictable: bool
    sampler: str  # the engine's sampler backend (a key of `factory.SAMPLERS`)

    def describe(self) -> str:
        models = f"{self.models} model{'s' if self.models != 1 else ''}"
        share = ""
        if self.sampler_bytes:
            share = f", {format_size(self.sampler_bytes)} of it {SAMPLERS[self.sampler].title}'s"
        return f"{self.base_model!r} holds {format_size(self.bytes)} ({models}{share})"


class BaseModels:
    """Engines by base model, loaded on first use, within an optional memory budget.

    Args:
        first: The engine that is always there (a session's); it is never evicted nor closed here.
        memory_budget_bytes: What the engines' weights may hold together; None for no bound.
        device, dtype, sampler, seed, max_models, threads, quantize: The settings of engines loaded here
            (with `first`, its own unless given).
    """

    def __init__(
        self,
        first: Engine | None = None,
        *,
        memory_budget_bytes: int | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        sampler: SamplerChoice | None = None,
        seed: int | None = None,
        max_models: int | None = None,
        threads: int | None = None,
        quantize: str | QuantizationConfig | None = None,
    ):
        if memory_budget_bytes is not None and memory_budget_bytes <= 0:
            raise ValueError(f"memory_budget_bytes must be > 0, got {memory_budget_bytes!r}")
        config = first.config if first is not None else None
        self.device, self.dtype = resolve_device_and_dtype(
            device if device is not None or config is None else config.device,
            dtype if dtype is not None or config is None else config.dtype,
        )
        self.sampler: SamplerChoice = sampler or ("hf" if config is None else config.sampler)
        self.seed = seed if seed is not None else (0 if config is None else config.seed)
        self.max_models = max_models or (DEFAULT_MAX_MODELS if config is None else config.max_models)
        self.threads = threads if threads is not None or config is None else config.threads
        self.quantization = (
            to_quantization_config(quantize)
            if quantize is not None or config is None
            else config.quantization
        )
        self.memory_budget_bytes = memory_budget_bytes
        self._engines: dict[str, Engine] = {}  # by folder (or HF id), oldest first
        self._last_used: dict[str, float] = {}
        self._first = None if first is None else first.base_info.path
        self._lock = threading.RLock()  # loads are slow: one at a time, and never the same base twice
        if first is not None:
            self._engines[first.base_info.path] = first
            self._last_used[first.base_info.path] = time.monotonic()

    # ------------------------------------------------------------------------------------------ lookup

    def find(self, base_model: str) -> Engine | None:
        """The engine of a loaded base model (alias, folder or HF id), or None."""
        key = resolve_model_path(base_model)
        engine = self._engines.get(key)
        if engine is None or engine.closed:
            return None
        self._last_used[key] = time.monotonic()
        return engine

    def engine(self, base_model: str) -> Engine:
        """The engine for `base_model`, loaded now if it is not yet, evicting idle engines to make room
        within the budget (see the module)."""
        with self._lock:
            found = self.find(base_model)
            if found is not None:
                return found
            key = resolve_model_path(base_model)
            if self.memory_budget_bytes is not None:
                weights = base_model_bytes(base_model, self.dtype, self.quantization)
                sampler = choose_sampler(self.sampler, self.device)
                share = sampler_memory_bytes(sampler, weights, self.device)
                self._make_room(base_model, weights + share, share, sampler)
            engine = Engine(
                base_model,
                seed=self.seed,
                device=self.device,
                dtype=self.dtype,
                sampler=self.sampler,
                max_models=self.max_models,
                threads=self.threads,
                quantize=self.quantization,
            )
            self._engines[key] = engine
            self._last_used[key] = time.monotonic()
            return engine

    def engines(self) -> list[Engine]:
        """The loaded engines, the first one first."""
        return [
            e for e in list(self._engines.values()) if not e.closed
        ]  # a snapshot: loads run on other threads

    def holdings(self) -> list[Holding]:
        """What each loaded base model holds, the first one first."""
        holdings = []
        for key, engine in list(self._engines.items()):
            if engine.closed:
                continue
            share = sampler_bytes(engine)
            holdings.append(
                Holding(
                    engine.config.base_model,
                    engine.base_info.path,
                    model_bytes(engine) + share,
                    share,
                    len(engine.model_ids()),
                    self._evictable(key, engine),
                    engine.config.sampler,
                )
            )
        return holdings

    def held_bytes(self) -> int:
        return sum(h.bytes for h in self.holdings())

    # ------------------------------------------------------------------------------------------ budget

    def _evictable(self, key: str, engine: Engine) -> bool:
        return key != self._first and not engine.model_ids()

    def _make_room(self, base_model: str, need: int, share: int, sampler: str) -> None:
        budget = self.memory_budget_bytes
        assert budget is not None
        needs = f"loading {base_model!r} needs about {format_size(need)}"
        if share:
            needs += f" ({format_size(share)} of it for its {SAMPLERS[sampler].title} sampler)"
        if need > budget:
            raise MemoryBudgetError(f"{needs}, more than the whole memory budget of {format_size(budget)}")
        idle = sorted(
            (key for key, engine in self._engines.items() if self._evictable(key, engine)),
            key=self._last_used.__getitem__,
        )
        kept = [h for h in self.holdings() if not h.evictable]
        if sum(h.bytes for h in kept) + need > budget:
            held = "; ".join(h.describe() for h in kept)
            raise MemoryBudgetError(
                f"{needs}, and the memory budget of "
                f"{format_size(budget)} has {format_size(budget - sum(h.bytes for h in kept))} left "
                f"beside the base models in use: {held}. Free their models (close their clients) or "
                "raise the budget"
            )
        for key in idle:
            if self.held_bytes() + need <= budget:
                break
            self._engines.pop(key).close()
            del self._last_used[key]

    # ------------------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every engine loaded here (the first one is its owner's)."""
        with self._lock:
            for key, engine in list(self._engines.items()):
                if key != self._first:
                    engine.close()
                    del self._engines[key]

    def __repr__(self) -> str:
        held = ", ".join(f"{h.base_model} {format_size(h.bytes)}" for h in self.holdings())
        budget = "" if self.memory_budget_bytes is None else f" of {format_size(self.memory_budget_bytes)}"
        return f"BaseModels({held}{budget})"
