"""Matplotlib plots of the metrics history: one axes per metric, against the optimizer step or time.

Figures are built with `matplotlib.figure.Figure`, not `pyplot`, so nothing is registered in pyplot's
global figure list: a notebook shows a figure once (when a cell returns it), a live panel that redraws
every second leaks nothing, and everything works headless (PNG bytes come from the Agg renderer
whatever the backend). A bare `Figure` shows as text in a kernel where neither pyplot nor `%matplotlib`
has loaded the inline backend, so the figures made here carry their own `_repr_png_`. The panel's
Metrics tab shows the same figure on an ipympl canvas (zoom, pan, the value under the cursor).

A metric can come from several kinds of row (the training `forward_backward` loss and a held-out
`forward` loss; the policy and the critic), so each axes draws one line per `model/op`, labelled when
there is more than one; runs compared from their history files (`compare=`) add theirs, prefixed by the
run's name. A name ending in `/*` is a family (`grad_norm/*`: each adapter module's gradient norm), one
line per member in one axes. NaN values stay in the line data: matplotlib breaks the line there, so a diverged step
shows as a gap instead of being smoothed away.

What researchers expect from W&B and TensorBoard, here: all axes share one x range (a metric recorded
after the update, like `grad_norm` at step 1, starts where the others do); `smoothing` draws a
debiased exponential moving average over a faint raw line (TensorBoard's formula); `log_scale` puts
positive metrics on a log axis; `x_axis="time"` plots against seconds since the first row; values are
written out in full (no "1e-5+1" offset); the value under the cursor (ipympl's footer, matplotlib's
`format_coord`) is each line's value at the step nearest the cursor, not the cursor's own (x, y); a
metric with a single point is drawn as a marker on a ±1 step axis; a step that did not train (a batch with nothing to learn
from records its metrics at the same optimizer step as the next one) is drawn as a hollow marker on
that step, not joined to the line, which would draw a vertical stroke. A live plot's axes keep their
limits until the data passes one (`held_limits`), and its axes keep their places until a tick label
outgrows its room (`HeldLayout`), so a redraw for a new step changes few pixels (what a live canvas
sends is the changed pixels); a zoom of the toolbar is kept while rows arrive.
"""

from __future__ import annotations

import contextlib
import io
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.lines import Line2D
from matplotlib.text import Text
from matplotlib.textpath import text_to_path
from matplotlib.ticker import AutoLocator, FuncFormatter, LogLocator, MaxNLocator, NullLocator
from matplotlib.transforms import nonsingular

from workbench.metrics import MetricsHistory

MAX_COLUMNS = 3
MAX_POINTS_WITH_MARKERS = 50  # beyond this, markers hide the line's shape
MARGIN = 0.05  # of the data's span on each side of an axis (matplotlib's default margin)
HEADROOM = 0.5
"""How far past its data an axis reaches when the data outgrows it, as a fraction of the data's span,
on the side the data passed. A new step then moves no axis until its value passes a limit, so a live
redraw changes only the new segment's pixels (the panel sends the page a PNG of the pixels that
changed: ~0.6 KB a plot, where a rescaled plot is ~5 KB), and a run of N steps rescales O(log N) times.
The data then fills 1 / (1 + 2·MARGIN + HEADROOM) = 62% of the axis after a rescale; at 0.25, tutorial
04's plots sent 9% more bytes over its 15 steps."""


def held_limits(shown: tuple[float, float] | None, low: float, high: float, log: bool) -> tuple[float, float]:
    """The limits an axis shows for data spanning [low, high]: `shown` (the limits it showed) while the
    data is inside them; otherwise the data's span with MARGIN on each side, plus HEADROOM on each side the
    data passed. On a log axis the spans are of log10 of the values."""
    forward, back = (math.log10, lambda value: 10.0**value) if log else (float, float)
    low_data, high_data = forward(low), forward(high)
    if shown is None:
        low_shown, high_shown = math.inf, -math.inf
    else:
        low_shown, high_shown = forward(shown[0]), forward(shown[1])
        if low_shown < low_data and high_data < high_shown:  # inside, not on the frame
            return shown
    low_data, high_data = nonsingular(low_data, high_data, expander=MARGIN)
    span = high_data - low_data
    passed_low = shown is not None and low_data < low_shown
    passed_high = shown is not None and high_data > high_shown
    return (
        back(low_data - span * (MARGIN + HEADROOM * passed_low)),
        back(high_data + span * (MARGIN + HEADROOM * passed_high)),
    )


