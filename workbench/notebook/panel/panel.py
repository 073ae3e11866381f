"""The notebook panel: one widget over a Session: a status bar and Train / Sample / Checkpoints /
Metrics / Runs / Rollouts / Sweep tabs.

The tabs are one table, `TABS`: a row says a tab's title, how its part is built, and when it is redrawn
while hidden (`HiddenRedraw`); the tab bar, the parts and each refresh are made from it, so a new tab is
a module in this package and a row.

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

import dataclasses
import enum
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import ipywidgets
from IPython.display import display

from workbench.engine.worker import SessionClosedError
from workbench.notebook.alerts import ALERT_TITLE, alert_text
from workbench.notebook.panel.alert_banner import AlertBanner
from workbench.notebook.panel.checkpoints_tab import CheckpointsTab
from workbench.notebook.panel.feedback import FREED, Feedback
from workbench.notebook.panel.metrics_tab import MetricsTab
from workbench.notebook.panel.progress_line import ProgressLine
from workbench.notebook.panel.record import HIDE_WHILE_LIVE, PANEL_TEXT, PanelRecord, record_body
from workbench.notebook.panel.rollouts_tab import RolloutExplorer, RolloutsTab
from workbench.notebook.panel.runs_tab import RunsTab
from workbench.notebook.panel.sample_tab import SampleTab
from workbench.notebook.panel.status import StatusBar
from workbench.notebook.panel.sweep_tab import SweepTab
from workbench.notebook.panel.train_tab import TrainTab
from workbench.notebook.run import RunState
from workbench.notebook.widget_subshell import answer_while_busy

if TYPE_CHECKING:
    from workbench.notebook.run import Run
    from workbench.notebook.session import Session

REFRESH_S = 1.0
"""How often the panel re-reads the session, at most. Each refresh that a run moved sends the page the
status bar and the progress line, which the browser lays out and paints again on the cores the run
trains on; once a second is as often as a reader follows a changing number."""
CPU_SHARE = 0.03
"""The share of one core's time the panel's timer may spend refreshing. A refresh holds the GIL that the
run's thread needs between torch calls, so it slows training by about this share: the timer waits
`max(REFRESH_S, refresh CPU seconds / CPU_SHARE)` between refreshes (a costly redraw, a busy machine:
the panel refreshes less often instead of slowing the run more)."""


PANEL_STYLE = (
    "<style>"
    # ipympl lays its toolbar over the figure's top right corner, on the rightmost plot's title
    ".wb-metrics-plot .jupyter-matplotlib-toolbar{position:static;order:-1;align-self:flex-end}"
    # an HTML widget's content takes its width from the panel, so the status bar's fields and the
    # rollout cards wrap within it instead of running past its right edge
    ".wb-status>.widget-html-content,.wb-rollout-groups>.widget-html-content{min-width:0;flex:1 1 auto}"
    "</style>"
)
"""The panel's layout rules at widths down to Notebook 7's page (1400 px windows and narrower)."""


def run_settled(run: Run | None) -> object:
    """What the saved record is rewritten for: None while `run` takes steps, else the run and where it
    stopped (a new value: the record is rewritten)."""
    if run is not None and run.taking_steps:
        return None
    return (id(run), run and run.state, run and run.i)


def sweep_settled(session: Session) -> object:
    """`run_settled` for the session's newest sweep: None while a member trains, else the sweep and
    where each member stopped."""
    sweep = session.sweeps[-1] if session.sweeps else None
    if sweep is None:
        return ()
    if sweep.state is RunState.RUNNING:
        return None
    return (id(sweep), tuple((m.model_id, m.state, m.i) for m in sweep.members))


def panel_settled(session: Session | None) -> object:
    """What the saved record is rewritten for: None while the current run or the newest sweep trains,
    else both where they stopped."""
    if session is None:
        return run_settled(None)
    run, sweep = run_settled(session.current_run), sweep_settled(session)
    return None if run is None or sweep is None else (run, sweep)


class TabPart(Protocol):
    """What a tab is: its `widget`, a `refresh()` that re-reads the session, and what `opened()` catches
    up on before the redraw that opening the tab brings."""

    @property
    def widget(self) -> ipywidgets.Widget: ...

    def refresh(self) -> None: ...

    def opened(self) -> None: ...


@dataclasses.dataclass(frozen=True)
class TabInputs:
    """What a tab is built from: the session (held weakly, as every part holds it), the panel's
    arguments, and the panel's own moves a tab may make."""

    session: Session
    train_data: Sequence[Any] | None
    metrics: Sequence[str]
    sample_prompt: Callable[[list[int]], None]
    """Open the Sample tab on these exact prompt tokens."""
    overlay_runs: Callable[[Sequence[Path]], None]
    """Overlay these model folders' histories in the Metrics tab, and open it."""


