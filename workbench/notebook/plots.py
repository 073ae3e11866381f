"""Matplotlib plots of the metrics history: one axes per metric, against the optimizer step.

Figures are built with `matplotlib.figure.Figure`, not `pyplot`, so nothing is registered in pyplot's
global figure list: a notebook shows a figure once (when a cell returns it), a live panel that redraws
every second leaks nothing, and everything works headless (PNG bytes come from the Agg renderer
whatever the backend). A bare `Figure` shows as text in a kernel where neither pyplot nor `%matplotlib`
has loaded the inline backend, so the figures made here carry their own `_repr_png_`.

A metric can come from several kinds of row (the training `forward_backward` loss and a held-out
`forward` loss; the policy and the critic), so each axes draws one line per `model/op`, labelled when
there is more than one. NaN values stay in the line data: matplotlib breaks the line there, so a
diverged step shows as a gap instead of being smoothed away.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.text import Text
from matplotlib.ticker import MaxNLocator

from workbench.metrics import MetricsHistory

MAX_COLUMNS = 3
MAX_POINTS_WITH_MARKERS = 50  # beyond this, markers hide the line's shape


def metric_lines(history: MetricsHistory, name: str) -> dict[str, tuple[list[int], list[float]]]:
    """The steps and values of one metric, split by the `model/op` of the rows that carry it."""
    lines: dict[str, tuple[list[int], list[float]]] = {}
    for row in history:
        if name in row:
            steps, values = lines.setdefault(f"{row['model']}/{row['op']}", ([], []))
            steps.append(row["step"])
            values.append(row[name])
    return lines


class NotebookFigure(Figure):
    """A `Figure` that a notebook shows as a PNG when a cell returns it, in any kernel: IPython uses the
    inline backend's formatter when one is registered, else this `_repr_png_`."""

    def _repr_png_(self) -> bytes:
        buffer = io.BytesIO()
        self.savefig(buffer, format="png")
        return buffer.getvalue()


class LivePlot:
    """One figure for a fixed set of metrics, redrawn in place as the history grows.

    `update(history)` is cheap to call repeatedly (e.g. from a notebook panel's timer): it does nothing
    until new rows arrive, then updates the existing lines' data instead of rebuilding the figure, so a
    display refreshed from `to_png()` does not flicker.

    Args:
        names: The metrics to plot, one axes each.
        fig: Draw into this figure (cleared first) instead of a new one.
    """

    def __init__(self, names: Sequence[str], *, fig: Figure | None = None) -> None:
        if not names:
            raise ValueError("LivePlot needs at least one metric name")
        self.names = list(names)
        columns = min(len(self.names), MAX_COLUMNS)
        rows = math.ceil(len(self.names) / columns)
        if fig is None:
            fig = NotebookFigure(figsize=(4.5 * columns, 3.2 * rows), layout="constrained")
        else:
            fig.clear()
        self.figure = fig
        grid = fig.subplots(rows, columns, squeeze=False).ravel()
        for unused in grid[len(self.names) :]:
            unused.remove()
        self.axes: dict[str, Axes] = dict(zip(self.names, grid, strict=False))
        self.lines: dict[str, dict[str, Line2D]] = {name: {} for name in self.names}
        self._notes: dict[str, Text] = {}
        for name, ax in self.axes.items():
            ax.set_title(name)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # optimizer steps are whole numbers
            ax.grid(alpha=0.3)
            self._notes[name] = ax.text(
                0.5, 0.5, "no data yet", transform=ax.transAxes, ha="center", va="center", color="gray"
            )
        self._drawn_rows = 0

    def update(self, history: MetricsHistory) -> bool:
        """Redraw from `history` if it has rows this plot has not drawn yet.

        Returns:
            True if the figure changed.
        """
        if len(history) == self._drawn_rows:
            return False
        for name, ax in self.axes.items():
            lines = self.lines[name]
            for label, (steps, values) in metric_lines(history, name).items():
                if label not in lines:
                    (lines[label],) = ax.plot([], [], label=label, markersize=3)
                lines[label].set_data(steps, values)
                lines[label].set_marker("o" if len(steps) <= MAX_POINTS_WITH_MARKERS else "")
            self._notes[name].set_visible(not lines)
            if len(lines) > 1:
                ax.legend(fontsize="small")
            ax.relim()
            ax.autoscale_view()
        self._drawn_rows = len(history)
        self.figure.canvas.draw_idle()
        return True

    def to_png(self, dpi: int = 100) -> bytes:
        """The current figure as PNG bytes (for an `ipywidgets.Image`)."""
        buffer = io.BytesIO()
        self.figure.savefig(buffer, format="png", dpi=dpi)
        return buffer.getvalue()


def plot_history(history: MetricsHistory, *names: str, fig: Figure | None = None) -> Figure:
    """Plot metrics against the optimizer step, one axes per metric.

    Args:
        history: The session's history (`sess.history`).
        *names: The metrics to plot; all recorded metrics when none are given.
        fig: Draw into this figure (cleared first) instead of a new one.

    Returns:
        The figure; a notebook cell that returns it displays it.
    """
    names = names or tuple(history.names())
    if not names:
        raise ValueError("the history has no metrics yet; name the metrics to plot empty axes for them")
    plot = LivePlot(names, fig=fig)
    plot.update(history)
    return plot.figure
