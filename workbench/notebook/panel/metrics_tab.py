"""The Metrics tab: live plots of any history series, redrawn in place as the history grows.

The plot is a `LivePlot` (the same figure `sess.plot(...)` draws) on an ipympl canvas, the matplotlib
widget: its toolbar zooms and pans, and the value under the cursor shows beside it. A refresh redraws
only when the history has new rows, with `canvas.draw()`, which pushes the changed pixels to the page
from the panel's timer thread (while a cell is busy too). While a run is running it redraws at most
every RUNNING_RENDER_S, whatever the run's step rate (a redraw holds the GIL that the run's thread
needs for ~75 ms), and at most once per step of it (or after MAX_RENDER_INTERVAL_S): a step's rows (sampling, `forward_backward`,
`optim_step`) arrive over its duration, and a redraw for each refresh that saw one of them sent 31 KB
per step on a loaded machine, against a budget of 20 KB per step for the whole panel. A redraw that
sent more than PLOT_BYTES_PER_STEP (a rescaled axis, the first points) waits as many steps before the
next as its bytes take at that rate. The chosen metrics are tags (× removes one); a
metric is added by picking it in the box beside them (type to filter, Enter adds it: the same input in
JupyterLab and Notebook 7; a family of per-layer metrics is one name, `grad_norm/*`, `update_norm/*`,
`system/*`: one plot with a line per member); smoothing, a log scale, the x axis (step or wall clock) and runs to overlay (their model folders or
`history.jsonl` files) are controls of their own. When the history first holds an asynchronous run's
signals (`ASYNC_METRICS`: its staleness, the trainer's wait for samples and the samples' wait for the
trainer, per step), they join the chosen metrics beside the RL signals already plotted, once: a tag
removed stays removed.
"""

from __future__ import annotations

import io
import math
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import ipywidgets
import numpy as np
from ipympl.backend_nbagg import Canvas, FigureManager
from matplotlib.backend_tools import Cursors
from PIL import Image

from workbench.metrics import MetricsHistory, history_run_name
from workbench.notebook.panel.feedback import Feedback
from workbench.notebook.plots import MAX_COLUMNS, LivePlot, NotebookFigure, families
from workbench.notebook.run import RunMark, RunState

if TYPE_CHECKING:
    from workbench.notebook.session import Session

MAX_RENDER_INTERVAL_S = 5.0
"""The longest a plot waits, while a run is running, for its step to end before it shows the rows that
have arrived (a slow step's, or those of a run that never steps the optimizer)."""

RUNNING_RENDER_S = 5.0
"""The shortest time between two redraws of a running run's plot. A redraw of two plots takes ~75 ms
of CPU (Agg, the PNG, its palette), most of it holding the GIL that the run's thread needs between torch
calls: on `tiny` at 30 steps/s in a real kernel, a redraw every 0.5-2.5 s (each step's, as the timer's
CPU share let it) took 0.6-1.0 ms per step of the GIL; one every 5 s takes ~1.5% of a core."""

PLOT_BYTES_PER_STEP = 12_000
"""What the plot sends the page per step of a running run, at most on average: a redraw that sent N
bytes is followed by ceil(N / PLOT_BYTES_PER_STEP) steps (or MAX_RENDER_INTERVAL_S periods) before the
next. Tutorial 04's three plots send ~2 KB for a step's new segments, 5-9 KB for a step that rescales
an axis or two and ~12 KB for the first points; the progress line sends ~1.5 KB per step."""


def steps_between_renders(rendered_bytes: int) -> int:
    """The steps (or MAX_RENDER_INTERVAL_S periods) a running run's plot waits after a redraw that sent
    `rendered_bytes`: ceil(rendered_bytes / PLOT_BYTES_PER_STEP), at least one."""
    return max(1, math.ceil(rendered_bytes / PLOT_BYTES_PER_STEP))


ASYNC_METRICS = ("async/staleness:max", "async/trainer_wait_s", "async/sample_wait_s")
"""What `sess.run_async` records per step and the tab plots once they appear (see `async_run`)."""

