"""What a live plot sends the page per step: the panel's Metrics canvas against plain ipympl.

Replays the three series tutorial 04's panel plots (mean reward rising from 0.16 to 0.97, entropy falling
from 2.3 to 0.06, a noisy KL estimate of order 1e-5) step by step into two live figures of the same size
and counts the bytes of the images each canvas sends:

- the floor: an ipympl canvas on a figure with matplotlib's constrained layout whose axes autoscale
  (`relim`, `autoscale_view`), redrawn at every step, which is what `%matplotlib widget` and a plot
  updated in a loop gives;
- the panel's: `MetricsTab`'s canvas and `LivePlot` (held limits and layout, paletted PNGs), redrawn as
  its byte allowance lets it (`steps_between_renders`).

Both send only the pixels that changed (ipympl's diff mode). Nothing is timed, so the figures are the
same on a busy machine. Budget: 20 KB per step for the whole panel, ~4.5 KB of which are its text.

    python bench/plot_traffic.py
"""

from __future__ import annotations

import argparse
import os
import random
import threading

os.environ.setdefault("MPLBACKEND", "Agg")

from ipympl.backend_nbagg import Canvas, FigureManager

from workbench.metrics import MetricsHistory
from workbench.notebook.panel.metrics_tab import INCHES_PER_PLOT, LockedCanvas, steps_between_renders
from workbench.notebook.plots import LivePlot, NotebookFigure

NAMES = ("reward:mean", "entropy:mean", "kl_sample_train_v1:mean")
REWARD = (0.156, 0.125, 0.24, 0.32, 0.88, 0.6, 0.7, 0.8, 0.75, 0.85, 0.9, 0.82, 0.95, 0.9, 0.97)
ENTROPY = (2.3, 1.2, 0.65, 0.1, 0.3, 0.2, 0.15, 0.12, 0.2, 0.1, 0.08, 0.09, 0.07, 0.1, 0.06)


class CountingCanvas(Canvas):
    """Plain ipympl, sending diff PNGs from its first draw (as the panel's canvas does), counting them."""

    def __init__(self, figure: NotebookFigure) -> None:
        super().__init__(figure)
        self.syncing_data_url = False
        self.sent_bytes = 0

    def send_binary(self, data: bytes) -> None:
        self.sent_bytes += len(data)


class QuietLockedCanvas(LockedCanvas):
    """The panel's canvas, its images counted and not sent (no page here)."""

    def send_binary(self, data: bytes) -> None:
        self.sent_bytes += len(data)


def series(seed: int) -> list[dict[str, float]]:
    kl = random.Random(seed)
    return [
        {
            "reward:mean": reward,
            "entropy:mean": entropy,
            "kl_sample_train_v1:mean": -1.3e-5 + kl.uniform(0, 1e-5),
        }
        for reward, entropy in zip(REWARD, ENTROPY, strict=True)
    ]


def floor_bytes(rows: list[dict[str, float]]) -> list[int]:
    figure = NotebookFigure(
        figsize=(INCHES_PER_PLOT[0] * len(NAMES), INCHES_PER_PLOT[1]), layout="constrained"
    )
    canvas = CountingCanvas(figure)
    FigureManager(canvas, 0)
    axes = figure.subplots(1, len(NAMES), sharex=True)
    lines = {}
    for name, ax in zip(NAMES, axes, strict=True):
        ax.set_title(name)
        ax.grid(alpha=0.3)
        (lines[name],) = ax.plot([], [], marker="o", markersize=3)
    canvas.draw()
    per_step = []
    for step in range(len(rows)):
        before = canvas.sent_bytes
        for name, ax in zip(NAMES, axes, strict=True):
            lines[name].set_data(range(step + 1), [row[name] for row in rows[: step + 1]])
            ax.relim()
            ax.autoscale_view()
        canvas.draw()
        per_step.append(canvas.sent_bytes - before)
    return per_step


def panel_bytes(rows: list[dict[str, float]]) -> list[int]:
    figure = NotebookFigure(figsize=(INCHES_PER_PLOT[0] * len(NAMES), INCHES_PER_PLOT[1]))
    canvas = QuietLockedCanvas(figure, threading.RLock())
    FigureManager(canvas, 0)
    history = MetricsHistory()
    plot = LivePlot(list(NAMES), fig=figure)
    plot.update(history, until_step=len(rows))
    canvas.draw()
    per_step, rendered_step, rendered_bytes = [], None, 0
    for step, row in enumerate(rows):
        history.record("rollouts", "policy", step, row)
        before = canvas.sent_bytes
        if rendered_step is None or step - rendered_step >= steps_between_renders(rendered_bytes):
            plot.update(history, until_step=len(rows))
            canvas.draw()
            rendered_step, rendered_bytes = step, canvas.sent_bytes - before
        per_step.append(canvas.sent_bytes - before)
    return per_step


def worst_window(per_step: list[int], steps: int = 2) -> float:
    return max(sum(per_step[i : i + steps]) for i in range(len(per_step) - steps + 1)) / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, default=3, help="replays, each with its own KL noise")
    args = parser.parse_args()
    for seed in range(args.seeds):
        rows = series(seed)
        floor, panel = floor_bytes(rows), panel_bytes(rows)
        print(
            f"seed {seed}: plain ipympl {sum(floor) / len(rows) / 1000:.1f} KB/step "
            f"(worst 2 steps {worst_window(floor) / 1000:.1f}), panel {sum(panel) / len(rows) / 1000:.1f} KB/step "
            f"(worst 2 steps {worst_window(panel) / 1000:.1f}): {sum(panel) / sum(floor):.2f}x"
        )
        print(f"  per step, plain: {[round(b / 1000, 1) for b in floor]}")
        print(f"  per step, panel: {[round(b / 1000, 1) for b in panel]}")


if __name__ == "__main__":
    main()
