"""The notebook panel: one widget over a Session: a status bar and Train / Sample / Checkpoints /
Metrics tabs.

The panel is a view: every control calls the public method a cell would (`sess.run`, `run.pause`,
`run.set`, ...), and every refresh re-reads the session, its current run and its history, so what a
cell does shows up in the panel and what the panel does can be scripted without it.

Widget callbacks run on the kernel's main thread, which a busy cell blocks; training therefore runs on
the run's thread and the panel redraws itself from a timer thread of its own every `REFRESH_S`, so the
status, progress and plots move while a cell is busy and while the kernel is idle alike. Widget state
changes made from that thread reach the front end through the kernel's comm channel, as tqdm's
progress bars do from worker threads.

The panel holds its session weakly. ipywidgets keeps every widget alive until it is closed, so a panel
holding its session would keep the model in memory after the notebook let go of it (re-running the
cell that made both); instead the session is freed then, the panel says so, and its timer ends. Keep a
reference to the session (`sess = wb.Session(...)`) for as long as its panel is used.

At interpreter exit every panel's timer is stopped before the interpreter tears down
(`_stop_live_timers`): a redraw still running then could be inside matplotlib or torch when the
interpreter kills daemon threads, which aborts the process.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets
from IPython.display import display

from workbench.engine.worker import SessionClosedError
from workbench.notebook.panel.checkpoints_tab import CheckpointsTab
from workbench.notebook.panel.feedback import FREED, Feedback
from workbench.notebook.panel.metrics_tab import MetricsTab
from workbench.notebook.panel.progress_line import ProgressLine
from workbench.notebook.panel.record import HIDE_WHILE_LIVE, PanelRecord
from workbench.notebook.panel.sample_tab import SampleTab
from workbench.notebook.panel.status import StatusBar
from workbench.notebook.panel.train_tab import TrainTab
from workbench.notebook.rollouts_view import RolloutExplorer
from workbench.notebook.run import Run, RunMark, RunState
from workbench.notebook.widget_subshell import answer_while_busy

if TYPE_CHECKING:
    from workbench.notebook.session import Session

REFRESH_S = 0.5
"""How often the panel re-reads the session, at most."""
TRAIN_TAB, SAMPLE_TAB, METRICS_TAB, ROLLOUTS_TAB = 0, 1, 3, 4
"""The positions of the tabs that are redrawn only while shown (the Train tab: while a run runs)."""
ROLLOUTS_FOLLOW_S = 5.0
"""While a run runs, the Rollouts tab follows its new batches at most this often (and at once when it is
opened): a batch of an RL tutorial's 32 replies is about 10 KB for the page, and nobody reads 32 replies
in less."""
ROLLOUTS_FOLLOW_STEPS = 2
"""... and at most every this many of its steps: a batch of tutorial 04's first, untrained steps (the
longest replies) is ~18 KB for the page, and a run whose steps take longer than ROLLOUTS_FOLLOW_S sent
one at every step, 24 KB per step with the rest of the panel against a budget of 20 KB."""
CPU_SHARE = 0.03
"""The share of one core's time the panel's timer may spend refreshing. A refresh holds the GIL that the
run's thread needs between torch calls, so it slows training by about this share: the timer waits
`max(REFRESH_S, refresh CPU seconds / CPU_SHARE)` between refreshes (a costly redraw, a busy machine:
the panel refreshes less often instead of slowing the run more)."""


class Panel(ipywidgets.VBox):
    """The session's panel; create it with `sess.panel(train_data=..., metrics=...)`.

    Parts (each a thin view with a `refresh()`): `status` (the status bar), `progress` (the run's
    progress line: step, speed, ETA, latest loss and reward, a fired trigger), `train`, `sample`,
    `checkpoints`, `metrics`, `rollouts` (the rollout explorer); the tabs are in `tabs`. `refresh()`
    redraws everything at once; a timer does it every `REFRESH_S` until the panel is closed or the
    session is.
    """

    def __init__(
        self,
        session: Session,
        *,
        train_data: Sequence[Any] | None = None,
        metrics: Sequence[str] = ("loss:sum",),
    ) -> None:
        self._session = weakref.ref(session)
        view = weakref.proxy(session)  # what every part holds: the session, weakly
        self.feedback = Feedback()
        self.status = StatusBar(view)
        self.progress = ProgressLine(view)
        self.train = TrainTab(view, train_data)
        self.sample = SampleTab(view)
        self.checkpoints = CheckpointsTab(view)
        self.metrics = MetricsTab(view, metrics)
        self.rollouts = RolloutExplorer(
            session.rollouts, session.tokenizer, sample_prompt=self._sample_prompt
        )
        self.tabs = ipywidgets.Tab(
            children=[
                self.train.widget,
                self.sample.widget,
                self.checkpoints.widget,
                self.metrics.widget,
                self.rollouts,
            ],
            titles=("Train", "Sample", "Checkpoints", "Metrics", "Rollouts"),
        )
        self.record = PanelRecord(self._snapshot)
        super().__init__(
            [
                ipywidgets.HTML(HIDE_WHILE_LIVE),
                self.status.widget,
                self.progress.widget,
                self.tabs,
                self.feedback.widget,
            ]
        )
        self.add_class("wb-panel")
        self._refreshing = threading.Lock()
        self._closing = threading.Event()
        self._wake = threading.Event()  # set: the timer refreshes now instead of at its next tick
        for button in (
            self.train.run_button,
            self.train.pause_button,
            self.train.step_button,
            self.train.stop_button,
        ):
            button.on_click(lambda _button: self.refresh_soon())  # the status and progress agree at once
        self._rollouts_followed_at = -math.inf
        self._rollouts_followed_mark: RunMark | None = None  # the run running then
        self.tabs.observe(lambda _change: self._tab_opened(), names="selected_index")
        self.refresh_interval = REFRESH_S
        """Seconds the timer waits between refreshes now (see `CPU_SHARE`)."""
        self.refresh()
        answer_while_busy(self)
        self._timer = threading.Thread(target=self._poll, name="workbench-panel", daemon=True)
        self._timer.start()
        _live_panels.add(self)

    def _ipython_display_(self) -> None:
        """Show the panel and, under it, its saved record (see `workbench.notebook.panel.record`)."""
        display(self._repr_mimebundle_(), raw=True)
        self.record.display()

    def _snapshot(self) -> tuple[str, bytes | None]:
        self.train.refresh()  # hidden while a run runs, the tab is not redrawn at every step
        run_state = self.train.progress_text.value
        body = (
            self.status.widget.value
            + self.progress.widget.value
            + (f"<div>{run_state}</div>" if run_state else "")
        )
        return body, self.metrics.png()

    def _sample_prompt(self, tokens: list[int]) -> None:
        """The Rollouts tab's "Sample this prompt": the Sample tab, on the rollout's exact prompt."""
        self.sample.use_prompt(tokens)
        self.tabs.selected_index = 1

    @property
    def session(self) -> Session:
        """The session shown (SessionClosedError once it was freed)."""
        session = self._session()
        if session is None:
            raise SessionClosedError(FREED)
        return session

    def refresh(self) -> None:
        """Re-read the session and redraw every part."""
        with self._refreshing:
            session = self._session()
            if session is None:
                self.status.show_freed()
                return
            self.status.refresh()
            # the run's last state is read from memory, also after the session closed: a run that ended
            # and a session closed between two refreshes would otherwise stay "running" in the page
            self.progress.refresh()
            run = session.current_run
            running = run is not None and run.state is RunState.RUNNING and not run.stopping
            # the Train tab's progress bar and text change at every step, which the progress line above
            # the tabs already shows: hidden, the tab is redrawn when the run pauses or ends, or is opened
            if self.tabs.selected_index == TRAIN_TAB or not running:
                self.train.refresh()
            if not session.closed:
                self._refresh_tabs(run, running)
            self.record.refresh(None if running else (id(run), run and run.state, run and run.i))
        answer_while_busy(self)  # the widgets a refresh added (histogram bars) answer while a cell runs

    def _refresh_tabs(self, run: Run | None, running: bool) -> None:
        self.checkpoints.refresh()
        # a hidden tab whose content changes every step (the Sample tab's list of weights versions, the
        # plots, the rollouts) is redrawn when it is opened, not on every step
        if self.tabs.selected_index == SAMPLE_TAB:
            self.sample.refresh()
        if self.tabs.selected_index == METRICS_TAB:
            self.metrics.refresh()
        if self.tabs.selected_index == ROLLOUTS_TAB and (not running or self._rollouts_due(run)):
            shown = self.rollouts.batch
            self.rollouts.refresh()
            if self.rollouts.batch != shown:  # followed to a new batch (not: none yet, or one chosen)
                self._rollouts_followed_at = time.monotonic()
                self._rollouts_followed_mark = None if run is None else run.mark()

    def _rollouts_due(self, run: Run | None) -> bool:
        """Whether the Rollouts tab follows a running `run` now: ROLLOUTS_FOLLOW_S and
        ROLLOUTS_FOLLOW_STEPS after it last did."""
        if time.monotonic() - self._rollouts_followed_at < ROLLOUTS_FOLLOW_S:
            return False
        return run is None or run.steps_since(self._rollouts_followed_mark) >= ROLLOUTS_FOLLOW_STEPS

    def _tab_opened(self) -> None:
        """A tab opened shows what is new at once."""
        self._rollouts_followed_at = -math.inf
        self._rollouts_followed_mark = None
        self.refresh_soon()

    def refresh_soon(self) -> None:
        """Have the timer refresh the panel now (a tab was opened, a control changed the run), without
        waiting for a refresh in progress: a widget callback that waited would hold up the clicks
        behind it."""
        self._wake.set()

    def _poll(self) -> None:
        while True:
            self._wake.wait(self.refresh_interval)
            self._wake.clear()
            if self._closing.is_set():
                return
            started = time.thread_time()
            try:
                self.refresh()
            except Exception as error:  # shown in the panel: a timer thread has nobody else to tell
                self.feedback.error(error)
            if self._ended():
                return
            self.refresh_interval = max(REFRESH_S, (time.thread_time() - started) / CPU_SHARE)

    def _ended(self) -> bool:
        """The session is closed or freed (asked in a call of its own, so that the timer holds no
        reference to the session while it waits)."""
        session = self._session()
        return session is None or session.closed

    @property
    def polling(self) -> bool:
        """True while the timer thread redraws the panel."""
        return self._timer.is_alive()

    def stop_polling(self) -> None:
        """Stop the timer (after the redraw in progress); the widgets stay as they are."""
        self._closing.set()
        self._wake.set()
        if threading.current_thread() is not self._timer:
            self._timer.join()

    def close(self) -> None:
        """Stop the timer and close the widgets."""
        self.stop_polling()
        super().close()


_live_panels: weakref.WeakSet[Panel] = weakref.WeakSet()
"""Every panel not yet freed (a polling panel's timer thread holds it)."""


def _stop_live_timers() -> None:
    """Stop every panel's timer when the main thread finishes, while threads can still run normally.

    Registered with `threading._register_atexit` (see `workbench.engine.worker._close_live_workers`).
    """
    for panel in list(_live_panels):
        panel.stop_polling()


# The stdlib's hook for exactly this (what concurrent.futures uses); it has no public spelling.
threading._register_atexit(_stop_live_timers)  # noqa: SLF001
