"""Background runs: `sess.run(step_fn, steps)` returns at once; pause / step / resume / stop / set act
between steps; a failing step function fails the run and keeps its traceback."""

from __future__ import annotations

import threading

import pytest

import workbench as wb
from tests.datums import sft_datum
from workbench.notebook.run import RUN_MODEL, RunActiveError, RunState, train_step

WAIT_S = 30.0


def _data(sess: wb.Session) -> list[wb.Datum]:
    return [sft_datum(sess.tokenizer, "User: Hello!", " Assistant: Hi there.")]


class Gate:
    """A step function whose step `i` waits until the test opens gate `i`, and records what it saw."""

    def __init__(self) -> None:
        self.opened: dict[int, threading.Event] = {}
        self.entered: dict[int, threading.Event] = {}
        self.seen: list[tuple[int, str, float]] = []

    def _event(self, table: dict[int, threading.Event], i: int) -> threading.Event:
        return table.setdefault(i, threading.Event())

    def open(self, *indices: int) -> None:
        for i in indices:
            self._event(self.opened, i).set()

    def wait_entered(self, i: int) -> None:
        assert self._event(self.entered, i).wait(WAIT_S), f"step {i} never started"

    def __call__(self, sess: wb.Session, i: int) -> dict[str, float]:
        self._event(self.entered, i).set()
        assert self._event(self.opened, i).wait(WAIT_S), f"step {i} was never opened"
        assert sess.current_run is not None
        self.seen.append((i, threading.current_thread().name, sess.current_run.adam_params.learning_rate))
        return {"reward:mean": float(i)}


def test_run_returns_at_once_and_records_each_step(
    tiny: wb.Session, capsys: pytest.CaptureFixture[str]
) -> None:
    gate = Gate()
    run = tiny.run(gate, steps=3)
    assert run.state is RunState.RUNNING and run.i == 0  # returned while step 0 is still blocked
    assert tiny.current_run is run
    gate.wait_entered(0)
    gate.open(0, 1, 2)
    assert run.wait(WAIT_S) is RunState.FINISHED
    assert run.i == 3 and not run.active
    assert [i for i, _, _ in gate.seen] == [0, 1, 2]
    assert {thread for _, thread, _ in gate.seen} == {"workbench-run"}
    rows = [row for row in tiny.history if row["op"] == "run_step"]
    assert [(row["model"], row["step"], row["reward:mean"]) for row in rows] == [
        (RUN_MODEL, 0, 0.0),
        (RUN_MODEL, 0, 1.0),
        (RUN_MODEL, 0, 2.0),
    ]
    assert "3/3" in capsys.readouterr().err  # the tqdm progress bar


def test_run_steps_are_recorded_at_the_step_they_started_from(tiny: wb.Session) -> None:
    data = _data(tiny)

    def step(sess: wb.Session, i: int) -> dict[str, float]:
        assert sess.current_run is not None
        fb = sess.policy.forward_backward(data, "cross_entropy")
        sess.policy.optim_step(sess.current_run.adam_params).result()
        return {"loss:sum": fb.result().metrics["loss:sum"], "reward:mean": -float(i)}

    run = tiny.run(step, steps=3, adam_params={"learning_rate": 1e-2})
    assert run.wait(WAIT_S) is RunState.FINISHED
    assert tiny.step == 3
    assert [(row["step"], row["reward:mean"]) for row in tiny.history if row["op"] == "run_step"] == [
        (0, 0.0),
        (1, -1.0),
        (2, -2.0),
    ]
    assert tiny.history.series("learning_rate")[1] == [1e-2] * 3
    assert [row["op"] for row in tiny.history][:3] == ["forward_backward", "optim_step", "run_step"]


def test_pause_step_resume(tiny: wb.Session) -> None:
    gate = Gate()
    gate.open(*range(6))
    run = tiny.run(gate, steps=6, paused=True)
    assert run.wait(WAIT_S) is RunState.PAUSED and run.i == 0
    run.step()
    assert run.wait(WAIT_S) is RunState.PAUSED and run.i == 1  # exactly one step, then paused again
    run.step()
    run.step()
    assert run.wait(WAIT_S) is RunState.PAUSED and run.i == 3
    run.resume()
    assert run.wait(WAIT_S) is RunState.FINISHED and run.i == 6
    with pytest.raises(RuntimeError, match="single-steps a paused run"):
        run.step()


