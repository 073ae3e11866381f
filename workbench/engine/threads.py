"""How many CPU threads the engine's worker gives torch: the cores this process may use, less the cores
other processes keep busy, decided again before the worker's operations.

Why. On a CPU torch runs each parallel region on an OpenMP team whose threads spin at every barrier
until the slowest one arrives. When another process takes one of the team's cores (what a notebook user
always has beside the engine: the kernel's own threads, a browser, a tokenizer, a second session), the
team member that lost its core holds every region for a scheduler slice while the rest spin. Measured on
SmolLM2-135M, fp32, 2 cores (AMD EPYC), one other process busy on one core, seconds per operation,
quiet with torch's default of 2 threads → contended with 2 threads / with 1 thread:

    SFT step, one 38-token datum       0.32 →  1.11 / 0.43
    SFT step, 8 × 128 tokens           3.46 → 11.66 / 5.24
    sampling, 8 prompts × 4 × 16 tokens 2.09 → 18.79 / 3.44

Passive waiting instead of spinning (`OMP_WAIT_POLICY=PASSIVE`, which libgomp reads once, at load) is
not chosen: contended it is no better than one thread (0.54 s, 5.65 s, 3.79 s), and quiet it costs
9–42% (0.44 s, 3.76 s, 2.97 s). More threads than free cores is worse still. So the rule is one thread
per core nobody else is using:

    usable  = the CPUs in this process's affinity mask, capped by its cgroup's CPU quota
    others  = (busy CPU seconds of those CPUs − CPU seconds of this process and of its own engine
               processes, e.g. vLLM's) / wall seconds, since the previous decision
    threads = max(1, usable − ceil(others − BUSY_CORE_THRESHOLD))

decided before an operation when at least `DECISION_INTERVAL_S` have passed since the last decision
(reading two /proc files and calling `torch.set_num_threads` on the worker thread, which owns the only
OpenMP team). Quiet, this is torch's own default (one thread per usable core). Under a CPU quota the
busy time is the cgroup's, not the machine's: the other processes that matter are those sharing the
quota.

A pass over several datums (`forward_backward`, `forward`) does better than any thread count: it runs on
one single-threaded stream per usable core, which meet at no barrier (`workbench.engine.local.streams`);
the count above is what everything else uses (sampling, a one-datum step, the optimizer).

A user who sets the count gets exactly that, always (N threads, or N streams): `Session(threads=N)` /
`Engine(threads=N)`, or `OMP_NUM_THREADS`, which torch users expect to be obeyed. `Session.threads` and
the panel say what is in force and why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

# Another process counts as holding a core once it keeps this much of one busy.
BUSY_CORE_THRESHOLD = 0.4
# The shortest window the busy time is measured over (shorter operations reuse the last decision).
DECISION_INTERVAL_S = 0.5

CGROUP_ROOT = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class ThreadUse:
    """The thread count in force on the worker and why.

    Attributes:
        threads: torch threads the worker's operations use now.
        usable_cores: CPUs this process may run on (affinity mask, capped by the cgroup CPU quota).
        others_busy_cores: Cores' worth of CPU time other processes used over the last window (adaptive
            only; 0.0 before the first window).
        chosen_by: `"adaptive"`, `"threads="` (the session's argument) or `"OMP_NUM_THREADS"`.
        streams: Single-threaded streams a pass over several datums runs on
            (`workbench.engine.local.streams`); 1 where such a pass runs on the worker's threads (a GPU,
            or one thread set).
    """

    threads: int
    usable_cores: int
    others_busy_cores: float
    chosen_by: str
    streams: int

    def __str__(self) -> str:
        batches = f"; batches on {self.streams} streams" if self.streams > 1 else ""
        if self.chosen_by != "adaptive":
            return f"{self.threads} (set by {self.chosen_by}; {self.usable_cores} usable cores{batches})"
        return (
            f"{self.threads} of {self.usable_cores} usable cores "
            f"(other processes busy on {self.others_busy_cores:.1f}{batches})"
        )


def threads_for(usable_cores: int, others_busy_cores: float) -> int:
    """One thread per usable core that other processes leave free, at least one."""
    taken = max(0, math.ceil(others_busy_cores - BUSY_CORE_THRESHOLD))
    return max(1, usable_cores - taken)


# ---------------------------------------------------------------------------------- cgroup CPU quota


def _own_cgroup_dir(root: Path) -> Path:
    """This process's cgroup v2 folder (`0::/path` in /proc/self/cgroup); `root` where unknown."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            if line.startswith("0::"):
                own = root / line[3:].lstrip("/")
                if (own / "cpu.max").exists():
                    return own
    except OSError:
        pass
    return root


