"""The watchdog: a run step blocked far past its expected time is named, with the stacks it waits in
(the run thread's, and a busy engine worker's), in `run.stall`, the progress line and `run.wait()`,
which stops waiting instead of blocking for good. Thresholds are set small, so no margin depends on
the machine's speed: the blocked step waits on an Event the test sets only after the checks."""

from __future__ import annotations

import threading
import time

import pytest

import workbench as wb
from tests.datums import sft_datum
from workbench.notebook.panel.progress_line import run_alerts
from workbench.notebook.watchdog import Watchdog

WAIT_S = 60.0
WATCHDOG = Watchdog(floor_s=0.5, factor=5.0)


def test_the_threshold_is_a_multiple_of_the_recent_median_with_a_floor() -> None:
    assert Watchdog(floor_s=2.0, factor=10.0).expected_s([]) == 2.0
    assert Watchdog(floor_s=2.0, factor=10.0).expected_s([0.1, 0.1, 9.0]) == 2.0
    assert Watchdog(floor_s=2.0, factor=10.0).expected_s([1.0, 1.0, 9.0]) == 10.0


def test_a_step_blocked_in_the_step_function_is_named_and_wait_stops_waiting(tiny: wb.Session) -> None:
    release = threading.Event()

    def blocking_step(sess: wb.Session, i: int) -> None:
        if i == 2:
            release.wait(WAIT_S)

    run = tiny.run(blocking_step, 4, paused=True)
    run.watchdog = WATCHDOG
    try:
        run.resume()
        started = time.monotonic()
        with pytest.warns(RuntimeWarning, match=r"stopped waiting: step 2 has run"):
            assert run.wait(WAIT_S) is wb.RunState.RUNNING
        assert time.monotonic() - started < WAIT_S / 2  # named within its window, not at the timeout
        stall = run.stall
        assert stall is not None and stall.step == 2 and stall.seconds > WATCHDOG.floor_s
        assert "in blocking_step" in stall.run_stack and stall.waiting_in.endswith("in blocking_step")
        assert dict(run_alerts(run))["stall"].startswith("stalled: step 2 has run")
    finally:
        release.set()
    assert run.wait(WAIT_S) is wb.RunState.FINISHED and run.stall is None


def test_a_step_waiting_on_a_blocked_worker_operation_names_the_worker_stack(tiny: wb.Session) -> None:
    release = threading.Event()

    def blocked_loss(data: list, logprobs: list) -> tuple:
        release.wait(WAIT_S)
        return -logprobs[0].sum(), {}

    def step(sess: wb.Session, i: int) -> None:
        datum = sft_datum(sess.tokenizer, "User: hi.", " Assistant: hello.")
        sess.policy.forward_backward_custom([datum], blocked_loss).result()

    run = tiny.run(step, 1, paused=True)
    run.watchdog = WATCHDOG
    try:
        run.resume()
        with pytest.warns(RuntimeWarning, match="stopped waiting: step 0"):
            assert run.wait(WAIT_S) is wb.RunState.RUNNING
        stall = run.stall
        assert stall is not None
        assert any("in blocked_loss" in stack for stack in stall.worker_stacks.values()), stall.worker_stacks
        assert "blocked_loss" in str(stall)
    finally:
        release.set()
    assert run.wait(WAIT_S) is wb.RunState.FINISHED