def test_pause_takes_effect_after_the_current_step(tiny: wb.Session) -> None:
    gate = Gate()
    gate.open(0)
    run = tiny.run(gate, steps=5)
    gate.wait_entered(1)
    run.pause()  # step 1 is executing: it finishes, step 2 does not start
    assert run.state is RunState.PAUSED and run.busy
    gate.open(1, 2, 3, 4)
    assert run.wait(WAIT_S) is RunState.PAUSED
    assert run.i == 2 and not run.busy
    run.resume()
    assert run.wait(WAIT_S) is RunState.FINISHED and run.i == 5


def _wait_in_a_thread(run: wb.Run) -> tuple[threading.Thread, list[RunState]]:
    """`run.wait()` blocking a thread as it blocks a cell under Run All; the state it returned."""
    returned: list[RunState] = []
    waiter = threading.Thread(target=lambda: returned.append(run.wait(WAIT_S)), daemon=True)
    waiter.start()
    return waiter, returned


def test_a_pause_during_wait_keeps_it_waiting_until_resume_and_stop(tiny: wb.Session) -> None:
    """The panel's Pause while a cell waits on a running run: the wait goes on through the pause (the
    cell does not move on with half a run), and returns once the run ends; Stop ends it with the steps
    trained."""
    gate = Gate()
    gate.open(0)
    run = tiny.run(gate, steps=10)
    waiter, returned = _wait_in_a_thread(run)
    gate.wait_entered(1)
    run.pause()
    gate.open(1)
    waiter.join(1.0)
    assert waiter.is_alive() and run.state is RunState.PAUSED and not run.busy and run.i == 2
    run.resume()
    gate.open(2)
    gate.wait_entered(3)
    assert waiter.is_alive()
    run.stop()
    gate.open(3)
    waiter.join(WAIT_S)
    assert returned == [RunState.STOPPED] and run.i == 4


def test_a_wait_returns_when_the_run_pauses_itself(tiny: wb.Session) -> None:
    """A trigger or a raising step pauses the run for the user to look: a wait on it returns."""
    run = tiny.run(
        lambda sess, i: {"reward:mean": float(i)}, steps=5, pause_if={"reward:mean": ("above", 0.5)}
    )
    assert run.wait(WAIT_S) is RunState.PAUSED and run.trigger is not None and run.i == 2

    def raising(sess: wb.Session, i: int) -> None:
        if i == 1:
            raise ValueError("step 1")

    run.stop()
    run.wait(WAIT_S)
    with pytest.warns(RuntimeWarning, match="raised ValueError"):
        run = tiny.run(raising, steps=3)
        assert run.wait(WAIT_S) is RunState.PAUSED and run.failed_step == 1
    run.stop()
    assert run.wait(WAIT_S) is RunState.STOPPED


def test_step_then_resume_then_pause_runs_no_extra_step(tiny: wb.Session) -> None:
    """Step and Run clicked quickly while a step executes, then Pause: the granted single step is part of
    the running, so after the step in progress ends the run is paused, with no extra step owed."""
    gate = Gate()
    run = tiny.run(gate, steps=5)
    gate.wait_entered(0)
    run.pause()
    run.step()  # Step: one more step after the current one
    run.resume()  # Run, before the loop got to the granted step
    run.pause()  # Pause: after the step in progress
    gate.open(*range(5))
    assert run.wait(WAIT_S) is RunState.PAUSED
    assert run.i == 1 and [i for i, _, _ in gate.seen] == [0]
    run.step()  # a step granted now is still honoured, once
    assert run.wait(WAIT_S) is RunState.PAUSED and run.i == 2