FAMILY = "/*"
"""A metric name ending in this names a family: every metric under the prefix, drawn in one axes (the
optimizer step's `grad_norm/*` and `update_norm/*`, one line per adapter layer; `system/*`)."""
MAX_LEGEND_LINES = 12
"""Beyond this many lines an axes shows no legend (a family of 30 layers); the footer names each."""


def row_values(row: Mapping[str, Any], name: str) -> list[tuple[str, float]]:
    """What `row` holds of metric `name`: [("", value)], or for a family (`"grad_norm/*"`) each member's
    (its name past the prefix, value); [] when it holds none."""
    if not name.endswith(FAMILY):
        return [("", row[name])] if name in row else []
    prefix = name[: -len(FAMILY) + 1]
    return [(key[len(prefix) :], value) for key, value in row.items() if key.startswith(prefix)]


def families(names: Sequence[str]) -> list[str]:
    """The family names (`"grad_norm/*"`) of the metrics in `names` that share a prefix with another."""
    counts: dict[str, int] = {}
    for name in names:
        if "/" in name and not name.endswith(FAMILY):
            family = name.rsplit("/", 1)[0] + FAMILY
            counts[family] = counts.get(family, 0) + 1
    return [family for family, count in counts.items() if count > 1]


X_TICKS = 5
"""At most this many ticks on the x axis: a panel's plot is 340 px wide, room for five labels of "12.5k"."""


def step_label(x: float, _position: int | None = None) -> str:
    """A step tick's label, short past a thousand ("2.5k", "120k", "1.2M"): "12500" and its neighbours
    ran together on a panel's 340-pixel plot after a few thousand steps."""
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:g}"


def metric_lines(history: MetricsHistory, name: str) -> dict[str, tuple[list[int], list[float]]]:
    """The steps and values of one metric, split by the `model/op` of the rows that carry it (and, for a
    family, by member: `"policy/optim_step layers.0.mlp.up_proj"`)."""
    lines: dict[str, tuple[list[int], list[float]]] = {}
    for row in history:
        for member, value in row_values(row, name):
            label = f"{row['model']}/{row['op']}" + (f" {member}" if member else "")
            steps, values = lines.setdefault(label, ([], []))
            steps.append(row["step"])
            values.append(value)
    return lines


YLabels = tuple[tuple[float, bool], ...]
"""Per axes: the width of its widest y tick label in points, and whether the axis shows an offset text
(such as "1e-5" above it)."""


def y_labels(figure: Figure) -> YLabels:
    """The y tick labels each axes of `figure` shows at its current limits, as `YLabels`."""
    measured = []
    for ax in figure.axes:
        axis = ax.yaxis
        low, high = sorted(axis.get_view_interval())
        formatter = axis.get_major_formatter()
        labels = formatter.format_ticks([t for t in axis.get_major_locator()() if low <= t <= high])
        font = axis.get_major_ticks(numticks=1)[0].label1.get_fontproperties()
        widths = [
            text_to_path.get_text_width_height_descent(label, font, ismath=False)[0] for label in labels
        ]
        measured.append((max(widths, default=0.0), formatter.get_offset() != ""))
    return tuple(measured)


class HeldLayout(ConstrainedLayoutEngine):
    """Matplotlib's constrained layout, run again only when the figure's size changed or an axes' y tick
    labels outgrew the space the last run gave them (wider labels, an offset text where there was none).

    A live plot's redraws then leave every axes where it was: constrained layout run at each draw moves
    all the plots when one rescaled axis's labels change width ("0.15" to "0.125"), and a live canvas
    sends the page every changed pixel (tutorial 04's three plots: the whole figure ~12 KB, one rescaled
    axes ~5 KB, a step's new segments ~2 KB)."""

    def __init__(self) -> None:
        super().__init__()
        self._laid_out: tuple[tuple[float, float], YLabels] | None = None

    def execute(self, fig: Figure) -> dict[str, object]:
        size = (float(fig.get_figwidth()), float(fig.get_figheight()))
        labels = y_labels(fig)
        if self._laid_out is not None and self._laid_out[0] == size and fits(labels, self._laid_out[1]):
            return {}
        self._laid_out = (size, labels)
        return super().execute(fig)


def fits(labels: YLabels, room: YLabels) -> bool:
    """Whether y tick labels `labels` fit in the space a layout for `room` gave each axes."""
    return len(labels) == len(room) and all(
        width <= room_width and (room_offset or not offset)
        for (width, offset), (room_width, room_offset) in zip(labels, room, strict=True)
    )