INCHES_PER_PLOT = (3.4, 2.6)
"""One metric's plot, in inches; ipympl shows the figure at its own size (100 dpi: 340 × 260 px, so
three side by side fit Notebook 7's page, about 1070 px for an output, as they do JupyterLab's at 1280
px; at 370 px the third was cut)."""


def paletted_png(png: bytes) -> bytes:
    """An RGBA PNG of matplotlib's web canvas re-encoded with a palette of 255 colours and one
    transparent index: under half the bytes (tutorial 04's three plots: a step's new segments 3.9 to
    1.8 KB, a rescale 18.8 to 7.5 KB; ~35 ms), colours within 10/255 of the original (median cut over a
    line plot's few colours and their antialiased edges).

    The diff images that the canvas sends mark a pixel left as it was with alpha 0, and the figure's
    own pixels are opaque, so the transparent index 0 is given to alpha 0 alone: an opaque pixel never
    becomes see-through, nor a kept one painted over."""
    rgba = np.asarray(Image.open(io.BytesIO(png)).convert("RGBA"))
    quantized = Image.fromarray(np.ascontiguousarray(rgba[..., :3])).quantize(
        255, method=Image.Quantize.MEDIANCUT
    )
    indices = np.asarray(quantized) + 1
    indices[rgba[..., 3] == 0] = 0
    paletted = Image.fromarray(indices.astype(np.uint8), mode="P")
    paletted.putpalette([0, 0, 0, *quantized.getpalette()[: 3 * 255]])
    buffer = io.BytesIO()
    paletted.save(buffer, format="png", transparency=0, optimize=True)
    return buffer.getvalue()


class LockedCanvas(Canvas):
    """An ipympl canvas whose front-end messages (zoom, pan, resize) draw under the tab's lock: they
    arrive on the widget subshell's thread while the panel's timer redraws from its own.

    It sends the page PNGs of the changed pixels from its first draw. ipympl 0.10 starts a canvas
    "syncing its data URL" until the front end's `initialized` message is read, and meanwhile sends
    each redraw as the raw RGBA buffer (680 × 260 × 4 = 707 KB for two plots) plus a base64 PNG in the
    widget state; a kernel busy with a cell, or a slow route to the widget subshell, leaves it so for a
    whole run. The data URL serves pages without a live kernel, which the panel's saved record serves
    instead."""

    def __init__(self, figure: NotebookFigure, lock: threading.RLock) -> None:
        self.lock = lock
        super().__init__(figure)
        self.syncing_data_url = False
        self.sent_bytes = 0
        """The bytes of the images sent to the page so far."""

    def set_cursor(self, cursor: Cursors) -> None:
        """Every cursor but matplotlib's "wait" during a draw: a redraw takes ~50 ms, and the two cursor
        changes around it cost the page ~1.2 KB per step of a run."""
        if cursor is not Cursors.WAIT:
            super().set_cursor(cursor)

    def get_diff_image(self) -> bytes | None:
        """The changed pixels (all of them in ipympl's "full" image mode) as a paletted PNG."""
        png = super().get_diff_image()
        return None if png is None else paletted_png(png)

    def send_binary(self, data: bytes) -> None:
        self.sent_bytes += len(data)
        super().send_binary(data)

    def _handle_message(self, widget: object, content: dict[str, object], buffers: list[bytes]) -> None:
        with self.lock:
            super()._handle_message(widget, content, buffers)


