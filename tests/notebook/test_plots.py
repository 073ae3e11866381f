"""Plots of the metrics history, drawn headless."""

from __future__ import annotations

import itertools
import math

import matplotlib
import numpy as np
import pytest

matplotlib.use("Agg")

from matplotlib.backends.backend_agg import FigureCanvasAgg

from workbench.metrics import MetricsHistory
from workbench.notebook.plots import HEADROOM, MARGIN, LivePlot, held_limits, plot_history


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
    history.record("rollouts", "policy", 0, {"reward:mean": 1.0})  # not plotted: nothing to redraw
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


def test_all_axes_share_one_x_range_and_write_values_without_an_offset() -> None:
    history = training_history(3)  # loss at steps 0..2, grad_norm at 1..3
    history.record("forward_backward", "policy", 3, {"ratio:mean": 1.00001})
    history.record("forward_backward", "policy", 4, {"ratio:mean": 1.00002})
    fig = plot_history(history, "loss:sum", "grad_norm", "ratio:mean")
    loss_ax, grad_ax, ratio_ax = fig.axes
    assert loss_ax.get_xlim() == grad_ax.get_xlim() == ratio_ax.get_xlim()
    assert loss_ax.get_xlim()[0] <= 0 and grad_ax.get_xlim()[1] >= 4
    fig.canvas.draw()
    assert ratio_ax.yaxis.get_major_formatter().get_offset() == ""  # no "1e-5+1"


def test_empty_axes_show_no_ticks_until_data_arrives() -> None:
    history = MetricsHistory()
    plot = LivePlot(["reward:mean"])
    plot.figure.canvas.draw()
    ax = plot.axes["reward:mean"]
    assert list(ax.get_xticks()) == [] and list(ax.get_yticks()) == []  # no ±0.05 axes
    history.record("run_step", "run", 0, {"reward:mean": 0.5})
    history.record("run_step", "run", 1, {"reward:mean": 0.7})
    plot.update(history)
    assert len(ax.get_yticks()) > 0


def test_a_step_that_did_not_train_is_a_hollow_marker_not_a_vertical_stroke() -> None:
    history = MetricsHistory()
    for step, reward in [(0, 0.1), (1, 0.2), (1, 0.9), (2, 0.4)]:  # the 0.2 step trained nothing
        history.record("rollouts", "policy", step, {"reward:mean": reward})
    plot = LivePlot(["reward:mean"])
    plot.update(history)
    assert line_data(plot.lines["reward:mean"]["policy/rollouts"]) == ([0, 1, 2], [0.1, 0.9, 0.4])
    skipped = plot.skipped["reward:mean"]["policy/rollouts"]
    assert line_data(skipped) == ([1], [0.2]) and skipped.get_linestyle() == "None"
    assert skipped.get_markerfacecolor() == "none"


def test_smoothing_is_a_debiased_moving_average_over_a_faint_raw_line() -> None:
    from workbench.notebook.plots import smoothed

    # a = 0.5: m1 = 0.5·2 = 1 → 1/(1−0.5) = 2; m2 = 0.5·1 + 0.5·4 = 2.5 → 2.5/0.75
    assert smoothed([2.0, 4.0], 0.5) == pytest.approx([2.0, 2.5 / 0.75])
    assert math.isnan(smoothed([1.0, math.nan, 3.0], 0.5)[1])
    with pytest.raises(ValueError, match="smoothing"):
        smoothed([1.0], 1.0)
    history = training_history(4)
    plot = LivePlot(["loss:sum"], smoothing=0.6)
    plot.update(history)
    main = plot.lines["loss:sum"]["policy/forward_backward"]
    raw = plot.raw_lines["loss:sum"]["policy/forward_backward"]
    assert line_data(raw) == history.series("loss:sum")
    assert list(main.get_ydata()) == pytest.approx(smoothed([10.0, 9.0, 8.0, 7.0], 0.6))
    assert raw.get_alpha() == 0.25 and raw.get_color() == main.get_color()


def test_log_scale_wall_clock_axis_and_runs_compared_from_their_files(tmp_path) -> None:
    from workbench.metrics import JsonlSink

    other = MetricsHistory()
    other.sinks.append(JsonlSink(tmp_path / "baseline" / "history.jsonl"))
    for step in range(3):
        other.record("forward_backward", "policy", step, {"loss:sum": 20.0 - step})
    loaded = MetricsHistory.from_jsonl(tmp_path / "baseline")
    assert loaded.rows == other.rows

    history = training_history(3)
    plot = LivePlot(["loss:sum", "grad_norm"], log_scale=True, compare={"baseline": loaded})
    plot.update(history)
    assert set(plot.lines["loss:sum"]) == {"policy/forward_backward", "baseline policy/forward_backward"}
    assert line_data(plot.lines["loss:sum"]["baseline policy/forward_backward"]) == (
        [0, 1, 2],
        [20.0, 19.0, 18.0],
    )
    assert plot.axes["loss:sum"].get_yscale() == "log"
    assert plot.axes["loss:sum"].get_legend() is not None

    timed = LivePlot(["loss:sum"], x_axis="time")
    timed.update(history)
    xs, _ = line_data(timed.lines["loss:sum"]["policy/forward_backward"])
    assert xs[0] == 0.0 and xs == sorted(xs) and timed.axes["loss:sum"].get_xlabel() == "seconds"


