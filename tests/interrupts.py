"""Ctrl-C as a kernel presses it, and a custom loss that holds the worker: for the tests that interrupt a
call while it runs or while it waits behind queued work (`tests/promises/test_reliability.py`, the
two-rank case in `tests/engine/test_devices.py`)."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import FrameType

import torch

import workbench as wb
from tests.datums import unweighted_datum

WAIT_S = 60.0
TOKENS = [5, 6, 7, 8, 9]
PACKAGE_DIR = os.path.dirname(wb.__file__) + os.sep


class Blocker:
    """A custom loss that holds the worker until `release()`: the operations queued behind it wait."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self._released = threading.Event()

    def __call__(self, data: list[wb.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        self.started.set()
        assert self._released.wait(WAIT_S), "the blocker was never released"
        return -logprobs[0].sum(), {}

    def hold(self, sess: wb.Session, data: Sequence[wb.Datum] | None = None) -> wb.APIFuture:
        """The blocking call on `sess`'s policy (over `data`, default one datum), once it runs."""
        future = sess.policy.forward_backward_custom(list(data or [unweighted_datum(TOKENS)]), self)
        assert self.started.wait(WAIT_S)
        return future

    def release(self) -> None:
        self._released.set()


def _blocked_in_workbench(frame: FrameType | None) -> bool:
    """The thread of this innermost frame is blocked in a wait that workbench's code called."""
    if frame is None or frame.f_code.co_name not in ("wait", "_wait_for_tstate_lock"):
        return False
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE_DIR):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def ctrl_c_once_waiting(
    before: Callable[[], None] = lambda: None, after: Callable[[], None] = lambda: None
) -> Iterator[None]:
    """Press Ctrl-C (SIGINT to the main thread, as the kernel's interrupt does) once the main thread is
    blocked in a wait inside workbench; `before` and `after` run on the interrupting thread around it."""
    main = threading.main_thread()
    assert threading.current_thread() is main

    def interrupt() -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if _blocked_in_workbench(sys._current_frames().get(main.ident)):
                break
            time.sleep(0.005)
        before()
        signal.pthread_kill(main.ident, signal.SIGINT)
        after()

    thread = threading.Thread(target=interrupt, name="ctrl-c")
    thread.start()
    try:
        yield
    finally:
        thread.join()