class MetricsTab:
    """Metric tags, plot options and the live plot of the chosen metrics."""

    def __init__(self, session: Session, metrics: Sequence[str]) -> None:
        self.session = session
        self.feedback = Feedback()
        self.compared: dict[str, MetricsHistory] = {}
        """The runs overlaid on the plot, by name (their folder's name)."""
        self._offered_async: set[str] = set()  # ASYNC_METRICS already added to the chosen ones once
        initial = self._with_new_async_metrics(list(metrics))
        self.select = ipywidgets.TagsInput(
            value=initial, allowed_tags=self._options(initial), allow_duplicates=False
        )
        self.add_metric = ipywidgets.Combobox(
            placeholder="add a metric: type or pick one, then Enter",
            options=self._options(initial),
            ensure_option=True,
            continuous_update=False,
            layout=ipywidgets.Layout(width="24em"),
        )
        self.add_metric.add_class("wb-metrics-add")
        self.smoothing = ipywidgets.FloatSlider(
            value=0.0, min=0.0, max=0.99, step=0.01, description="smoothing", continuous_update=False
        )
        self.log_scale = ipywidgets.Checkbox(value=False, description="log scale", indent=False)
        self.x_axis = ipywidgets.ToggleButtons(
            options=[("step", "step"), ("wall clock", "time")], value="step"
        )
        self.x_axis.style.button_width = "7em"
        self.compare_path = ipywidgets.Text(
            placeholder="model folder or history.jsonl to overlay", layout=ipywidgets.Layout(width="28em")
        )
        self.compare_button = ipywidgets.Button(description="Overlay", icon="plus")
        self.compare_button.add_class("wb-metrics-overlay")
        self.figure = NotebookFigure(figsize=INCHES_PER_PLOT, layout="constrained")
        self._lock = threading.RLock()  # the panel's timer thread, widget callbacks and canvas events draw
        self.canvas = LockedCanvas(self.figure, self._lock)
        self._manager = FigureManager(self.canvas, 0)
        self.canvas.header_visible = False
        self.canvas.footer_visible = True  # the value under the cursor
        self.canvas.toolbar_position = "top"
        self.canvas.toolbar_visible = "visible"  # above the plot, not faded in over its y ticks
        self.canvas.add_class("wb-metrics-plot")
        self.plot: LivePlot | None = None
        self.renders = 0  # how many times the plot was redrawn
        self.rendered_bytes = 0  # the bytes the last redraw sent the page
        self._rendered_at = 0.0  # time.monotonic() of the last render
        self._rendered_mark: RunMark | None = None  # the run running then
        self._syncing = False
        self._unsent = False  # rows drawn into the figure (for the saved record) but not sent to the page
        self.select.observe(self.feedback.guard(self._on_select), names="value")
        self.add_metric.observe(self.feedback.guard(lambda change: self.add(change["new"])), names="value")
        for control in (self.smoothing, self.log_scale, self.x_axis):
            control.observe(self.feedback.guard(lambda _change: self._replot()), names="value")
        self.compare_button.on_click(
            self.feedback.guard(lambda _button: self.overlay(self.compare_path.value))
        )
        self.widget = ipywidgets.VBox(
            [
                ipywidgets.HBox([self.add_metric, self.select]),
                ipywidgets.HBox([self.smoothing, self.log_scale, self.x_axis]),
                ipywidgets.HBox([self.compare_path, self.compare_button]),
                self.canvas,
                self.feedback.widget,
            ]
        )
        self._replot()

    def _options(self, selected: Sequence[str]) -> list[str]:
        names = [*self.session.history.names(), *selected]
        for other in self.compared.values():
            names += other.names()
        return sorted(dict.fromkeys([*names, *families(names)]))

    def _with_new_async_metrics(self, chosen: list[str]) -> list[str]:
        """`chosen` plus the ASYNC_METRICS the history holds and that were not added before."""
        recorded = set(self.session.history.names())
        new = [name for name in ASYNC_METRICS if name in recorded and name not in self._offered_async]
        self._offered_async.update(new)
        return [*chosen, *(name for name in new if name not in chosen)]

    def overlay(self, path: str | Path) -> None:
        """Overlay the run whose folder (or `history.jsonl`) is `path`, named after its folder."""
        path = Path(str(path).strip()).expanduser()
        if not str(path) or not path.exists():
            raise ValueError(f"no model folder or history file at {str(path)!r}")
        history = MetricsHistory.from_jsonl(path)
        name = history_run_name(path)
        self.compared[name] = history
        self.feedback.info(f"overlaid {name} ({len(history)} rows)")
        self._replot()

    def show_runs(self, paths: Sequence[str | Path]) -> None:
        """Overlay exactly the runs whose folders (or `history.jsonl` files) are `paths`, in place of
        those overlaid before (the Runs tab's ticked rows); none removes every overlay."""
        self.compared = {history_run_name(path): MetricsHistory.from_jsonl(path) for path in paths}
        self.feedback.info(f"overlaid {', '.join(self.compared) or 'no run'}")
        self._replot()

    def add(self, name: str) -> None:
        """Plot metric `name` too (what picking it in the "add a metric" box does)."""
        if not name:
            return
        if name not in self._options(self.select.value):
            raise ValueError(f"no metric {name!r} recorded yet")
        if name not in self.select.value:
            self.select.value = [*self.select.value, name]
        self.add_metric.value = ""

    def _on_select(self, _change: dict[str, object]) -> None:
        if not self._syncing:
            self._replot()

    def _replot(self) -> None:
        """Start a new plot for the chosen metrics and options."""
        with self._lock:
            names = list(self.select.value)
            columns = min(max(len(names), 1), MAX_COLUMNS)
            rows = math.ceil(max(len(names), 1) / MAX_COLUMNS)
            self.figure.set_size_inches(INCHES_PER_PLOT[0] * columns, INCHES_PER_PLOT[1] * rows)
            self._manager.resize(*self.figure.bbox.size)  # the page shows it at this size, unstretched
            if not names:
                self.plot = None
                self.figure.clear()
                self._render()
                return
            self.plot = LivePlot(
                names,
                fig=self.figure,
                smoothing=self.smoothing.value,
                log_scale=self.log_scale.value,
                x_axis=self.x_axis.value,
                compare=self.compared,
            )
            self.plot.update(self.session.history, self._run_end_step())
            self._render()

    def _render(self) -> None:
        sent = self.canvas.sent_bytes
        self.canvas.draw()  # renders and sends the changed pixels to the page
        self.rendered_bytes = self.canvas.sent_bytes - sent
        self._unsent = False
        self.renders += 1
        self._rendered_at = time.monotonic()
        run = self.session.current_run
        self._rendered_mark = None if run is None else run.mark()

    def _run_end_step(self) -> int | None:
        """The step the current run ends at when it runs all its steps (None: no run)."""
        run = self.session.current_run
        return None if run is None else run.started_step + run.steps

    def _render_due(self) -> bool:
        """Whether new rows are drawn now: always when no run is running; during one, once
        RUNNING_RENDER_S have passed since the last render and the steps of the run since then (the
        first refresh that sees its step counter past the last render's) and the MAX_RENDER_INTERVAL_S
        periods add up to `steps_between_renders`."""
        run = self.session.current_run
        if run is None or run.state is not RunState.RUNNING:
            return True
        since = time.monotonic() - self._rendered_at
        if since < RUNNING_RENDER_S:
            return False
        periods = int(since / MAX_RENDER_INTERVAL_S)
        return run.steps_since(self._rendered_mark) + periods >= steps_between_renders(self.rendered_bytes)

    def png(self) -> bytes | None:
        """The plots as PNG bytes (None with no metric chosen), for the panel's saved record: the whole
        run, without a zoom the user left on the toolbar."""
        with self._lock:
            if self.plot is None:
                return None
            # up to date even while the tab is hidden
            if self.plot.update(self.session.history, self._run_end_step()):
                self._unsent = True
            with self.plot.unzoomed(self._run_end_step()):
                return self.figure._repr_png_()

    def opened(self) -> None:
        """Nothing to catch up on: its next refresh draws what is new."""

    def refresh(self) -> None:
        with self._lock:
            options = self._options(self.select.value)
            if list(self.select.allowed_tags) != options:
                self._syncing = True
                try:
                    self.select.allowed_tags = options
                    self.add_metric.options = options
                finally:
                    self._syncing = False
                chosen = self._with_new_async_metrics(list(self.select.value))
                if chosen != list(self.select.value):
                    self.select.value = chosen  # replots
            if self.plot is not None and self._render_due():
                updated = self.plot.update(self.session.history, self._run_end_step())
                if updated or self._unsent:
                    self._render()
