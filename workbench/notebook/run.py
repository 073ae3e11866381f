"""Background training runs: a user's step function called on its own thread, one step at a time.

ipywidgets callbacks cannot run while a notebook cell is busy, so a training loop written in a cell
freezes every control until it ends. `Session.run(step_fn, steps)` instead calls `step_fn(sess, i)` on
a run thread and returns a `Run` at once: the cell finishes, the kernel stays free, and the panel's
buttons (or later cells) pause, single-step, stop or re-tune the loop while it trains.

Between two steps, and only there, the run checks for pause / stop requests and applies edits of its
`AdamParams` (`run.set(learning_rate=...)`), so every step sees one consistent set of settings. The run
thread only orchestrates: the step function calls the session's futures API, whose operations still
run on the session's worker thread, in order with everything else.

Interrupting the kernel does not stop a run, since the run is not on the kernel's thread: `run.stop()`
(or the panel's Stop button) does, after the current step. A running run keeps its session alive until
it ends; a paused one does not: once nothing references the run or its session, both are freed.

Live settings: the run owns the current `AdamParams` (`run.adam_params`), and the session exposes the
run it is executing as `sess.current_run`, so a step function reads `sess.current_run.adam_params` for
its `optim_step` (as `train_step` does). A step function is a plain function of the session; nothing
in its signature ties it to the panel.

Each step's returned metrics (`{"reward:mean": ...}`) are recorded in the session history as op
`"run_step"` at the optimizer step the step started from (the weights that produced them), so they
reach the JSONL file, W&B and the plots like every operation's metrics.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
import math
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from IPython.display import DisplayHandle, display
from tqdm.auto import tqdm
from tqdm.notebook import tqdm_notebook

from workbench.engine.interface import Restore
from workbench.engine.remote.engine import EngineUnreachableError
from workbench.loops.data_checks import DataProblem
from workbench.notebook.alerts import alert_wandb
from workbench.notebook.run_checkpoints import RUN_KEY, RunCheckpoint, checkpoint_name, to_prune
from workbench.notebook.triggers import PauseIf, Trigger, first_trigger, pause_rules
from workbench.notebook.watchdog import Stall, Watchdog
from workbench.sdk_conversion import to_adam_params
from workbench.types import AdamParams

if TYPE_CHECKING:
    from workbench.futures import APIFuture
    from workbench.notebook.session import Session
    from workbench.types import SaveWeightsResponse

StepFn = Callable[["Session", int], Mapping[str, float] | None]
"""`step_fn(sess, i) -> metrics`: one training step; `i` counts the run's steps from 0."""

RUN_MODEL = "run"
"""The `model` column of the history rows a run records: its metrics describe the whole step."""

# How often a paused run looks at whether its session was closed meanwhile, and `wait()` at the watchdog.
PAUSED_POLL_S = 0.5


PROGRESS_FORMAT = "{desc}|{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}, {rate_fmt}{postfix}]"
"""The run's progress bar: tqdm's default without the percentage, which the step count says. In a notebook
tqdm draws the text left of the bar, the bar and the text right of it as three widgets; a left text
that does not change sends the page nothing per step (two messages instead of three)."""


class RunState(enum.StrEnum):
    """Where a run is. `running` and `paused` are active; the other three are final."""

    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"
    FINISHED = "finished"
    FAILED = "failed"


ACTIVE_STATES = (RunState.RUNNING, RunState.PAUSED)

RunMark = tuple[int, int]
"""Where a run was when a view last showed it: `(id(run), steps done)` (`Run.mark()`)."""


class RunActiveError(RuntimeError):
    """Raised by `Session.run` while another run of the same session is still active."""


class WaitInterrupted(KeyboardInterrupt):
    """Raised when the kernel is interrupted while `run.wait()` blocks: the cell stops waiting, the run
    trains on (it is not on the kernel's thread). IPython shows the short note `_render_traceback_`
    gives instead of a traceback into the wait."""

    def __init__(self, run: Run) -> None:
        super().__init__(
            f"stopped waiting; the run goes on in the background ({run.state.value}, step {run.i}/{run.steps}). "
            "run.pause() or run.stop() (or the panel's Pause and Stop) end it after the current step."
        )

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self.args[0]}"]