def test_session_plot_overlays_runs_from_their_folders(tiny, tmp_path) -> None:
    from workbench.metrics import JsonlSink

    baseline = MetricsHistory()
    baseline.sinks.append(JsonlSink(tmp_path / "baseline" / "history.jsonl"))
    baseline.record("forward_backward", "policy", 0, {"loss:sum": 42.0})
    tiny.history.record("forward_backward", "policy", 0, {"loss:sum": 40.0})
    fig = tiny.plot("loss:sum", compare=[tmp_path / "baseline"], smoothing=0.5, log_scale=True, x_axis="time")
    (ax,) = fig.axes
    labels = {line.get_label() for line in ax.get_lines()}
    assert {"policy/forward_backward", "baseline policy/forward_backward"} <= labels
    named = tiny.plot("loss:sum", compare={"other": tmp_path / "baseline" / "history.jsonl"})
    assert "other policy/forward_backward" in {line.get_label() for line in named.axes[0].get_lines()}


def test_the_cursor_reads_each_lines_value_at_the_nearest_step() -> None:
    history = MetricsHistory()
    for step, loss in enumerate([3.0, 2.0, 1.5]):
        history.record("forward_backward", "policy", step, {"loss:sum": loss})
    history.record("forward", "policy", 2, {"loss:sum": 9.0})
    plot = LivePlot(["loss:sum"])
    plot.update(history)
    text = plot.axes["loss:sum"].format_coord(1.2, 100.0)  # the cursor's y is not a value
    assert text == "policy/forward_backward step 1: 2 · policy/forward step 2: 9"


def test_a_single_point_shows_as_a_marker_on_a_step_axis_smoothed_or_not() -> None:
    history = MetricsHistory()
    history.record("rollouts", "policy", 4, {"reward:mean": 0.5})
    for smoothing in (0.0, 0.6):
        plot = LivePlot(["reward:mean"], smoothing=smoothing)
        plot.update(history)
        (line,) = plot.lines["reward:mean"].values()
        assert line.get_marker() == "o"
        assert plot.axes["reward:mean"].get_xlim() == (3.0, 5.0)


def test_held_limits_keep_an_axis_until_the_data_passes_it_then_leave_headroom_on_that_side() -> None:
    first = held_limits(None, 0.0, 10.0, log=False)
    assert first == pytest.approx((-10 * MARGIN, 10 + 10 * MARGIN))
    assert held_limits(first, 0.1, 10.4, log=False) == first  # inside: the same limits
    grown = held_limits(first, 0.0, 20.0, log=False)  # passed the top: headroom above only
    assert grown == pytest.approx((-20 * MARGIN, 20 + 20 * (MARGIN + HEADROOM)))
    low, high = held_limits(held_limits(None, 1.0, 100.0, log=True), 0.01, 100.0, log=True)
    assert math.log10(low) == pytest.approx(-2 - 4 * (MARGIN + HEADROOM))  # spans of log10 values
    assert math.log10(high) == pytest.approx(2 + 4 * MARGIN)
    low, high = held_limits(None, 3.0, 3.0, log=False)  # a constant: a range around it, not a point
    assert low < 3.0 < high


def test_a_live_plot_follows_its_steps_from_a_single_first_one_and_rescales_rarely() -> None:
    """One row per refresh, as a panel sees a run: the x axis goes on past a first lone step (whose ±1
    axis once stayed for good), and the axes change limits O(log steps) times, not every step, so a
    redraw changes only the new segment's pixels."""
    history = MetricsHistory()
    plot = LivePlot(["loss:sum"])
    ax = plot.axes["loss:sum"]
    limits = []
    for step in range(1, 201):
        history.record("forward_backward", "policy", step, {"loss:sum": 5.0 * math.exp(-step / 50)})
        plot.update(history)
        limits.append((ax.get_xlim(), ax.get_ylim()))
        low, high = ax.get_xlim()
        assert low < 1 and step < high
        ylow, yhigh = ax.get_ylim()
        assert ylow < 5.0 * math.exp(-step / 50) < yhigh
    changes = sum(1 for before, after in itertools.pairwise(limits) if before != after)
    assert changes <= 40, changes  # autoscaling changes them at each of the 200 steps


