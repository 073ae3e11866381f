"""The Metrics tab: live plots of any history series, redrawn in place as the history grows.

The plot is a `LivePlot` (the same figure `sess.plot(...)` draws) shown as a PNG in an
`ipywidgets.Image`. A refresh re-renders only when the history has new rows, and it replaces the
image's bytes rather than the widget, so the page keeps its layout and does not flicker.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

import ipywidgets

from workbench.notebook.panel.feedback import Feedback
from workbench.notebook.plots import LivePlot

if TYPE_CHECKING:
    from workbench.notebook.session import Session


class MetricsTab:
    """A multi-select of the history's metric names and the live plot of the selected ones."""

    def __init__(self, session: Session, metrics: Sequence[str]) -> None:
        self.session = session
        self.feedback = Feedback()
        initial = tuple(metrics)
        self.select = ipywidgets.SelectMultiple(
            options=self._options(initial), value=initial, description="metrics", rows=6
        )
        self.image = ipywidgets.Image(format="png")
        self.image.add_class("wb-metrics-plot")
        self.plot: LivePlot | None = None
        self.renders = 0  # how many times the image was redrawn
        self._lock = threading.RLock()  # the panel's timer thread and widget callbacks both draw
        self._syncing = False
        self.select.observe(self.feedback.guard(self._on_select), names="value")
        self.widget = ipywidgets.VBox([self.select, self.image, self.feedback.widget])
        self._replot()

    def _options(self, selected: Sequence[str]) -> list[str]:
        names = list(dict.fromkeys([*self.session.history.names(), *selected]))
        return sorted(names)

    def _on_select(self, _change: dict[str, object]) -> None:
        if not self._syncing:
            self._replot()

    def _replot(self) -> None:
        """Start a new plot for the selected metrics (the selection changed)."""
        with self._lock:
            names = list(self.select.value)
            self.plot = LivePlot(names) if names else None
            if self.plot is None:
                self.image.value = b""
                return
            self.plot.update(self.session.history)
            self._render()

    def _render(self) -> None:
        assert self.plot is not None
        self.image.value = self.plot.to_png()
        self.renders += 1

    def refresh(self) -> None:
        with self._lock:
            options = self._options(self.select.value)
            if list(self.select.options) != options:
                selected = self.select.value
                self._syncing = True  # new options reset the selection; put it back without replotting
                try:
                    self.select.options = options
                    self.select.value = selected
                finally:
                    self._syncing = False
            if self.plot is not None and self.plot.update(self.session.history):
                self._render()
