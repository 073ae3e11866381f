"""Every random number generator a resumed run must continue: python's `random`, numpy's global
generator, torch's CPU (and CUDA) generators, and the session's sampling generator.

States go to checkpoints without pickling: python's and numpy's as JSON (lists of integers, floats that
JSON round-trips exactly), torch's as uint8 tensors for safetensors. A state read back is tried on a
scratch generator first, so a bad one fails loudly when the checkpoint is read, never half-way through
a restore. CUDA states that cannot be restored (no CUDA, fewer devices) are reported with a warning.
"""

from __future__ import annotations

import random
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor


@dataclass(frozen=True)
class RngStates:
    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch_cpu: Tensor
    sampling: Tensor
    cuda: list[Tensor] = field(default_factory=list)

    @classmethod
    def capture(cls, sampling: torch.Generator) -> RngStates:
        numpy_state = np.random.get_state(legacy=True)
        assert isinstance(numpy_state, tuple)
        cuda = list(torch.cuda.get_rng_state_all()) if torch.cuda.is_available() else []
        return cls(random.getstate(), numpy_state, torch.get_rng_state(), sampling.get_state(), cuda)

    def to_json(self) -> dict[str, Any]:
        version, internal, gauss = self.python
        algorithm, keys, pos, has_gauss, cached_gaussian = self.numpy
        return {
            "python": [version, list(internal), gauss],
            "numpy": {
                "algorithm": algorithm,
                "keys": keys.tolist(),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            },
        }

    def tensors(self) -> dict[str, Tensor]:
        return {
            "torch_cpu": self.torch_cpu,
            "sampling": self.sampling,
            **{f"cuda.{i}": s for i, s in enumerate(self.cuda)},
        }

    @classmethod
    def parse(cls, states: Mapping[str, Any], tensors: Mapping[str, Tensor]) -> RngStates:
        """Raises KeyError, TypeError, ValueError or RuntimeError for a state no generator accepts."""
        version, internal, gauss = states["python"]
        python_state = (version, tuple(internal), gauss)
        random.Random().setstate(python_state)
        saved = states["numpy"]
        numpy_state = (
            saved["algorithm"],
            np.asarray(saved["keys"], dtype=np.uint32),
            saved["pos"],
            saved["has_gauss"],
            saved["cached_gaussian"],
        )
        np.random.RandomState().set_state(numpy_state)
        for key in ("torch_cpu", "sampling"):
            torch.Generator().set_state(tensors[key])
        cuda = [tensors[f"cuda.{i}"] for i in range(sum(1 for key in tensors if key.startswith("cuda.")))]
        return cls(python_state, numpy_state, tensors["torch_cpu"], tensors["sampling"], cuda)

    def restore(self, sampling: torch.Generator, source: str) -> None:
        """Set every generator to its saved state; `source` names the checkpoint in the CUDA warning."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch_cpu)
        sampling.set_state(self.sampling)
        if not self.cuda:
            return
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available < len(self.cuda):
            warnings.warn(
                f"{source} holds CUDA RNG states for {len(self.cuda)} device(s) and this process has {available}: "
                "they are not restored, so CUDA random draws will differ from the saved run's",
                RuntimeWarning,
                stacklevel=3,
            )
            return
        for device, state in enumerate(self.cuda):
            torch.cuda.set_rng_state(state, device)
