"""What the process uses, measured at each optimizer step: its memory, its CPU time, the GPU's memory.

W&B and TensorBoard users read a run's system charts beside its loss: a step that got slower because
the machine swapped, a memory leak that grows with every batch, a GPU that sits half empty. The local
engine records them in each `optim_step` row of the history (so in `history.jsonl` and W&B), under
`system/`, one value per optimizer step:

- `system/rss_mb`: the process's resident memory (psutil's RSS), in MiB;
- `system/cpu_percent`: the process's CPU time since the previous step over the wall time since then,
  in percent of one core (200 = two cores busy throughout);
- `system/cuda_allocated_mb`, `system/cuda_reserved_mb`, `system/cuda_peak_mb`: on a CUDA device, the
  memory torch's caching allocator holds for tensors, the memory it reserved from the driver, and the
  most it held for tensors since the process started (the peak is never reset here: a benchmark's
  `torch.cuda.reset_peak_memory_stats` stays its own).

A reading costs two system calls and, on CUDA, three counters of the allocator (no synchronisation):
tens of microseconds a step.
"""

from __future__ import annotations

import time

import psutil
import torch

MIB = 2**20


class ResourceMeter:
    """Reads the process's resource use; `cpu_percent` covers the time since the previous reading."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._process = psutil.Process()
        self._cpu_seconds = self._cpu_time()
        self._at = time.monotonic()

    def _cpu_time(self) -> float:
        times = self._process.cpu_times()
        return times.user + times.system

    def read(self) -> dict[str, float]:
        """The `system/` metrics now (see the module docstring)."""
        cpu_seconds, now = self._cpu_time(), time.monotonic()
        elapsed = now - self._at
        cpu_percent = 100.0 * (cpu_seconds - self._cpu_seconds) / elapsed if elapsed > 0 else 0.0
        self._cpu_seconds, self._at = cpu_seconds, now
        metrics = {"system/rss_mb": self._process.memory_info().rss / MIB, "system/cpu_percent": cpu_percent}
        if self.device.type == "cuda":
            metrics |= {
                "system/cuda_allocated_mb": torch.cuda.memory_allocated(self.device) / MIB,
                "system/cuda_reserved_mb": torch.cuda.memory_reserved(self.device) / MIB,
                "system/cuda_peak_mb": torch.cuda.max_memory_allocated(self.device) / MIB,
            }
        return metrics
