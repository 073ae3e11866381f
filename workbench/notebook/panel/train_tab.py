"""The Train tab: the loss and AdamParams to train with, and the controls of the session's run.

The tab holds no training state. Its buttons act on `sess.current_run` (pause / step / resume / stop
what a cell or an earlier click started) and, when no run is active, start one with `sess.run` on the
panel's training data, exactly as a cell would:

    sess.run(wb.train_step(train_data, loss), steps, adam_params=<the tab's AdamParams>)

Step starts a one-step run; Run starts a run of the tab's step count. While a run is active, editing an
AdamParams field calls `run.set(...)` (applied from the next step), and the fields show the run's
settings, so a `run.set` from a cell shows here too. An edit is reported as requested until the run
has applied it (a step in progress keeps the settings it started with), then as applied, with the run
step it applied from. The loss is fixed for a run's lifetime: it is part of the run's step function.
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
        self.settings_note = ipywidgets.HTML()
        """Whether the last AdamParams edit of the active run is still requested or applied, and when."""
        self.settings_note.add_class("wb-train-settings")
        self._requested: dict[str, float] = {}  # edits the run has not applied yet
        self._applied: dict[str, tuple[float, int]] = {}  # edits applied: value, run step applied from
        self._noted_run: Run | None = None

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
                self.settings_note,
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
                self._follow(run)
                self._requested[name] = value
                self._applied.pop(name, None)
                self._note_settings(run)

    def _follow(self, run: Run) -> None:
        """Forget the edits of an earlier run."""
        if run is not self._noted_run:
            self._requested, self._applied, self._noted_run = {}, {}, run

    def _note_settings(self, run: Run) -> None:
        """Move edits the run has applied from requested to applied, and say where each one stands."""
        self._follow(run)
        in_use = dataclasses.asdict(run.adam_params)
        for name, value in list(self._requested.items()):
            if in_use[name] == value:
                del self._requested[name]
                self._applied[name] = (value, run.adam_params_from)
        notes = [
            f'<span data-field="requested-{name}" style="color:#8a5a00">{name} {value:g} requested: '
            f"the step in progress trains with {in_use[name]:g}</span>"
            for name, value in self._requested.items()
        ] + [
            f'<span data-field="applied-{name}" style="color:#1b5e20">{name} = {value:g} applied from run '
            f"step {step}</span>"
            for name, (value, step) in self._applied.items()
        ]
        self.settings_note.value = " · ".join(notes)

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

    def opened(self) -> None:
        """Nothing to catch up on: its next refresh draws what is new."""

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
            self.settings_note.value = ""
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
        self.progress.bar_style = (
            "danger"
            if run.state is RunState.FAILED or run.error is not None
            else {RunState.FINISHED: "success"}.get(run.state, "")
        )
        self.error.value = (
            f'<pre style="color:#b00020;white-space:pre-wrap">{html.escape(run.traceback)}</pre>'
            if run.traceback
            else ""
        )
        self._note_settings(run)
        if active:
            self.steps.value = run.steps
            for name, value in dataclasses.asdict(run.next_adam_params).items():
                self.adam[name].value = value


def _step_name(run: Run) -> str:
    """The step function's name as its cell defined it (`rl_step`), or its type for a callable object."""
    fn = run.step_fn
    return fn.__qualname__ if isinstance(fn, types.FunctionType | types.MethodType) else type(fn).__name__
