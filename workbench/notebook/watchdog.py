"""The watchdog: a run step that has run far past its expected time is named, with what it waits on.

A step function blocked for good (a reward server that never answers, an `Event` never set, a future
of an operation stuck on the worker) looks, from the notebook, like a slow step: the progress bar
stops and `run.wait()` blocks. The watchdog tells the two apart by the step's own history: a step is
stalled once it has run `factor` times the median of the run's recent step times, and at least
`floor_s` (the first steps, with no history, get the floor alone). A stall names the step, how long
it has run against what was expected, and the stacks it waits in: the run thread's (the step
function's own frames) and those of the engine worker threads that are busy (`workbench-worker`,
`workbench-remote`; see `workbench.engine.worker`), read with `sys._current_frames`.

`run.stall` reports it, the panel's progress line shows it, and `run.wait()` stops waiting on it.
Both thresholds are the `Watchdog`'s fields, so a test sets them instead of depending on how fast the
machine is.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import sysconfig
import threading
import traceback
from collections.abc import Sequence

WORKER_THREAD_PREFIXES = ("workbench-worker", "workbench-remote")
"""The names of engine worker threads (`Worker(name=...)`)."""
IDLE_WORKER_FUNCTION = "_next"
"""A worker whose innermost Python frame is `Worker._next` waits on its queue for work."""
RECENT_STEPS = 10
STDLIB = sysconfig.get_paths()["stdlib"]


@dataclasses.dataclass(frozen=True)
class Stall:
    """A step that has run past its expected time, and where it waits."""

    step: int
    seconds: float  # how long the step has run
    expected_s: float  # the watchdog's threshold for it
    run_stack: str  # the run thread's stack, innermost frame last
    worker_stacks: dict[str, str]  # busy engine worker threads' stacks, by thread name

    @property
    def waiting_in(self) -> str:
        """The innermost frame of the run thread: `file:line in function`."""
        return _innermost(self.run_stack)

    def __str__(self) -> str:
        workers = "; ".join(f"{name} in {_innermost(stack)}" for name, stack in self.worker_stacks.items())
        return (
            f"step {self.step} has run {self.seconds:.1f}s (expected under {self.expected_s:.1f}s): "
            f"waiting in {self.waiting_in}" + (f"; {workers}" if workers else "; the engine worker is idle")
        )


@dataclasses.dataclass(frozen=True)
class Watchdog:
    """When a step counts as stalled: past `factor` × the median of the recent step times, and past
    `floor_s` (the threshold of a step with no history)."""

    floor_s: float = 120.0
    factor: float = 10.0

    def expected_s(self, recent_seconds: Sequence[float]) -> float:
        recent = list(recent_seconds)[-RECENT_STEPS:]
        return max(self.floor_s, self.factor * statistics.median(recent)) if recent else self.floor_s

    def check(
        self, step: int, seconds: float, recent_seconds: Sequence[float], run_thread: threading.Thread
    ) -> Stall | None:
        """The stall of the step that has run `seconds` on `run_thread`, or None while it is in time."""
        expected = self.expected_s(recent_seconds)
        if seconds <= expected:
            return None
        return Stall(step, seconds, expected, thread_stack(run_thread) or "", busy_worker_stacks())


def thread_stack(thread: threading.Thread) -> str | None:
    """The formatted stack of a live thread, innermost frame last (None once it has ended)."""
    frames = sys._current_frames()  # noqa: SLF001 (the documented way to read another thread's stack)
    frame = frames.get(thread.ident) if thread.ident is not None else None
    return None if frame is None else "".join(traceback.format_stack(frame))


def busy_worker_stacks() -> dict[str, str]:
    """The stacks of the engine worker threads that are running an operation (not waiting for one)."""
    frames = sys._current_frames()  # noqa: SLF001 (the documented way to read another thread's stack)
    stacks: dict[str, str] = {}
    for thread in threading.enumerate():
        frame = frames.get(thread.ident) if thread.ident is not None else None
        if frame is None or not thread.name.startswith(WORKER_THREAD_PREFIXES):
            continue
        if frame.f_code.co_name == IDLE_WORKER_FUNCTION:
            continue
        stacks[f"{thread.name} ({thread.ident})"] = "".join(traceback.format_stack(frame))
    return stacks


def _innermost(stack: str) -> str:
    """`file:line in function` of a formatted stack's innermost frame outside the standard library
    (where a step waits on an Event or a future, that frame is the caller's: what it waits for)."""
    frames = [line.strip() for line in stack.splitlines() if line.strip().startswith('File "')]
    own = [frame for frame in frames if not frame[len('File "') :].startswith(STDLIB)] or frames
    if not own:
        return "an unknown frame"
    path, _, rest = own[-1][len('File "') :].partition('", line ')
    number, _, function = rest.partition(", in ")
    return f"{path.rsplit('/', 1)[-1]}:{number} in {function}"
