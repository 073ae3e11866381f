"""Plots of the metrics history, drawn headless."""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from workbench.metrics import MetricsHistory
from workbench.notebook.plots import LivePlot, plot_history


def training_history(steps: int) -> MetricsHistory:
    history = MetricsHistory()
    for step in range(steps):
        history.record("forward_backward", "policy", step, {"loss:sum": 10.0 - step, "tokens": 8})
        history.record("optim_step", "policy", step + 1, {"grad_norm": 1.0 / (step + 1)})
    return history


def line_data(line: matplotlib.lines.Line2D) -> tuple[list[float], list[float]]:
    return list(line.get_xdata()), list(line.get_ydata())


def test_one_axes_per_metric_with_the_series_as_line_data() -> None:
    history = training_history(4)
    fig = plot_history(history, "loss:sum", "grad_norm")
    assert len(fig.axes) == 2
    for ax, name in zip(fig.axes, ["loss:sum", "grad_norm"], strict=True):
        assert ax.get_title() == name
        (line,) = ax.get_lines()
        assert line_data(line) == history.series(name)


def test_all_metrics_by_default_and_unused_grid_cells_removed() -> None:
    history = training_history(2)
    history.record("forward", "critic", 2, {"value:mean": 0.5, "loss:sum": 1.0})
    fig = plot_history(history)
    assert [ax.get_title() for ax in fig.axes] == history.names()
    assert len(fig.axes) == 4  # a 2x3 grid with two cells removed


def test_each_model_and_op_gets_its_own_line() -> None:
    history = training_history(3)
    history.record("forward", "policy", 3, {"loss:sum": 4.0})
    (ax,) = plot_history(history, "loss:sum").axes
    lines = {line.get_label(): line_data(line) for line in ax.get_lines()}
    assert lines == {
        "policy/forward_backward": ([0, 1, 2], [10.0, 9.0, 8.0]),
        "policy/forward": ([3], [4.0]),
    }
    assert ax.get_legend() is not None


def test_a_metric_without_rows_gets_empty_axes_with_a_note() -> None:
    (ax,) = plot_history(training_history(2), "reward:mean").axes
    assert ax.get_lines() == []
    assert [text.get_text() for text in ax.texts if text.get_visible()] == ["no data yet"]


def test_nan_values_stay_in_the_line_as_gaps() -> None:
    history = MetricsHistory()
    for step, loss in enumerate([3.0, math.nan, 1.0]):
        history.record("forward_backward", "policy", step, {"loss:sum": loss})
    (ax,) = plot_history(history, "loss:sum").axes
    (line,) = ax.get_lines()
    assert list(line.get_xdata()) == [0, 1, 2]
    assert np.isnan(line.get_ydata()).tolist() == [False, True, False]
    assert ax.get_ylim()[0] <= 1.0 and ax.get_ylim()[1] >= 3.0  # the NaN does not break autoscaling


def test_plot_history_needs_metrics() -> None:
    with pytest.raises(ValueError, match="no metrics yet"):
        plot_history(MetricsHistory())


def test_live_plot_redraws_in_place_only_when_rows_arrive() -> None:
    history = MetricsHistory()
    plot = LivePlot(["loss:sum", "grad_norm"])
    figure = plot.figure
    assert plot.update(history) is False
    assert plot.axes["loss:sum"].texts[0].get_visible()

    history.record("forward_backward", "policy", 0, {"loss:sum": 5.0})
    assert plot.update(history) is True
    line = plot.lines["loss:sum"]["policy/forward_backward"]
    assert line_data(line) == ([0], [5.0])
    assert not plot.axes["loss:sum"].texts[0].get_visible()
    assert plot.lines["grad_norm"] == {}
    assert plot.update(history) is False

    for step in range(1, 60):
        history.record("forward_backward", "policy", step, {"loss:sum": 5.0 + step})
    assert plot.update(history) is True
    assert plot.figure is figure
    assert plot.lines["loss:sum"]["policy/forward_backward"] is line
    assert line_data(line) == history.series("loss:sum")
    assert line.get_marker() in ("", "None")  # too many points for markers
    assert plot.axes["loss:sum"].get_ylim()[1] >= 64.0  # rescaled to the new data


def test_live_plot_renders_png() -> None:
    plot = LivePlot(["loss:sum"])
    plot.update(training_history(3))
    png = plot.to_png()
    assert png.startswith(b"\x89PNG\r\n\x1a\n")


def test_a_figure_returned_to_a_notebook_shows_as_png() -> None:
    """A bare Figure shows only as text unless the kernel has loaded the inline backend; ours carry their
    own PNG representation."""
    from IPython.core.formatters import PNGFormatter

    fig = plot_history(training_history(3), "loss:sum")
    assert fig._repr_png_().startswith(b"\x89PNG\r\n\x1a\n")
    assert PNGFormatter()(fig).startswith(b"\x89PNG\r\n\x1a\n")
