"""The Train tab: the loss and AdamParams to train with, and the controls of the session's run.

The tab holds no training state. Its buttons act on `sess.current_run` (pause / step / resume / stop
what a cell or an earlier click started) and, when no run is active, start one with `sess.run` on the
panel's training data, exactly as a cell would:

    sess.run(wb.train_step(train_data, loss), steps, adam_params=<the tab's AdamParams>)

Step starts a one-step run; Run starts a run of the tab's step count. While a run is active, editing an
AdamParams field calls `run.set(...)` (applied from the next step), and the fields show the run's
settings, so a `run.set` from a cell shows here too. The loss is fixed for a run's lifetime: it is part
of the run's step function.
"""

from __future__ import annotations

import dataclasses
import html
import threading
import types
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets

from workbench.losses import LOSSES
from workbench.notebook.panel.feedback import Feedback
from workbench.notebook.run import ACTIVE_STATES, Run, RunState, train_step
from workbench.types import AdamParams

if TYPE_CHECKING:
    from workbench.notebook.session import Session

ADAM_FIELDS = tuple(field.name for field in dataclasses.fields(AdamParams))
POLICY_LOSSES = tuple(name for name, spec in LOSSES.items() if spec.head == "logprobs")
DEFAULT_STEPS = 20
DEFAULT_LEARNING_RATE = 1e-3
"""The tab's starting learning rate: what the tutorials train LoRA adapters with (Adam moves every
adapter weight by about the learning rate per step; 1e-4, Tinker's `AdamParams` default, is slow to
show an effect on a small model)."""