class NotebookFigure(Figure):
    """A `Figure` that a notebook shows as a PNG when a cell returns it, in any kernel: IPython uses the
    inline backend's formatter when one is registered, else this `_repr_png_`."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        return buffer.getvalue()


XAxis = Literal["step", "time"]


def metric_points(
    history: MetricsHistory, name: str, x_axis: XAxis = "step", origin: float | None = None
) -> dict[str, tuple[list[float], list[float]]]:
    """`metric_lines` against the step, or against seconds since `origin` (default: the first row's
    time) for `x_axis="time"`."""
    if x_axis == "step":
        return {
            label: ([float(s) for s in steps], values)
            for label, (steps, values) in metric_lines(history, name).items()
        }
    if not history.rows:
        return {}
    start = history.rows[0]["time"] if origin is None else origin
    lines: dict[str, tuple[list[float], list[float]]] = {}
    for row in history:
        for member, value in row_values(row, name):
            label = f"{row['model']}/{row['op']}" + (f" {member}" if member else "")
            times, values = lines.setdefault(label, ([], []))
            times.append(row["time"] - start)
            values.append(value)
    return lines


def smoothed(values: Sequence[float], smoothing: float) -> list[float]:
    """TensorBoard's debiased exponential moving average: m_t = a·m_{t−1} + (1−a)·x_t, shown as
    m_t / (1 − a^n) after n finite values, so the first points are not pulled towards 0. NaN values
    stay NaN and leave the average as it was."""
    if not 0.0 <= smoothing < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {smoothing!r}")
    average, count, out = 0.0, 0, []
    for value in values:
        if math.isnan(value):
            out.append(math.nan)
            continue
        average = smoothing * average + (1 - smoothing) * value
        count += 1
        out.append(average / (1 - smoothing**count))
    return out


def split_skipped(
    xs: Sequence[float], values: Sequence[float]
) -> tuple[list[float], list[float], list[float], list[float]]:
    """The line's points (the last value at each x) and the skipped ones (earlier values at an x that
    a later row repeats: steps that did not train)."""
    line_x: list[float] = []
    line_y: list[float] = []
    skipped_x: list[float] = []
    skipped_y: list[float] = []
    for i, (x, y) in enumerate(zip(xs, values, strict=True)):
        if i + 1 < len(xs) and xs[i + 1] == x:
            skipped_x.append(x)
            skipped_y.append(y)
        else:
            line_x.append(x)
            line_y.append(y)
    return line_x, line_y, skipped_x, skipped_y


class LivePlot:
    """One figure for a fixed set of metrics, redrawn in place as the history grows.

    `update(history)` is cheap to call repeatedly (e.g. from a notebook panel's timer): it does nothing
    until new rows arrive, then updates the existing lines' data instead of rebuilding the figure, so a
    display refreshed from `to_png()` does not flicker.

    Args:
        names: The metrics to plot, one axes each.
        fig: Draw into this figure (cleared first) instead of a new one.
        smoothing: The moving average's weight a in [0, 1); 0 draws the raw values only.
        log_scale: A log y axis for each metric whose values are all positive.
        x_axis: `"step"` (the optimizer step) or `"time"` (seconds since the history's first row).
        compare: Other runs' histories to overlay, by name (`MetricsHistory.from_jsonl`).
    """

    def __init__(
        self,
        names: Sequence[str],
        *,
        fig: Figure | None = None,
        smoothing: float = 0.0,
        log_scale: bool = False,
        x_axis: XAxis = "step",
        compare: Mapping[str, MetricsHistory] | None = None,
    ) -> None:
        if not names:
            raise ValueError("LivePlot needs at least one metric name")
        if x_axis not in ("step", "time"):
            raise ValueError(f"x_axis must be 'step' or 'time', got {x_axis!r}")
        smoothed([], smoothing)  # checks the range
        self.names = list(names)
        self.smoothing = smoothing
        self.log_scale = log_scale
        self.x_axis: XAxis = x_axis
        self.compare = dict(compare or {})
        columns = min(len(self.names), MAX_COLUMNS)
        rows = math.ceil(len(self.names) / columns)
        if fig is None:
            fig = NotebookFigure(figsize=(4.5 * columns, 3.2 * rows))
        else:
            fig.clear()
        fig.set_layout_engine(HeldLayout())
        self.figure = fig
        grid = fig.subplots(rows, columns, squeeze=False, sharex=True).ravel()
        for unused in grid[len(self.names) :]:
            unused.remove()
        self.axes: dict[str, Axes] = dict(zip(self.names, grid, strict=False))
        self.lines: dict[str, dict[str, Line2D]] = {name: {} for name in self.names}
        """The main line of each metric by `model/op` (`"<run> model/op"` for a compared run)."""
        self.raw_lines: dict[str, dict[str, Line2D]] = {name: {} for name in self.names}
        self.skipped: dict[str, dict[str, Line2D]] = {name: {} for name in self.names}
        self._notes: dict[str, Text] = {}
        for name, ax in self.axes.items():
            ax.format_coord = self._reader(name)
            ax.set_title(name)
            ax.set_xlabel("step" if x_axis == "step" else "seconds")
            ax.grid(alpha=0.3)
            self._notes[name] = ax.text(
                0.5, 0.5, "no data yet", transform=ax.transAxes, ha="center", va="center", color="gray"
            )
            self._show_ticks(ax, False)
        self._drawn_rows = -1 if self.compare else 0  # compared runs are drawn at the first update
        self._held: dict[tuple[str, str], tuple[float, float]] = {}
        """The limits this plot set, by (metric name, y scale) for y and ("x", "linear") for the shared
        x axis: a y axis switched to another scale starts its limits afresh."""
        self._scanned_rows = 0  # rows of the history looked at for the plotted metrics

    def _show_ticks(self, ax: Axes, shown: bool) -> None:
        """Empty axes show their title and note only, not a meaningless ±0.05 range."""
        if not shown:
            ax.xaxis.set_major_locator(NullLocator())
            ax.yaxis.set_major_locator(NullLocator())
            return
        ax.xaxis.set_major_locator(MaxNLocator(nbins=X_TICKS, integer=self.x_axis == "step"))
        if self.x_axis == "step":
            ax.xaxis.set_major_formatter(FuncFormatter(step_label))
        ax.yaxis.set_major_locator(LogLocator() if ax.get_yscale() == "log" else AutoLocator())

    def _reader(self, name: str) -> Callable[[float, float], str]:
        """What the footer shows for the cursor at (x, y) over `name`'s axes: each line's value at its
        point nearest to x."""

        def read(x: float, _y: float) -> str:
            parts = []
            for label, line in self.lines[name].items():
                xs, ys = line.get_xdata(), line.get_ydata()
                if len(xs) == 0:
                    continue
                nearest = min(range(len(xs)), key=lambda i: abs(xs[i] - x))
                where = f"step {xs[nearest]:g}" if self.x_axis == "step" else f"{xs[nearest]:.1f} s"
                parts.append(f"{label} {where}: {ys[nearest]:.6g}")
            return " · ".join(parts)

        return read

    def _sources(self, history: MetricsHistory) -> list[tuple[str, MetricsHistory]]:
        return [("", history), *((f"{run} ", other) for run, other in self.compare.items())]

    def update(self, history: MetricsHistory, until_step: int | None = None) -> bool:
        """Update the lines from `history` if it has rows this plot has not drawn yet that carry one of
        its metrics (rows of other metrics leave the figure as it is). Rendering is the caller's: a live
        canvas asked to redraw here (`draw_idle`) would have its page request a second render of
        every update.

        `until_step`, the step a live run will end at: a step axis reaches it from the run's first row,
        so no step of the run moves it (a moved axis redraws the whole figure).

        Returns:
            True if the figure changed.
        """
        if len(history) == self._drawn_rows:
            return False
        new_rows = history.rows[self._scanned_rows :]
        self._scanned_rows = len(history)
        carried = sum(1 for row in new_rows if any(row_values(row, name) for name in self.names))
        if self._drawn_rows >= 0 and carried == 0:  # rows of other metrics only: the figure is unchanged
            self._drawn_rows = len(history)
            return False
        for name, ax in self.axes.items():
            lines = self.lines[name]
            for prefix, source in self._sources(history):
                for label, (xs, values) in metric_points(source, name, self.x_axis).items():
                    self._draw(name, ax, prefix + label, xs, values)
            has_data = bool(lines)
            self._notes[name].set_visible(not has_data)
            if 1 < len(lines) <= MAX_LEGEND_LINES:
                ax.legend(fontsize="small")
            values = [v for line in lines.values() for v in line.get_ydata() if math.isfinite(v)]
            scale = "log" if self.log_scale and values and min(values) > 0 else "linear"
            if ax.get_yscale() != scale:
                ax.set_yscale(scale)
            if scale == "linear":
                ax.ticklabel_format(axis="y", useOffset=False)  # 1.00001, not "1e-5 + 1"
            self._show_ticks(ax, has_data)
            ax.relim()
            self._hold_y(name, ax)
        self._hold_x(until_step)
        self._drawn_rows = len(history)
        return True

    def _hold_y(self, name: str, ax: Axes) -> None:
        """Show the metric's values within `held_limits` (unless the toolbar zoomed or panned it)."""
        low, high = ax.dataLim.intervaly
        if not (ax.get_autoscaley_on() and math.isfinite(low) and math.isfinite(high)):
            return
        key = (name, ax.get_yscale())
        self._held[key] = held_limits(self._held.get(key), low, high, log=key[1] == "log")
        ax.set_ylim(*self._held[key], auto=None)  # still autoscaled: a toolbar zoom turns that off

    def _hold_x(self, until_step: int | None) -> None:
        """The shared x axis within `held_limits`, reaching `until_step` on a step axis; a single step
        shows as ±1 step around it, a readable axis rather than matplotlib's ±0.045."""
        first = next(iter(self.axes.values()))
        xs = [x for lines in self.lines.values() for line in lines.values() for x in line.get_xdata()]
        if not (xs and first.get_autoscalex_on()):
            return
        low, high = min(xs), max(xs)
        if until_step is not None and self.x_axis == "step":
            high = max(high, until_step)
        key = ("x", "linear")
        if low == high:
            self._held[key] = (low - 1, high + 1)
        else:
            self._held[key] = held_limits(self._held.get(key), low, high, log=False)
        first.set_xlim(*self._held[key], auto=None)

    @contextlib.contextmanager
    def unzoomed(self, until_step: int | None = None) -> Iterator[None]:
        """The axes at the limits the plot itself holds (as `update(history, until_step)` sets them),
        without the toolbar's zoom or pan: a picture of the run (the panel's saved record) rather than
        of where its user last looked. The zoom is put back afterwards."""
        saved = [
            (ax, ax.get_xlim(), ax.get_ylim(), ax.get_autoscalex_on(), ax.get_autoscaley_on())
            for ax in self.axes.values()
        ]
        try:
            for name, ax in self.axes.items():
                ax.set_autoscale_on(True)
                self._hold_y(name, ax)
            self._hold_x(until_step)
            yield
        finally:
            for ax, xlim, ylim, autoscale_x, autoscale_y in saved:
                ax.set_xlim(*xlim, auto=autoscale_x)
                ax.set_ylim(*ylim, auto=autoscale_y)

    def _draw(self, name: str, ax: Axes, label: str, xs: list[float], values: list[float]) -> None:
        skipped_x: list[float] = []
        skipped_y: list[float] = []
        if self.x_axis == "step":
            xs, values, skipped_x, skipped_y = split_skipped(xs, values)
        lines = self.lines[name]
        if label not in lines:
            (lines[label],) = ax.plot([], [], label=label, markersize=3)
        line = lines[label]
        shown = smoothed(values, self.smoothing) if self.smoothing > 0 else values
        line.set_data(xs, shown)
        few = len(xs) <= MAX_POINTS_WITH_MARKERS and self.smoothing == 0
        line.set_marker("o" if few or len(xs) == 1 else "")  # a line of one point is its marker
        if self.smoothing > 0:
            raw = self.raw_lines[name]
            if label not in raw:
                (raw[label],) = ax.plot([], [], color=line.get_color(), alpha=0.25, label=f"_{label} raw")
            raw[label].set_data(xs, values)
        if skipped_x:
            skipped = self.skipped[name]
            if label not in skipped:
                (skipped[label],) = ax.plot(
                    [],
                    [],
                    linestyle="none",
                    marker="o",
                    markerfacecolor="none",
                    markersize=5,
                    color=line.get_color(),
                    label=f"_{label} skipped",
                )
            skipped[label].set_data(skipped_x, skipped_y)

    def to_png(self, dpi: int = 100) -> bytes:
        """The current figure as PNG bytes (for an `ipywidgets.Image`)."""
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=dpi)
        return buffer.getvalue()


def plot_history(
    history: MetricsHistory,
    *names: str,
    fig: Figure | None = None,
    smoothing: float = 0.0,
    log_scale: bool = False,
    x_axis: XAxis = "step",
    compare: Mapping[str, MetricsHistory] | None = None,
) -> Figure:
    """Plot metrics against the optimizer step (or time), one axes per metric.

    Args:
        history: The session's history (`sess.history`).
        *names: The metrics to plot; all recorded metrics when none are given.
        fig: Draw into this figure (cleared first) instead of a new one.
        smoothing, log_scale, x_axis, compare: As for `LivePlot`.

    Returns:
        The figure; a notebook cell that returns it displays it.
    """
    names = names or tuple(history.names())
    if not names:
        raise ValueError("the history has no metrics yet; name the metrics to plot empty axes for them")
    plot = LivePlot(names, fig=fig, smoothing=smoothing, log_scale=log_scale, x_axis=x_axis, compare=compare)
    plot.update(history)
    return plot.figure
