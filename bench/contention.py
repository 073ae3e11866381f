"""A bounded busy process: a second process that keeps one CPU core busy while a benchmark runs.

The engine never has the machine to itself in a notebook: the Jupyter kernel's own threads (its
message loop, widget comms, plots being drawn), a vLLM worker sampling beside the trainer, a browser
rendering the notebook, all take CPU time while a step runs. On a CPU, torch's OpenMP threads
spin-wait at the barrier that ends each parallel region; when one of them has been descheduled to let
another process run, the rest of its team spins until it comes back, so a step of many small kernels
can slow far more than the share of CPU that was taken (10-35x on 2 cores with one core kept busy).
A benchmark that only runs on an idle machine never sees that, so each CPU benchmark measures twice,
"quiet" and "contended" (with this process running), and prints both.

The busy process is a pure-Python loop in its own interpreter (`sys.executable -c ...`): one thread, so
exactly one core's worth of demand. It ends on its own once its time bound passes or its parent is gone,
so a benchmark that crashes or is killed never leaves it spinning; leaving the context stops it. Its CPU
time over its lifetime is reported (`core_share`): 1.0 means it held a whole core throughout.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")
MODES = ("quiet", "contended")

# Spins until its bound or its parent's end; on SIGTERM (or at its bound) prints the CPU seconds it spun.
BUSY_LOOP = """
import os, signal, time
parent, end = os.getppid(), time.monotonic() + {bound_s!r}
def stop(*_):
    try:
        print(time.process_time() - started, flush=True)
    finally:
        os._exit(0)  # no flush at exit: a parent that is gone has closed the pipe
signal.signal(signal.SIGTERM, stop)
started = time.process_time()  # the share counts the spinning only, not the interpreter's start
print("busy", flush=True)
while time.monotonic() < end and os.getppid() == parent:
    pass
stop()
"""
# The contended run's time bound: this many times the quiet run's time, plus a margin. A measurement that
# outlasts it ends in an error rather than in figures taken half contended.
MAX_SLOWDOWN = 50.0
MARGIN_S = 60.0


@dataclass
class BusyCore:
    """The running busy process; `core_share` (its CPU seconds / wall seconds) is set when it stops."""

    process: subprocess.Popen[str]
    bound_s: float
    started: float
    core_share: float | None = None


@contextlib.contextmanager
def busy_core(bound_s: float) -> Iterator[BusyCore]:
    """Keep one core busy with a second process for the body of the `with` (at most `bound_s` seconds:
    past that the process has ended on its own, and leaving the context raises RuntimeError)."""
    process = subprocess.Popen(
        [sys.executable, "-I", "-c", BUSY_LOOP.format(bound_s=float(bound_s))],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "busy":  # spinning before the measurement starts
            raise RuntimeError(f"the busy process did not start (exit code {process.wait()})")
        busy = BusyCore(process, bound_s, time.monotonic())
        yield busy
        if process.poll() is not None:
            raise RuntimeError(
                f"the busy process reached its {bound_s:.0f} s bound before the measurement ended: "
                "the contended figures are not all contended"
            )
        process.send_signal(signal.SIGTERM)
        cpu_s = float(process.stdout.readline() or "nan")
        busy.core_share = cpu_s / (time.monotonic() - busy.started)
    finally:
        with contextlib.suppress(ProcessLookupError):
            process.kill()
        process.wait()
        process.stdout.close()


@dataclass(frozen=True)
class QuietAndContended(Generic[T]):
    """One measurement taken twice: on a quiet machine, then with one core kept busy."""

    quiet: T
    contended: T
    quiet_s: float  # wall seconds the quiet measurement took
    contended_s: float
    busy_core_share: float  # the CPU share the busy process got meanwhile (1.0: a whole core)

    def describe(self) -> str:
        return (
            f"contended: a second process kept one core busy (it got {self.busy_core_share:.2f} of a core; "
            f"{os.cpu_count()} cores); the whole measurement took {self.quiet_s:.1f} s quiet, "
            f"{self.contended_s:.1f} s contended"
        )


def quiet_and_contended(measure: Callable[[], T]) -> QuietAndContended[T]:
    """Run `measure` once on the quiet machine, then once with `busy_core` running, and return both.

    The busy process's bound is MAX_SLOWDOWN x the quiet run's time plus MARGIN_S."""
    start = time.monotonic()
    quiet = measure()
    quiet_s = time.monotonic() - start
    with busy_core(MAX_SLOWDOWN * quiet_s + MARGIN_S) as busy:
        start = time.monotonic()
        contended = measure()
        contended_s = time.monotonic() - start
    assert busy.core_share is not None
    return QuietAndContended(quiet, contended, quiet_s, contended_s, busy.core_share)