class Run:
    """A step function running on a background thread; created by `Session.run`, which starts it.

    Controls (each returns at once; `wait()` blocks until the request has taken effect):
        pause(): finish the current step, then wait.
        step(): while paused, run exactly one more step, then stay paused.
        resume(): continue running steps.
        stop(): finish the current step, then end (state `stopped`).
        set(**fields): edit the run's `AdamParams`; a step in progress keeps the values it started with.

    State: `state` (a `RunState`), `i` (steps completed), `steps` (total), `adam_params`, and after a
    failure `error` (the exception), `traceback` (its formatted text) and `failed_step`.

    A step function that raises pauses the run; the step that raised is not counted. What the failed
    step had done (gradients accumulated, an optimizer step, sampling draws, `loop_state` edits) is
    undone when the run saves run checkpoints (`save_every`): the model goes back to the newest one
    (`load_state`, everything, RNGs included), `i` and `loop_state` with it, the history rows since are
    marked discarded, and nothing is saved at the failure, so the saved state is never the failed
    step's; `resume()` then retrains from there, exactly as an uninterrupted run would. Without
    `save_every` there is nothing to go back to: the failed step's effects stay. A run whose session can
    take no more steps (closed, its engine unreachable) ends `failed` instead.
    """

    def __init__(
        self,
        session: Session,
        step_fn: StepFn,
        steps: int,
        adam_params: AdamParams,
        *,
        paused: bool = False,
        pause_if: PauseIf | None = None,
        save_every: int | None = None,
        keep: int = 3,
        keep_every: int | None = None,
        resume_from: RunCheckpoint | None = None,
    ) -> None:
        if not callable(step_fn):
            raise TypeError(f"step_fn must be a function step_fn(sess, i) -> metrics, got {step_fn!r}")
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive integer, got {steps!r}")
        for name, value, least in (
            ("save_every", save_every, 1),
            ("keep", keep, 1),
            ("keep_every", keep_every, 1),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.save_every = save_every
        self.keep = keep
        self.keep_every = keep_every
        self.loop_state: dict[str, Any] = dict(resume_from.state) if resume_from is not None else {}
        """The step function's own state (a data cursor, a curriculum level): JSON values, saved with
        every run checkpoint and restored by a resumed run."""
        self.resumed_from = resume_from
        """The run checkpoint this run continues (None for a run from step 0)."""
        self.saved_at: int | None = resume_from.next_step if resume_from is not None else None
        """The run step of the newest run checkpoint this run saved (or resumed from)."""
        self.checkpoint_path: str | None = None
        """The `tinker://` path of the newest run checkpoint this run saved."""
        self.save_error: str | None = None
        """Why the latest run checkpoint could not be saved (the run paused); None after a save succeeds."""
        self._saving = False  # a run checkpoint is due or being written: the run is not idle
        self._writing: tuple[APIFuture[SaveWeightsResponse], RunCheckpoint] | None = None
        """The run checkpoint being written beside the steps, and what it saves."""
        self._claimed_at = self.saved_at  # the step of the newest run checkpoint saved or being written
        self._last_save: tuple[RunCheckpoint, str] | None = (
            (resume_from, str(resume_from.path)) if resume_from is not None and resume_from.path else None
        )  # what a failed step rewinds to: the newest run checkpoint and its path
        self._dirty = False  # a failed step's effects are in the model: never saved
        self.session = session
        if pause_if is None and resume_from is not None:
            pause_if = resume_from.pause_if  # the saved triggers, unless the resuming cell names its own
        self.pause_rules = pause_rules(pause_if)
        self.trigger: Trigger | None = None
        """The pause rule that fired last (see `workbench.notebook.triggers`); None once resumed."""
        self.started_at: float | None = None
        """When `start()` was called (`time.time()`)."""
        self.started_step = session.step
        """The session's optimizer step when the run started."""
        self.step_seconds: list[float] = []
        """How long each completed step took (wall clock), for the panel's progress line."""
        self.watchdog = Watchdog()
        """When a step in progress counts as stalled (`stall`; see `workbench.notebook.watchdog`)."""
        self._step_clock: float | None = None  # time.monotonic() when the step in progress began
        self.step_fn = step_fn
        self.steps = steps
        self.i = resume_from.next_step if resume_from is not None else 0
        self.step_started_at: int | None = None
        """The optimizer step the step in progress started from (None between steps)."""
        self.error: BaseException | None = None
        self.traceback: str | None = None
        self.failed_step: int | None = None
        """The step whose step function raised last (None if none did)."""
        self.data_problems: list[DataProblem] | None = None
        """What `wb.check_data` found in the run's first policy batch (None until it is sent)."""
        self._adam_params = adam_params if resume_from is None else AdamParams(**resume_from.adam_params)
        self.adam_params_from = 0 if resume_from is None else resume_from.adam_params_from
        """The run step from which `adam_params` apply (the step after the one an edit came during)."""
        self._pending_adam: AdamParams | None = None
        self._state = RunState.PAUSED if paused else RunState.RUNNING
        self._stop_requested = False
        self._single_steps = 0  # steps granted by step() while paused
        self._paused_itself = False  # a trigger, a failed step or save paused it: wait() returns
        self._busy = False  # the step function is executing
        self._changed = threading.Condition()
        self._thread = threading.Thread(
            target=_run_thread, args=(weakref.WeakMethod(self._advance),), name="workbench-run", daemon=True
        )
        self._progress: tqdm[Any] | None = None
        self._progress_output: DisplayHandle | None = None  # a notebook's bar, rewritten as text at the end

    def start(self) -> Run:
        """Start the run thread. The progress bar is created here, in the caller's thread, so a notebook
        shows it under the cell that started the run. In a notebook the bar is shown with a display id:
        at the run's end its output becomes the bar's last line as text, what a saved notebook (an HTML
        export, a kernel-less reopening) then shows, rather than the text form tqdm's widget had when it
        was first shown ("0/15")."""
        in_notebook = issubclass(tqdm, tqdm_notebook)
        self._progress = tqdm(
            total=self.steps,
            initial=self.i,
            desc="run",
            unit="step",
            bar_format=PROGRESS_FORMAT,
            **({"display": False} if in_notebook else {}),
        )
        if in_notebook:
            self._progress_output = display(self._progress.container, display_id=True)
        self.started_at = time.time()
        self.started_step = self.session.step
        self._thread.start()
        return self

    # ------------------------------------------------------------------------------------------ state

    @property
    def state(self) -> RunState:
        return self._state

    @property
    def active(self) -> bool:
        """True while the run can still take steps (running or paused)."""
        return self._state in ACTIVE_STATES

    @property
    def busy(self) -> bool:
        """True while the step function is executing."""
        return self._busy

    @property
    def stopping(self) -> bool:
        """True between `stop()` and the end of the step in progress."""
        return self._stop_requested and self.active

    @property
    def taking_steps(self) -> bool:
        """True while the run takes step after step: running, neither paused nor stopping."""
        return self._state is RunState.RUNNING and not self.stopping

    @property
    def adam_params(self) -> AdamParams:
        """The optimizer settings the current (or next) step uses."""
        return self._adam_params

    @property
    def next_adam_params(self) -> AdamParams:
        """The optimizer settings the next step will use: `adam_params` with any `set()` edit made while
        the current step runs."""
        return self._pending_adam or self._adam_params

    @property
    def stall(self) -> Stall | None:
        """The step in progress, when it has run far past its expected time (`watchdog`), with the
        stacks it waits in; None while it is in time or no step runs."""
        began = self._step_clock
        if began is None or not self._busy:
            return None
        return self.watchdog.check(self.i, time.monotonic() - began, self.step_seconds, self._thread)

    def mark(self) -> RunMark:
        """This run and the steps it has done, for `steps_since` (a panel's views pace their redraws
        by the run's steps)."""
        return (id(self), self.i)

    def steps_since(self, mark: RunMark | None) -> float:
        """The steps this run has done since `mark`: infinitely many if it marked another run, or none."""
        if mark is None or mark[0] != id(self):
            return math.inf
        return self.i - mark[1]

    def __repr__(self) -> str:
        error = f", error={self.error!r}" if self.error is not None else ""
        return f"Run({self._state.value}, step {self.i}/{self.steps}, lr={self._adam_params.learning_rate:g}{error})"

    # ------------------------------------------------------------------------------------------ controls

    def pause(self) -> None:
        """Pause after the current step (a paused or ended run is left as it is)."""
        with self._changed:
            if self._state is RunState.RUNNING:
                self._state = RunState.PAUSED
                self._changed.notify_all()

    def resume(self) -> None:
        """Continue a paused run. Single steps granted by `step()` and not yet started are part of the
        running and are not owed again after a later `pause()`."""
        with self._changed:
            if self._state is RunState.PAUSED:
                self._state = RunState.RUNNING
                self._single_steps = 0
                self.trigger = None
                self.error = self.traceback = None  # a failed step is retried
                self._paused_itself = False
                self._changed.notify_all()

    def step(self) -> None:
        """Run exactly one step of a paused run, which then stays paused."""
        with self._changed:
            if self._state is not RunState.PAUSED:
                raise RuntimeError(f"step() single-steps a paused run; this run is {self._state.value}")
            self._single_steps += 1
            self.trigger = None
            self.error = self.traceback = None  # a failed step is retried
            self._paused_itself = False
            self._changed.notify_all()

    def stop(self) -> None:
        """End the run after the current step (at once if paused)."""
        with self._changed:
            if self.active:
                self._stop_requested = True
                self._changed.notify_all()

    def set(self, **fields: float) -> AdamParams:
        """Change `AdamParams` fields (`learning_rate`, `beta1`, `beta2`, `eps`, `weight_decay`,
        `grad_clip_norm`) for the steps to come.

        The values are validated here, so a bad one raises at once and changes nothing. They apply
        between steps: at once when no step is executing, else when the current step ends.

        Returns:
            The settings the next step will use.
        """
        with self._changed:
            base = self._pending_adam or self._adam_params
            try:
                edited = dataclasses.replace(base, **fields)
            except TypeError as error:
                names = [f.name for f in dataclasses.fields(AdamParams)]
                raise ValueError(f"run.set() takes AdamParams fields {names}: {error}") from None
            if self._busy:
                self._pending_adam = edited
            else:
                self._adam_params, self.adam_params_from = edited, self.i
            return edited

    def wait(self, timeout: float | None = None) -> RunState:
        """Block until the run is done with what it was asked before the call; or until the watchdog
        names the step in progress stalled (`stall`), which it says in a RuntimeWarning naming the step
        and where it waits: a stuck step does not block the cell for good.

        Called on a running run, `wait()` returns when the run ends (finished, stopped, failed) or
        pauses itself for the user to look (a trigger fired, a step raised, a save failed: `trigger`,
        `error`, `save_error`). A Pause asked meanwhile (the panel's, during `run.wait()` or Run All)
        keeps it waiting, paused, until Resume or Stop: the cell, and the cells after it, go on only
        once the run has ended or needs them, never half-way through a run someone paused to watch.
        Called on a paused run (`pause()`, `step()`, `paused=True` before it), it returns once that
        has taken effect: no step executing, saving or granted.

        Returns:
            The state then (still `running` or `paused` if `timeout` ran out or the step stalled
            first).
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        stall = None
        try:
            with self._changed:
                through_pauses = self._state is RunState.RUNNING
                while not (self._paused_for_the_user() if through_pauses else self._idle()):
                    left = (
                        PAUSED_POLL_S if deadline is None else min(deadline - time.monotonic(), PAUSED_POLL_S)
                    )
                    if left <= 0:
                        break
                    self._changed.wait(left)
                    stall = self.stall
                    if stall is not None:
                        break
                state = self._state
        except KeyboardInterrupt:
            raise WaitInterrupted(self) from None
        if stall is not None:
            warnings.warn(f"stopped waiting: {stall}", RuntimeWarning, stacklevel=2)
        return state

    def _paused_for_the_user(self) -> bool:
        """Idle and either ended or paused by the run itself (a trigger, a failed step or save): what a
        wait on a running run returns at. Called with the lock held."""
        if not self.active:
            return self._idle()
        return self._paused_itself and self._idle()

    def _idle(self) -> bool:
        if not self.active:
            return True
        if self._saving:
            return False
        if self.session.closed:
            return False  # the loop ends the run at its next look (within PAUSED_POLL_S)
        return (
            self._state is RunState.PAUSED
            and not self._busy
            and self._single_steps == 0
            and not self._stop_requested
        )

    # ------------------------------------------------------------------------------------------ loop

    def _next_step_granted(self) -> bool | None:
        """True when a step may start, False when the run must end, None while it waits paused. Called
        with the lock held."""
        if self._stop_requested or self.session.closed:
            return False
        if self._state is RunState.RUNNING:
            return True
        if self._single_steps > 0:
            self._single_steps -= 1
            return True
        return None

    def _advance(self) -> threading.Condition | None:
        """Take every step the run may take now. Returns None once the run has ended, or, while it waits
        paused, its condition, acquired: the run's thread waits on that holding the run only weakly
        (`_run_thread`), releases it, and calls again."""
        final = RunState.FINISHED
        try:
            self._save()  # the run's start: what a step failing before the first periodic save goes back to
            while self.i < self.steps:
                if self._writing is not None and self._writing[0].done():
                    self._finish_write()  # a failed write pauses the run here, before its next step
                waiting = (
                    self._state is RunState.PAUSED and not self._single_steps and not self._stop_requested
                )
                if waiting:
                    # a paused run is saved where it waits (once; a failed save is not retried there)
                    self._save(start=self.save_error is None, wait=True)
                self._changed.acquire()
                granted = self._next_step_granted()
                if granted is None:
                    return self._changed
                try:
                    if not granted:
                        final = RunState.STOPPED
                        break
                    self._busy = True
                    self._changed.notify_all()
                finally:
                    self._changed.release()
                try:
                    self._take_step()
                except Exception as error:
                    if self.session.closed or isinstance(error, EngineUnreachableError):
                        raise  # nothing left to resume on
                    self._pause_after_failure(error, traceback.format_exc())
        except BaseException as error:  # the run reports every failure; the kernel thread never sees it
            with self._changed:
                self.error = error
                self.traceback = traceback.format_exc()
                self._busy = False
                self._dirty = True
            final = RunState.FAILED
        self._save(wait=True)  # before the state is final: close() waits for it, so the engine is still open
        with self._changed:
            self._state = final
        self._end()
        return None

    def _take_step(self) -> None:
        start_step = self.session.step
        self.step_started_at = start_step
        first_row = len(self.session.history)
        started = self._step_clock = time.monotonic()
        try:
            metrics = self.step_fn(self.session, self.i)
            self._record(start_step, metrics)
        finally:
            self.step_started_at = self._step_clock = None
        trigger = first_trigger(self.pause_rules, self.session.history.rows[first_row:], self.i)
        with self._changed:
            self.step_seconds.append(time.monotonic() - started)
            if trigger is not None:
                self.trigger, self._paused_itself = trigger, True
                if self._state is RunState.RUNNING:
                    self._state = RunState.PAUSED
                self._single_steps = 0
            self.i += 1
            self._busy = False
            # claimed here, with the step's end: wait() must not see the run idle before its save
            due = self.save_every is not None and self.i % self.save_every == 0
            self._saving = due or self._writing is not None
            if self._pending_adam is not None:
                self._adam_params, self._pending_adam = self._pending_adam, None
                self.adam_params_from = self.i
            self._changed.notify_all()
        if trigger is not None:
            alert_wandb(self.session.wandb_run, self.session.model_id, trigger)
        assert self._progress is not None
        self._progress.update(1)
        if due:
            self._save()

    def _pause_after_failure(self, error: Exception, formatted: str) -> None:
        """Pause the run after its step function raised, rewound to its newest run checkpoint (see the
        class docstring)."""
        with self._changed:
            self.error, self.traceback, self.failed_step = error, formatted, self.i
            self._dirty = self._paused_itself = True
        try:
            self._finish_write()  # the step before this one may still be being saved: what to rewind to
            if self._last_save is not None:
                self._rewind(*self._last_save)
        finally:
            with self._changed:
                if self._state is RunState.RUNNING:
                    self._state = RunState.PAUSED
                self._single_steps = 0
                self._busy = False
                self._changed.notify_all()
        warnings.warn(
            f"step {self.failed_step} raised {error!r}: the run paused at step {self.i}"
            + (" (rewound to its newest run checkpoint)" if self._last_save is not None else ""),
            RuntimeWarning,
            stacklevel=2,
        )

    def _rewind(self, saved: RunCheckpoint, path: str) -> None:
        """Put the model, the step index, `loop_state` and the logs back as they were when `saved` was."""
        session = self.session
        session.engine.load_state(session.model_id, path, Restore.EVERYTHING).result()
        session.rewind_logs(saved)
        with self._changed:
            self.loop_state.clear()
            self.loop_state.update(copy.deepcopy(saved.state))
            self.i = saved.next_step
            self._dirty = False
        assert self._progress is not None
        self._progress.n = self.i
        self._progress.refresh()

    def _save(self, *, start: bool = True, wait: bool = False) -> None:
        """Save a run checkpoint at step `i` unless there is one (see `workbench.notebook.run_checkpoints`):
        once the write before it has finished, the model's state is captured and written beside the
        steps that follow (`workbench.engine.local.checkpoint_writes`), and checked at the next save,
        at the run's next idle point or end (`wait`), or at its first step after the write landed
        (`_finish_write`). A failed step's state is never saved."""
        if start and self._wants_save() and self._finish_write():
            self._start_write()
        if wait:
            self._finish_write()
        with self._changed:
            self._saving = self._writing is not None
            self._changed.notify_all()

    def _wants_save(self) -> bool:
        return not (
            self.save_every is None or self._claimed_at == self.i or self.session.closed or self._dirty
        )

    def _start_write(self) -> None:
        with self._changed:
            self._saving = True
        try:
            # a queued row: once it is recorded, every row of the steps before is in the history too
            self.session.engine.record(
                "run_checkpoint", RUN_MODEL, self.session.step, {"run_step": self.i}
            ).result()
            wandb = self.session.wandb_run
            saved = RunCheckpoint(
                next_step=self.i,
                adam_params=dataclasses.asdict(self.next_adam_params),
                adam_params_from=self.adam_params_from,
                history_rows=self.session.history_offset
                + len(self.session.history.rows)
                + 1,  # + the save's row
                rollout_batches=len(self.session.rollouts),
                wandb_run_id=wandb.run_id if wandb is not None else None,
                state=copy.deepcopy(self.loop_state),  # as it is now: the next steps go on editing it
                steps=self.steps,
                pause_if={rule.metric: (rule.direction, rule.threshold) for rule in self.pause_rules},
            )
            written = self.session.policy.save_state(
                checkpoint_name(self.i), overwrite=True, user_metadata={RUN_KEY: saved.to_json()}
            )
        except Exception as error:
            self._save_failed(self.i, error)
            return
        self._writing, self._claimed_at = (written, saved), self.i

    def _finish_write(self) -> bool:
        """Wait for the run checkpoint being written, if any; then prune the older ones, or, if the write
        failed, pause the run and say why in `save_error` (the previous checkpoints are untouched).
        Returns whether no save failed."""
        writing, self._writing = self._writing, None
        if writing is None:
            return True
        written, saved = writing
        try:
            response = written.result()
        except Exception as error:
            self._claimed_at = self.saved_at
            self._save_failed(saved.next_step, error)
            return False
        self.saved_at, self.checkpoint_path, self.save_error = saved.next_step, response.path, None
        self._last_save = (saved, response.path)
        for name in to_prune(self.session.model_dir, self.keep, self.keep_every):
            self.session.delete_checkpoint(name)
        return True

    def _save_failed(self, step: int, error: Exception) -> None:
        with self._changed:
            self.save_error = (
                f"the run checkpoint at step {step} could not be saved ({error!r}); the run paused, "
                "its previous checkpoints are intact"
            )
            self._paused_itself = True
            if self._state is RunState.RUNNING:
                self._state = RunState.PAUSED
            self._single_steps = 0
            self._saving = self._writing is not None
            self._changed.notify_all()
        warnings.warn(self.save_error, RuntimeWarning, stacklevel=3)

    def _end(self) -> None:
        assert self._progress is not None
        self._progress.close()
        if self._progress_output is not None:
            self._progress_output.update({"text/plain": str(self._progress)}, raw=True)
        with self._changed:
            if self._pending_adam is not None:
                self._adam_params, self._pending_adam = self._pending_adam, None
            self._stop_requested = False
            self._single_steps = 0
            self._changed.notify_all()

    def _record(self, step: int, metrics: Mapping[str, float] | None) -> None:
        """Record the step's metrics on the worker thread, in order with the step's operations."""
        if metrics is None:
            return
        if not isinstance(metrics, Mapping):
            raise TypeError(f"step_fn must return a dict of metrics or None, got {type(metrics).__name__}")
        if metrics:
            self.session.engine.record("run_step", RUN_MODEL, step, metrics).result()


def _run_thread(advance: weakref.WeakMethod[Callable[[], threading.Condition | None]]) -> None:
    """A run's thread. It holds the run while steps are taken, and only weakly while the run waits
    paused: a paused run that nothing references any more (dropped with its session, say by re-running
    the notebook cell that made them) is freed, and the thread ends, instead of waiting forever."""
    while True:
        take_steps = advance()
        if take_steps is None:
            return  # freed while paused: nobody could resume it
        paused = take_steps()
        del take_steps
        if paused is None:
            return  # ended
        try:
            paused.wait(PAUSED_POLL_S)  # a state change wakes it; the timeout notices a closed session
        finally:
            paused.release()


def train_step(
    data: Sequence[Any], loss_fn: str = "cross_entropy", loss_fn_config: Mapping[str, float] | None = None
) -> StepFn:
    """The step function for training on fixed data: `forward_backward(data, loss_fn)`, then
    `optim_step` with the run's live `AdamParams`. What the panel's Train tab runs.

    Its metrics are the `forward_backward` and `optim_step` rows the session records anyway, so it
    returns none of its own.
    """
    batch = list(data)
    if not batch:
        raise ValueError("train_step needs at least one datum")

    def step(sess: Session, i: int) -> None:
        run = sess.current_run
        if run is None:
            raise RuntimeError(
                "train_step reads its AdamParams from sess.current_run: start it with sess.run(...)"
            )
        backward = sess.policy.forward_backward(batch, loss_fn, loss_fn_config)
        update = sess.policy.optim_step(run.adam_params)
        backward.result()  # a failure on the worker pauses the run, rather than an empty step passing
        update.result()

    step.__qualname__ = step.__name__ = f"train_step({loss_fn})"  # what the panel names the run by
    return step


def check_no_active_run(session: Session) -> None:
    """Refuse a new run of `session` while another is active, or once its engine is closed: one run at a
    time drives a session's models."""
    current = session.current_run
    if current is not None and current.active:
        raise RunActiveError(
            f"a run is still {current.state.value}: stop() it before starting another ({current!r})"
        )
    session.engine.check_open()


def check_no_active_sweep(session: Session) -> None:
    """Refuse a run of `session` while one of its sweeps trains or waits paused: the sweep's thread
    swaps the engine's sampling generator around each member's step, so a run beside it would draw
    from a member's stream (and its steps would interleave with the members')."""
    for sweep in session.sweeps:
        if sweep.active:
            raise RunActiveError(
                f"a sweep of this session is still {sweep.state.value}: wait() for it or stop() it "
                f"before starting a run ({sweep!r})"
            )


def start_run(
    session: Session,
    step_fn: StepFn,
    steps: int,
    adam_params: Any,
    paused: bool,
    pause_if: PauseIf | None = None,
    save_every: int | None = None,
    keep: int = 3,
    keep_every: int | None = None,
    resume_from: RunCheckpoint | None = None,
) -> Run:
    """Create and start a run of `session` (what `Session.run` does), refusing while another run, or a
    sweep of the session, is active."""
    check_no_active_run(session)
    check_no_active_sweep(session)
    run = Run(
        session,
        step_fn,
        steps,
        to_adam_params(adam_params if adam_params is not None else AdamParams()),
        paused=paused,
        pause_if=pause_if,
        save_every=save_every,
        keep=keep,
        keep_every=keep_every,
        resume_from=resume_from,
    )
    session.current_run = run
    return run.start()