def test_the_panel_step_then_run_then_pause_runs_no_extra_step(tiny: wb.Session) -> None:
    """The same through the panel's buttons, on a run that a cell started paused."""
    gate = Gate()
    run = tiny.run(gate, steps=5, paused=True)
    panel = tiny.panel()
    try:
        panel.train.step_button.click()
        gate.wait_entered(0)
        panel.train.step_button.click()
        panel.train.run_button.click()
        panel.train.pause_button.click()
        gate.open(*range(5))
        assert run.wait(WAIT_S) is RunState.PAUSED and run.i == 1
    finally:
        panel.close()
        run.stop()


def test_metrics_named_like_history_columns_are_refused(tiny: wb.Session) -> None:
    """A step returning {"step": ...} (or op, model, time) overwrote the history's own column, in the
    JSONL file and the plots. It now fails the run with an error naming the metric, and no row is
    written."""
    for reserved in ("step", "op", "model", "time"):
        with pytest.warns(RuntimeWarning, match="step 0 raised"):
            run = tiny.run(lambda sess, i, name=reserved: {name: 7.0, "reward:mean": 1.0}, steps=2)
            assert run.wait(WAIT_S) is RunState.PAUSED
        assert isinstance(run.error, ValueError)
        assert f"metric {reserved!r} would overwrite the history's own {reserved!r} column" in str(run.error)
        run.stop()
        assert run.wait(WAIT_S) is RunState.STOPPED
    assert not [row for row in tiny.history if row["op"] == "run_step"]
    with pytest.raises(ValueError, match="metric 'reward' must be a number"):
        tiny.engine.record("run_step", RUN_MODEL, 0, {"reward": "high"})
    assert len(tiny.history) == 0


def test_stop_finishes_the_current_step_then_ends(tiny: wb.Session) -> None:
    gate = Gate()
    run = tiny.run(gate, steps=5)
    gate.wait_entered(0)
    run.stop()
    assert run.state is RunState.RUNNING  # the step in progress is not interrupted
    gate.open(*range(5))
    assert run.wait(WAIT_S) is RunState.STOPPED
    assert run.i == 1 and [i for i, _, _ in gate.seen] == [0]


def test_stop_while_paused_ends_at_once(tiny: wb.Session) -> None:
    run = tiny.run(Gate(), steps=5, paused=True)
    run.stop()
    assert run.wait(WAIT_S) is RunState.STOPPED and run.i == 0
    run.stop()  # stopping an ended run changes nothing
    assert run.state is RunState.STOPPED


def test_set_changes_the_adam_params_of_the_next_step(tiny: wb.Session) -> None:
    run = tiny.run(
        train_step(_data(tiny)), steps=4, adam_params=wb.AdamParams(learning_rate=1e-3), paused=True
    )
    run.step()
    run.wait(WAIT_S)
    assert run.set(learning_rate=3e-5, grad_clip_norm=1.0) == wb.AdamParams(
        learning_rate=3e-5, grad_clip_norm=1.0
    )
    assert run.adam_params.learning_rate == 3e-5  # no step executing: applied at once
    run.step()
    run.wait(WAIT_S)
    run.resume()
    assert run.wait(WAIT_S) is RunState.FINISHED
    assert tiny.history.series("learning_rate", op="optim_step")[1] == [1e-3, 3e-5, 3e-5, 3e-5]
    with pytest.raises(ValueError, match="learning_rate must be >= 0"):
        run.set(learning_rate=-1.0)
    with pytest.raises(ValueError, match="AdamParams fields"):
        run.set(momentum=0.5)
    assert run.adam_params.learning_rate == 3e-5


def test_set_during_a_step_waits_for_the_step_to_end(tiny: wb.Session) -> None:
    seen: list[float] = []

    def step(sess: wb.Session, i: int) -> None:
        run = sess.current_run
        assert run is not None
        seen.append(run.adam_params.learning_rate)
        if i == 0:
            run.set(learning_rate=5e-3)  # as the panel does while a step is in progress
            seen.append(run.adam_params.learning_rate)

    run = tiny.run(step, steps=2, adam_params=wb.AdamParams(learning_rate=1e-3))
    assert run.wait(WAIT_S) is RunState.FINISHED
    assert seen == [1e-3, 1e-3, 5e-3]