class HiddenRedraw(enum.Enum):
    """When a hidden tab is redrawn. A redraw sends the page what changed; a shown tab is redrawn at
    every refresh while its session is open, and opening a tab refreshes the panel at once."""

    EVERY_REFRESH = "every refresh"
    """Like a shown tab: what it shows changes seldom (the checkpoints)."""
    BETWEEN_RUNS = "between runs"
    """Only while no run takes steps: it shows the run, whose every step the progress line above the tabs
    already shows. It reads the run from memory, so it is also redrawn after the session closed (a run
    that ended as its session closed is shown ended)."""
    WHEN_OPENED = "when opened"
    """Never: what it shows changes at every step (the weights versions, the plots, the rollouts)."""

    def redraws(self, *, shown: bool, run_taking_steps: bool, session_closed: bool) -> bool:
        if session_closed and self is not HiddenRedraw.BETWEEN_RUNS:
            return False
        if shown or self is HiddenRedraw.EVERY_REFRESH:
            return True
        return self is HiddenRedraw.BETWEEN_RUNS and not run_taking_steps


@dataclasses.dataclass(frozen=True)
class PanelTab:
    """One tab of the panel: its title, how its part is built, and when it is redrawn hidden."""

    title: str
    build: Callable[[TabInputs], TabPart]
    hidden: HiddenRedraw


TABS = (
    PanelTab("Train", lambda given: TrainTab(given.session, given.train_data), HiddenRedraw.BETWEEN_RUNS),
    PanelTab("Sample", lambda given: SampleTab(given.session), HiddenRedraw.WHEN_OPENED),
    PanelTab("Checkpoints", lambda given: CheckpointsTab(given.session), HiddenRedraw.EVERY_REFRESH),
    PanelTab("Metrics", lambda given: MetricsTab(given.session, given.metrics), HiddenRedraw.WHEN_OPENED),
    PanelTab(
        "Runs",
        lambda given: RunsTab(given.session, (*given.metrics, "loss:sum")[0], given.overlay_runs),
        HiddenRedraw.WHEN_OPENED,
    ),
    PanelTab(
        "Rollouts", lambda given: RolloutsTab(given.session, given.sample_prompt), HiddenRedraw.WHEN_OPENED
    ),
    PanelTab("Sweep", lambda given: SweepTab(given.session, given.metrics), HiddenRedraw.WHEN_OPENED),
)
"""The panel's tabs, in their order: the tab bar, the parts and the refreshes are made from this table."""

PartT = TypeVar("PartT")