def test_a_live_runs_step_axis_reaches_its_last_step_from_its_first_row() -> None:
    """Given the step a run ends at, the x axis holds it from the run's first row: none of the run's steps
    moves the axis (which redraws the whole figure), where without it the axis moves as steps pass it."""
    history = MetricsHistory()
    planned, unplanned = LivePlot(["loss:sum"]), LivePlot(["loss:sum"])
    planned_limits, unplanned_limits = set(), set()
    for step in range(1, 16):
        history.record("forward_backward", "policy", step, {"loss:sum": 1.0})
        planned.update(history, until_step=15)
        unplanned.update(history)
        planned_limits.add(planned.axes["loss:sum"].get_xlim())
        unplanned_limits.add(unplanned.axes["loss:sum"].get_xlim())
    assert len(planned_limits) == 1, planned_limits
    low, high = planned_limits.pop()
    assert low < 1 and 15 < high < 16
    assert len(unplanned_limits) > 3
    wall_clock = LivePlot(["loss:sum"], x_axis="time")  # a step means nothing on a time axis
    wall_clock.update(history, until_step=1000)
    assert wall_clock.axes["loss:sum"].get_xlim()[1] < 1000


def test_a_live_plot_keeps_its_axes_in_place_until_a_tick_label_outgrows_its_room() -> None:
    """A rescaled axis whose tick labels got narrower ("0.25" to "0.0") leaves every axes where it was,
    where constrained layout at each draw moves them all (a live canvas then sends the whole figure
    again); wider labels, or a new figure size, lay the figure out again as constrained layout would."""
    rewards = [0.5, 0.25, 0.9, 0.0, 1234.5678]  # labels: as wide, narrower, wider ("−0.2"), wider

    def lefts(plot: LivePlot) -> list[tuple[float, float]]:
        history = MetricsHistory()
        positions = []
        for step, reward in enumerate(rewards):
            history.record("rollouts", "policy", step, {"reward:mean": reward, "entropy:mean": 2.0})
            plot.update(history, until_step=10)
            plot.figure.draw_without_rendering()
            positions.append(tuple(ax.get_position().x0 for ax in plot.figure.axes))
        return positions

    held = LivePlot(["reward:mean", "entropy:mean"])
    every_draw = LivePlot(["reward:mean", "entropy:mean"])
    every_draw.figure.set_layout_engine("constrained")
    held_lefts, every_draw_lefts = lefts(held), lefts(every_draw)
    assert every_draw_lefts[2] != every_draw_lefts[1]  # the narrower labels moved the axes
    assert held_lefts[2] == held_lefts[1]
    for held_left, every_draw_left in zip(held_lefts[3:], every_draw_lefts[3:], strict=True):
        assert held_left == pytest.approx(every_draw_left)  # wider: laid out again
    assert held_lefts[4] != held_lefts[3]
    held.figure.set_size_inches(12, 3)
    held.figure.draw_without_rendering()
    assert tuple(ax.get_position().x0 for ax in held.figure.axes) != held_lefts[4]


def test_a_live_plot_keeps_a_zoom_of_the_toolbar_while_rows_arrive() -> None:
    history = training_history(10)
    plot = LivePlot(["loss:sum"])
    plot.update(history)
    ax = plot.axes["loss:sum"]
    ax.set_xlim(2.0, 4.0)  # what the toolbar's zoom does: it turns autoscaling off
    ax.set_ylim(6.0, 8.0)
    history.record("forward_backward", "policy", 30, {"loss:sum": 100.0})
    assert plot.update(history) is True
    assert ax.get_xlim() == (2.0, 4.0) and ax.get_ylim() == (6.0, 8.0)


def test_step_ticks_stay_apart_past_thousands_of_steps() -> None:
    """On the Metrics tab's 340-pixel plot, the step labels of a long run neither touch nor overlap
    ("12500" and its neighbours ran together): at most five, shortened past a thousand."""
    from workbench.notebook.plots import step_label

    assert [step_label(x) for x in (0, 999, 2500, 12_500, 120_000, 1_250_000)] == [
        "0",
        "999",
        "2.5k",
        "12.5k",
        "120k",
        "1.25M",
    ]
    history = MetricsHistory()
    for step in range(0, 13_000, 100):
        history.record("forward_backward", "policy", step, {"loss:sum": 1.0 + step % 7})
    plot = LivePlot(["loss:sum"])
    plot.figure.set_size_inches(3.4, 2.6)  # the panel's plot
    plot.update(history, until_step=13_000)
    canvas = FigureCanvasAgg(plot.figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    ax = plot.axes["loss:sum"]
    shown = [
        t
        for t in ax.get_xticklabels()
        if t.get_text() and ax.get_xlim()[0] <= t.get_position()[0] <= ax.get_xlim()[1]
    ]
    boxes = sorted((t.get_window_extent(renderer) for t in shown), key=lambda box: box.x0)
    assert 3 <= len(boxes) <= 6, [t.get_text() for t in shown]
    assert all(left.x1 + 4 <= right.x0 for left, right in itertools.pairwise(boxes)), [
        t.get_text() for t in shown
    ]