def cgroup_quota_cores(root: Path = CGROUP_ROOT) -> float | None:
    """The cgroup v2 CPU quota in cores (`cpu.max`: "quota period"), or None for no quota."""
    try:
        quota, period = (_own_cgroup_dir(root) / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def cgroup_usage_seconds(root: Path = CGROUP_ROOT) -> float | None:
    """CPU seconds the cgroup's processes have used (`cpu.stat`'s `usage_usec`), or None."""
    try:
        for line in (_own_cgroup_dir(root) / "cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value) / 1e6
    except (OSError, ValueError):
        pass
    return None


def usable_cpus() -> tuple[list[int], float | None]:
    """The CPUs in this process's affinity mask, and the cgroup quota in cores where it is the tighter
    bound (None otherwise)."""
    if sys.platform != "linux":
        return list(range(os.cpu_count() or 1)), None
    cpus = sorted(os.sched_getaffinity(0))
    quota = cgroup_quota_cores()
    return cpus, quota if quota is not None and quota < len(cpus) else None


# ---------------------------------------------------------------------------------- the busy meter


class OthersBusyMeter:
    """Cores' worth of CPU time that processes other than this one (and its own engine processes) used
    on the usable CPUs between two readings."""

    def __init__(self) -> None:
        self._cpus, self._quota = usable_cpus()
        self.own_processes: Callable[[], Iterable[psutil.Process]] = tuple  # e.g. vLLM's engine processes
        self._process = psutil.Process()
        self._last = self._reading()

    @property
    def usable_cores(self) -> int:
        return len(self._cpus) if self._quota is None else max(1, math.floor(self._quota))

    def _busy_seconds(self) -> float | None:
        """Busy CPU seconds of the usable CPUs so far; None off Linux (the policy then stays at all
        usable cores)."""
        if sys.platform != "linux":
            return None
        if self._quota is not None:
            return cgroup_usage_seconds()
        per_cpu = psutil.cpu_times(percpu=True)  # /proc/stat; steal and iowait are not busy
        return sum(
            t.user + t.nice + t.system + t.irq + t.softirq
            for cpu, t in enumerate(per_cpu)
            if cpu in self._cpus
        )

    def _own_seconds(self) -> float:
        total = sum(self._process.cpu_times()[:2])
        for process in self.own_processes():
            with contextlib.suppress(psutil.Error):  # ended since it was listed
                total += sum(process.cpu_times()[:2])
        return total

    def _reading(self) -> tuple[float, float | None, float]:
        return time.monotonic(), self._busy_seconds(), self._own_seconds()

    def seconds_since_reading(self) -> float:
        return time.monotonic() - self._last[0]

    def read(self) -> float:
        """Other processes' busy cores since the previous `read` (0.0 where the machine does not say)."""
        now = self._reading()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        if busy0 is None or busy1 is None or t1 <= t0:
            return 0.0
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))


# ---------------------------------------------------------------------------------- the policy


class ThreadPolicy:
    """Sets torch's thread count on the worker thread before its operations (see the module docstring).

    `apply()` runs on the worker thread only; `in_force` may be read from any thread. `on_cpu` False (the
    model is on a GPU): passes over several datums stay on the worker, one stream.
    """

    def __init__(self, threads: int | None, *, on_cpu: bool):
        self._meter = OthersBusyMeter()
        usable = self._meter.usable_cores
        from_env = os.environ.get("OMP_NUM_THREADS", "").strip()
        if threads is not None:
            fixed, chosen_by = threads, "threads="
        elif from_env.isdigit() and int(from_env) >= 1:
            fixed, chosen_by = int(from_env), "OMP_NUM_THREADS"
        else:
            fixed, chosen_by = None, "adaptive"
        self._fixed = fixed
        self._lock = threading.Lock()
        streams = (fixed or usable) if on_cpu else 1
        self._in_force = ThreadUse(fixed or usable, usable, 0.0, chosen_by, streams)
        self._applied: int | None = None

    def count_as_own(self, processes: Callable[[], Iterable[psutil.Process]]) -> None:
        """Count these processes' CPU time as this process's own (the engine's vLLM processes, which
        sample while the worker waits for them, and never beside its torch kernels)."""
        self._meter.own_processes = processes

    def keep_passes_on_the_worker(self) -> None:
        """Run passes over several datums on the worker's threads, one stream, whatever the cores: for a
        model whose forward pass changes a module while it runs (peft's expert adapters), which streams
        cannot share. `in_force` (the panel, `sess.threads`) then shows one stream."""
        with self._lock:
            self._in_force = dataclasses.replace(self._in_force, streams=1)

    @property
    def streams(self) -> int:
        """How many single-threaded streams a pass over several datums runs on
        (`workbench.engine.local.streams`): on a CPU the set count, else every usable core, busy or not
        (the scheduler shares the cores evenly between the streams and the busy process; no barrier
        waits); 1 on a GPU."""
        return self._in_force.streams

    @property
    def in_force(self) -> ThreadUse:
        with self._lock:
            return self._in_force

    def apply(self) -> None:
        """Decide (adaptive, once a window has passed) and set the count on the calling thread."""
        use = self.in_force
        if self._fixed is None and self._meter.seconds_since_reading() >= DECISION_INTERVAL_S:
            others = self._meter.read()
            use = dataclasses.replace(
                use, threads=threads_for(use.usable_cores, others), others_busy_cores=others
            )
            with self._lock:
                self._in_force = use
        if use.threads != self._applied:
            torch.set_num_threads(use.threads)
            self._applied = use.threads