class TrainTab:
    """Loss, AdamParams, step count; Run/Resume, Pause, Step, Stop; the run's progress and any error."""

    def __init__(self, session: Session, train_data: Sequence[Any] | None) -> None:
        self.session = session
        self.train_data = list(train_data) if train_data is not None else None
        self.feedback = Feedback()
        defaults = dataclasses.asdict(AdamParams(learning_rate=DEFAULT_LEARNING_RATE))
        self.loss = ipywidgets.Dropdown(options=POLICY_LOSSES, value="cross_entropy", description="loss")
        self.adam: dict[str, ipywidgets.FloatText] = {
            name: ipywidgets.FloatText(
                value=defaults[name], description=name, style={"description_width": "initial"}
            )
            for name in ADAM_FIELDS
        }
        self.steps = ipywidgets.BoundedIntText(value=DEFAULT_STEPS, min=1, max=1_000_000, description="steps")
        self.run_button = ipywidgets.Button(
            description="Run", icon="play", tooltip="start a run (or resume a paused one)"
        )
        self.pause_button = ipywidgets.Button(
            description="Pause", icon="pause", tooltip="pause after the current step"
        )
        self.step_button = ipywidgets.Button(
            description="Step", icon="step-forward", tooltip="run exactly one step"
        )
        self.stop_button = ipywidgets.Button(
            description="Stop", icon="stop", tooltip="stop after the current step"
        )
        for button, name in (
            (self.run_button, "run"),
            (self.pause_button, "pause"),
            (self.step_button, "step"),
            (self.stop_button, "stop"),
        ):
            button.add_class(f"wb-train-{name}")
        self.progress = ipywidgets.IntProgress(value=0, min=0, max=1, description="progress")
        self.progress_text = ipywidgets.HTML()
        self.run_description = ipywidgets.HTML()
        self._own_runs: weakref.WeakSet[Run] = weakref.WeakSet()  # the runs this tab started
        self.error = ipywidgets.HTML()

        self.run_button.on_click(self.feedback.guard(self._on_run))
        self.pause_button.on_click(self.feedback.guard(self._on_pause))
        self.step_button.on_click(self.feedback.guard(self._on_step))
        self.stop_button.on_click(self.feedback.guard(self._on_stop))
        self._lock = threading.RLock()  # the panel's timer thread syncs the fields that callbacks edit
        for name, box in self.adam.items():
            box.observe(
                self.feedback.guard(lambda change, name=name: self._on_adam_edit(name, change["new"])),
                names="value",
            )

        no_data = ipywidgets.HTML(
            "<i>No training data: the buttons control runs started from cells. "
            "Pass <code>sess.panel(train_data=datums)</code> to train from here.</i>"
        )
        self.widget = ipywidgets.VBox(
            [
                ipywidgets.HBox([self.loss, self.steps]),
                self.run_description,
                ipywidgets.GridBox(
                    list(self.adam.values()),
                    layout=ipywidgets.Layout(grid_template_columns="repeat(3, auto)"),
                ),
                ipywidgets.HBox([self.run_button, self.pause_button, self.step_button, self.stop_button]),
                ipywidgets.HBox([self.progress, self.progress_text]),
                *([no_data] if self.train_data is None else []),
                self.feedback.widget,
                self.error,
            ]
        )

    # ------------------------------------------------------------------------------------------ settings

    def adam_params(self) -> AdamParams:
        """The AdamParams in the tab's fields (validated: a bad field raises ValueError)."""
        return AdamParams(**{name: box.value for name, box in self.adam.items()})

    def _active_run(self) -> Run | None:
        run = self.session.current_run
        return run if run is not None and run.active else None

    def _on_adam_edit(self, name: str, value: float) -> None:
        with self._lock:
            run = self._active_run()
            if run is None:
                self.adam_params()
                self.feedback.clear()
            elif dataclasses.asdict(run.next_adam_params)[name] != value:  # an edit, not the refresh's sync
                run.set(**{name: value})
                self.feedback.info(f"{name} = {value:g} from the run's next step")

    # ------------------------------------------------------------------------------------------ buttons

    def _start(self, steps: int) -> Run:
        if self.train_data is None:
            raise RuntimeError("this panel has no training data: create it with sess.panel(train_data=...)")
        run = self.session.run(
            train_step(self.train_data, self.loss.value), steps, adam_params=self.adam_params()
        )
        self._own_runs.add(run)
        return run

    def _on_run(self, _button: ipywidgets.Button) -> None:
        run = self._active_run()
        if run is not None:
            run.resume()
        else:
            self._start(self.steps.value)
        self.feedback.clear()
        self.refresh()

    def _on_pause(self, _button: ipywidgets.Button) -> None:
        run = self._active_run()
        if run is not None:
            run.pause()
        self.refresh()

    def _on_step(self, _button: ipywidgets.Button) -> None:
        run = self._active_run()
        if run is not None:
            run.step()
        else:
            self._start(1)
        self.feedback.clear()
        self.refresh()

    def _on_stop(self, _button: ipywidgets.Button) -> None:
        run = self._active_run()
        if run is not None:
            run.stop()
        self.refresh()

    # ------------------------------------------------------------------------------------------ view

    def refresh(self) -> None:
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        run = self.session.current_run
        state = run.state if run is not None else None
        active = state in ACTIVE_STATES
        paused = state is RunState.PAUSED
        can_start = not active and self.train_data is not None and not self.session.closed
        self.run_button.description = "Resume" if paused else "Run"
        self.run_button.disabled = not (paused or can_start)
        self.pause_button.disabled = not (active and not paused)
        self.step_button.disabled = not (paused or can_start)
        self.stop_button.disabled = not active
        self.loss.disabled = active
        from_cell = run is not None and run not in self._own_runs
        # a run started from a cell trains with its own step function: the tab's loss does not describe it
        self.loss.layout.display = "none" if from_cell and active else None
        self.run_description.value = (
            f'<span data-field="run-description">run of <code>{html.escape(_step_name(run))}</code> '
            f"started from a cell, {run.steps} steps</span>"
            if from_cell and run is not None
            else ""
        )
        if run is None:
            self.progress.max, self.progress.value = 1, 0
            self.progress_text.value = "no run yet"
            self.error.value = ""
            return
        self.progress.max = run.steps
        self.progress.value = run.i
        busy = " (step in progress)" if run.busy else ""
        state = "stopping…" if run.stopping else run.state.value
        self.progress_text.value = (
            f'<span data-field="run-progress">{state} · {run.i}/{run.steps}{busy}</span>'
        )
        self.progress.bar_style = {RunState.FAILED: "danger", RunState.FINISHED: "success"}.get(run.state, "")
        self.error.value = (
            f'<pre style="color:#b00020;white-space:pre-wrap">{html.escape(run.traceback)}</pre>'
            if run.traceback
            else ""
        )
        if active:
            self.steps.value = run.steps
            for name, value in dataclasses.asdict(run.next_adam_params).items():
                self.adam[name].value = value


def _step_name(run: Run) -> str:
    """The step function's name as its cell defined it (`rl_step`), or its type for a callable object."""
    fn = run.step_fn
    return fn.__qualname__ if isinstance(fn, types.FunctionType | types.MethodType) else type(fn).__name__