def test_an_exception_pauses_the_run_and_keeps_the_traceback(tiny: wb.Session) -> None:
    """A step function that raises pauses the run at the step that raised (not counted), with the
    traceback; `resume()` retries that step. (With `save_every` the model is also rewound to the newest
    run checkpoint: tests/notebook/test_run_checkpoints.py.)"""
    failures = [ZeroDivisionError("reward model divided by zero")]

    def step(sess: wb.Session, i: int) -> dict[str, float]:
        if i == 2 and failures:
            raise failures.pop()
        return {"reward:mean": 1.0}

    with pytest.warns(RuntimeWarning, match="step 2 raised"):
        run = tiny.run(step, steps=5)
        assert run.wait(WAIT_S) is RunState.PAUSED
    assert run.i == 2 and run.failed_step == 2 and run.active
    assert isinstance(run.error, ZeroDivisionError)
    assert (
        run.traceback is not None
        and "reward model divided by zero" in run.traceback
        and "in step" in run.traceback
    )
    assert "ZeroDivisionError" in repr(run)
    run.resume()  # the step is retried
    assert run.wait(WAIT_S) is RunState.FINISHED and run.i == 5 and run.error is None


def test_a_step_function_must_return_metrics_or_none(tiny: wb.Session) -> None:
    with pytest.warns(RuntimeWarning, match="step 0 raised"):
        run = tiny.run(lambda sess, i: 1.5, steps=2)
        assert run.wait(WAIT_S) is RunState.PAUSED
    assert isinstance(run.error, TypeError) and "dict of metrics or None" in str(run.error)
    run.stop()
    run.wait(WAIT_S)
    assert tiny.run(lambda sess, i: None, steps=2).wait(WAIT_S) is RunState.FINISHED
    assert not [row for row in tiny.history if row["op"] == "run_step"]


def test_one_active_run_at_a_time(tiny: wb.Session) -> None:
    run = tiny.run(Gate(), steps=3, paused=True)
    with pytest.raises(RunActiveError, match="still paused"):
        tiny.run(Gate(), steps=3)
    run.stop()
    run.wait(WAIT_S)
    assert tiny.run(lambda sess, i: None, steps=1).wait(WAIT_S) is RunState.FINISHED


def test_bad_arguments_raise_in_the_callers_thread(tiny: wb.Session) -> None:
    with pytest.raises(ValueError, match="positive integer"):
        tiny.run(lambda sess, i: None, steps=0)
    with pytest.raises(TypeError, match="step_fn"):
        tiny.run("step", steps=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="train_step needs at least one datum"):
        train_step([])
    with pytest.raises(RuntimeError, match=r"sess\.run"):
        train_step(_data(tiny))(tiny, 0)
    assert tiny.current_run is None


def test_closing_the_session_stops_a_paused_run(tiny: wb.Session) -> None:
    run = tiny.run(lambda s, i: None, steps=3, paused=True)
    tiny.close()
    assert run.wait(WAIT_S) is RunState.STOPPED and run.i == 0
    with pytest.raises(wb.SessionClosedError):
        tiny.run(lambda s, i: None, steps=1)


def test_interrupting_wait_leaves_the_run_going_and_says_so(tiny: wb.Session) -> None:
    """A kernel interrupt during `run.wait()` ends the wait only: a short note (no traceback in IPython)
    that the run goes on, and how to stop it."""
    import signal

    from workbench.notebook.run import WaitInterrupted

    gate = Gate()
    run = tiny.run(gate, steps=2)
    gate.wait_entered(0)
    # what a kernel interrupt does: SIGINT to the main thread, which waits in run.wait()
    timer = threading.Timer(0.3, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    with pytest.raises(WaitInterrupted) as caught:
        run.wait()
    assert isinstance(caught.value, KeyboardInterrupt) and run.active
    (note,) = caught.value._render_traceback_()
    assert "the run goes on" in note and "run.stop()" in note
    gate.open(0, 1)
    assert run.wait(WAIT_S) is RunState.FINISHED