class Panel(ipywidgets.VBox):
    """The session's panel; create it with `sess.panel(train_data=..., metrics=...)`.

    Parts (each a thin view with a `refresh()`): `status` (the status bar), `progress` (the run's
    progress line: step, speed, ETA, latest loss and reward, a fired trigger), and one per row of `TABS`
    in `parts`: `train`, `sample`, `checkpoints`, `metrics`, `runs` (the runs table), `rollouts` (the
    rollout explorer) and `sweep` (the newest sweep's members) name them; the tabs are in `tabs`; `alert` is a trigger's banner and notification.
    `refresh()` redraws everything at once; a timer does it every `REFRESH_S` until the panel is closed or
    the session is.
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
        self.alert = AlertBanner()
        """The banner and page notification of a trigger that paused the run."""
        self.tab_rows = TABS
        """The table the tabs were made from (`TABS` when the panel was made)."""
        given = TabInputs(view, train_data, metrics, self._sample_prompt, self._overlay_runs)
        self.parts: tuple[TabPart, ...] = tuple(tab.build(given) for tab in self.tab_rows)
        self.tabs = ipywidgets.Tab(
            children=[part.widget for part in self.parts], titles=[tab.title for tab in self.tab_rows]
        )
        self.record = PanelRecord(self._snapshot)
        super().__init__(
            [
                ipywidgets.HTML(PANEL_STYLE + HIDE_WHILE_LIVE),
                self.status.widget,
                self.progress.widget,
                self.alert.widget,
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
        self.tabs.observe(lambda _change: self._tab_opened(), names="selected_index")
        self.refresh_interval = REFRESH_S
        """Seconds the timer waits between refreshes now (see `CPU_SHARE`)."""
        self.refresh()
        answer_while_busy(self)
        self._timer = threading.Thread(target=self._poll, name="workbench-panel", daemon=True)
        self._timer.start()
        _live_panels.add(self)

    def _part(self, kind: type[PartT]) -> PartT:
        return next(part for part in self.parts if isinstance(part, kind))

    @property
    def train(self) -> TrainTab:
        return self._part(TrainTab)

    @property
    def sample(self) -> SampleTab:
        return self._part(SampleTab)

    @property
    def checkpoints(self) -> CheckpointsTab:
        return self._part(CheckpointsTab)

    @property
    def metrics(self) -> MetricsTab:
        return self._part(MetricsTab)

    @property
    def rollouts(self) -> RolloutExplorer:
        return self._part(RolloutsTab).explorer

    @property
    def runs(self) -> RunsTab:
        return self._part(RunsTab)

    @property
    def sweep(self) -> SweepTab:
        return self._part(SweepTab)

    def tab_index(self, title: str) -> int:
        """The position of the tab titled `title` (for `tabs.selected_index`)."""
        return next(i for i, tab in enumerate(self.tab_rows) if tab.title == title)

    def _ipython_display_(self) -> None:
        """Show the panel and, under it, its saved record (see `workbench.notebook.panel.record`)."""
        display(self._repr_mimebundle_(), raw=True)
        session = self._session()
        self.record.display(panel_settled(session))

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, Any]:
        """The widget's view, and a short `text/plain` for where there is no kernel (`PANEL_TEXT`)."""
        return {**super()._repr_mimebundle_(**kwargs), "text/plain": PANEL_TEXT}

    def _snapshot(self) -> tuple[str, bytes | None]:
        self.train.refresh()  # hidden while a run runs, the tab is not redrawn at every step
        body = record_body(
            self.status.widget.value, self.progress.widget.value, self.train.progress_text.value
        )
        return body + self.sweep.record_html(), self.metrics.png()

    def _sample_prompt(self, tokens: list[int]) -> None:
        """The Rollouts tab's "Sample this prompt": the Sample tab, on the rollout's exact prompt."""
        self.sample.use_prompt(tokens)
        self.tabs.selected_index = self.tab_index("Sample")

    def _overlay_runs(self, folders: Sequence[Path]) -> None:
        """The Runs tab's "Overlay in Metrics": these runs on the Metrics tab's plots, which opens."""
        self.metrics.show_runs(folders)
        self.tabs.selected_index = self.tab_index("Metrics")

    @property
    def session(self) -> Session:
        """The session shown (SessionClosedError once it was freed)."""
        session = self._session()
        if session is None:
            raise SessionClosedError(FREED)
        return session

    def refresh(self) -> None:
        """Re-read the session and redraw every part: the status, the progress line, and each tab when
        its row's `hidden` says so."""
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
            running = run is not None and run.taking_steps
            if run is not None and run.trigger is not None:
                self.alert.show(run.trigger, ALERT_TITLE, alert_text(session.model_id, run.trigger))
            else:
                self.alert.clear()
            redrawn = []
            for i, (tab, part) in enumerate(zip(self.tab_rows, self.parts, strict=True)):
                shown = self.tabs.selected_index == i
                if tab.hidden.redraws(shown=shown, run_taking_steps=running, session_closed=session.closed):
                    part.refresh()
                    redrawn.append(part)
            self.record.refresh(panel_settled(session))
        # the widgets a refresh added (histogram bars) answer while a cell runs; only the tabs redrawn
        # can have added any, and walking the whole panel's ~200 widgets at every refresh took ~7 ms
        for part in redrawn:
            answer_while_busy(part.widget)

    def _tab_opened(self) -> None:
        """A tab opened shows what is new at once."""
        index = self.tabs.selected_index
        if index is not None:
            self.parts[index].opened()
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
