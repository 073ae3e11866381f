"""The Runs tab: every model folder under the models root as a table, and this session's every metric.

What a W&B user opens first: the runs side by side. Each row is one model folder
(`workbench.storage.run_listing`: its id, when it was made, the base model, the user's tags and notes,
the LoRA rank and alpha, the learning rate and loss it last trained with, its last step, and the
last / least / greatest value of the metric picked above the table), read from the files alone: no
model is loaded. A header's button sorts by its column (again: the other way); the filter keeps the rows
whose id, base model, loss, tags or notes hold every word typed. The rows ticked overlay in the
Metrics tab's plots with one click on "Overlay in Metrics" (the Metrics tab opens on them); ticking
none and clicking removes the overlays.

A folder whose run stopped before its end (its newest run checkpoint has steps left: a crashed kernel,
a stopped run) is offered for resuming: its step cell says so and a line under the table gives the call
that continues it (`workbench.notebook.run_checkpoints.stopped_run_note`).

The folders are read when the tab is opened, when "Refresh" is clicked and when a run of this session
ends, never at every refresh of the panel: a listing reads every folder's new history lines. Below the
table, every metric this session's history holds, with its last, least and greatest value and count
(`workbench.metrics.summarize`, carried on row by row), the families of per-layer metrics (`grad_norm/…`,
`update_norm/…`) folded under one line each.
"""

from __future__ import annotations

import dataclasses
import datetime
import html
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import ipywidgets

from workbench.metrics import MetricSummary, summarize
from workbench.notebook.panel.feedback import Feedback
from workbench.notebook.run_checkpoints import stopped_run_note
from workbench.storage.checkpoint_store import kind_dir
from workbench.storage.run_listing import HISTORY_FILE, RunEntry, RunListing

if TYPE_CHECKING:
    from workbench.notebook.session import Session

MAX_ROWS = 60
"""The most rows the table shows (after the filter and the sort); the rest are counted."""
OWN_MARK = "● "
"""What marks this session's own row (its run id in bold after it)."""
STOPPED_MARK = " ⏸"
"""What follows the step of a run that stopped before its end (its step cell's tooltip says how to resume)."""
SUMMARY_S = 5.0
"""How often, at most, the summary of a running session's metrics is redrawn while the tab is shown."""


def format_value(value: float) -> str:
    if math.isnan(value):
        return "–"
    return f"{value:.4g}"


@dataclasses.dataclass(frozen=True)
class Column:
    """A column of the table: its header, its width, how a row shows in it and how it sorts."""

    title: str
    width_em: float
    text: Callable[[RunEntry, str], str]
    key: Callable[[RunEntry, str], str | float]
    detail: Callable[[RunEntry], str] | None = None
    """What the cell's tooltip shows in full (default: its text)."""


def _json(value: object) -> str:
    return json.dumps(value, sort_keys=True)


def _settings(entry: RunEntry, key: str) -> str:
    """Each role's `key` setting in full (AdamParams, or the loss and its config), for a tooltip."""
    return "; ".join(f"{role}: {_json(found[key])}" for role, found in entry.settings.items() if key in found)


def _lora(entry: RunEntry) -> str:
    rank, alpha = entry.lora.get("rank"), entry.lora.get("alpha")
    return f"r{rank} α{alpha:g}" if isinstance(alpha, int | float) else f"r{rank}"


COLUMNS = (
    Column("run", 19, lambda e, _m: e.model_id, lambda e, _m: e.model_id),
    Column(
        "created",
        8.5,
        lambda e, _m: datetime.datetime.fromtimestamp(e.created_at).strftime("%m-%d %H:%M:%S"),
        lambda e, _m: e.created_at,
    ),
    Column("base", 7, lambda e, _m: e.base_model, lambda e, _m: e.base_model),
    Column("tags", 7, lambda e, _m: ", ".join(e.tags), lambda e, _m: ", ".join(e.tags)),
    Column("notes", 9, lambda e, _m: e.notes, lambda e, _m: e.notes),
    Column(
        "LoRA",
        4.5,
        lambda e, _m: _lora(e),
        lambda e, _m: float(e.lora.get("rank") or 0),
        lambda e: _json(e.lora),
    ),
    Column(
        "lr",
        4.5,
        lambda e, _m: format_value(e.learning_rate),
        lambda e, _m: e.learning_rate,
        lambda e: _settings(e, "adam_params"),
    ),
    Column("loss", 7.5, lambda e, _m: e.loss_fn, lambda e, _m: e.loss_fn, lambda e: _settings(e, "loss")),
    Column("step", 3.5, lambda e, _m: str(e.last_step), lambda e, _m: float(e.last_step)),
    Column("last", 5, lambda e, m: format_value(e.metric(m).last), lambda e, m: e.metric(m).last),
    Column("min", 5, lambda e, m: format_value(e.metric(m).min), lambda e, m: e.metric(m).min),
    Column("max", 5, lambda e, m: format_value(e.metric(m).max), lambda e, m: e.metric(m).max),
)
"""The table's columns, in their order; `last`, `min` and `max` are of the picked metric."""


def sorted_entries(
    entries: Sequence[RunEntry], column: Column, metric: str, descending: bool
) -> list[RunEntry]:
    """`entries` by `column`'s key; rows without a value (NaN) last either way."""

    def key(entry: RunEntry) -> tuple[bool, str | float]:
        value = column.key(entry, metric)
        return isinstance(value, float) and math.isnan(value), value

    present = [e for e in entries if not key(e)[0]]
    missing = [e for e in entries if key(e)[0]]
    return sorted(present, key=lambda e: key(e)[1], reverse=descending) + missing


def _cell(text: str, width_em: float, bold: bool = False, detail: str | None = None) -> str:
    escaped = html.escape(text)
    weight = "font-weight:bold;" if bold else ""
    title = html.escape(text if detail is None else detail)
    return (
        f'<span title="{title}" style="display:inline-block;box-sizing:border-box;width:{width_em + 0.4}em;'
        f"overflow:hidden;text-overflow:ellipsis;white-space:nowrap;vertical-align:middle;"
        f'padding-right:.4em;{weight}">{escaped}</span>'
    )


def summary_table(summaries: dict[str, MetricSummary]) -> str:
    """An HTML table of every metric's last / min / max / count; names with a `/` folded by family."""
    if not summaries:
        return "<i>no metrics recorded yet</i>"
    cell = 'style="padding:1px 10px 1px 0;text-align:left"'

    def rows(items: Sequence[tuple[str, MetricSummary]]) -> str:
        return "".join(
            f"<tr><td {cell}>{html.escape(name)}</td>"
            + "".join(f"<td {cell}>{format_value(v)}</td>" for v in (s.last, s.min, s.max))
            + f"<td {cell}>{s.count}</td></tr>"
            for name, s in items
        )

    head = (
        "<tr>" + "".join(f"<th {cell}>{t}</th>" for t in ("metric", "last", "min", "max", "count")) + "</tr>"
    )
    plain = [(name, s) for name, s in summaries.items() if "/" not in name]
    families: dict[str, list[tuple[str, MetricSummary]]] = {}
    for name, s in summaries.items():
        if "/" in name:
            families.setdefault(name.split("/", 1)[0], []).append((name, s))
    folded = "".join(
        f'<details class="wb-summary-family"><summary>{html.escape(family)}/… ({len(items)} metrics)</summary>'
        f'<table style="border-collapse:collapse">{head}{rows(items)}</table></details>'
        for family, items in families.items()
    )
    return f'<table class="wb-metric-summary" style="border-collapse:collapse">{head}{rows(plain)}</table>{folded}'


class RunsTab:
    """The runs table (filter, metric, sort, tick and overlay) and this session's metrics summary."""

    def __init__(self, session: Session, metric: str, overlay: Callable[[Sequence[Path]], None]) -> None:
        self.session = session
        self.overlay_runs = overlay
        self.feedback = Feedback()
        self.listing = RunListing({session.model_id: session.model_dir})
        self.entries: list[RunEntry] = []
        self.sort_column = COLUMNS[1]
        self.descending = True  # newest first
        self.selected: set[str] = set()
        """The ticked runs' ids."""
        self.filter = ipywidgets.Text(
            placeholder="filter: words in the id, base model, loss, tags or notes",
            continuous_update=True,
            layout=ipywidgets.Layout(width="26em"),
        )
        self.filter.add_class("wb-runs-filter")
        self.metric = ipywidgets.Dropdown(options=[metric], value=metric, description="metric")
        self.metric.add_class("wb-runs-metric")
        self.refresh_button = ipywidgets.Button(description="Refresh", icon="refresh")
        self.overlay_button = ipywidgets.Button(
            description="Overlay in Metrics", icon="chart-line", layout=ipywidgets.Layout(width="auto")
        )
        self.overlay_button.add_class("wb-runs-overlay")
        self.headers = []
        for column in COLUMNS:
            button = ipywidgets.Button(
                description=column.title,
                layout=ipywidgets.Layout(width=f"{column.width_em + 0.4}em", padding="0", margin="0"),
            )
            button.add_class(f"wb-runs-sort-{column.title.lower()}")
            button.on_click(self.feedback.guard(lambda _b, column=column: self.sort_by(column.title)))
            self.headers.append(button)
        self.count = ipywidgets.HTML()
        self.stopped = ipywidgets.HTML()
        self.stopped.add_class("wb-runs-stopped")
        self._stopped_seen: dict[Path, tuple[int, str | None]] = {}  # folder: (its checkpoints' mtime, note)
        self._stopped_notes: dict[str, str] = {}
        """Each listed run that stopped before its end: where, and the call that resumes it."""
        self.rows = ipywidgets.VBox(
            layout=ipywidgets.Layout(max_height="24em", overflow="auto", width="100%")
        )
        self._checkboxes: dict[str, ipywidgets.Checkbox] = {}
        self._row_boxes: dict[str, ipywidgets.HBox] = {}
        self.summary = ipywidgets.HTML()
        self.summary.add_class("wb-runs-summary")
        self._summaries: dict[str, MetricSummary] = {}
        self._summarized_rows = 0
        self._summary_at = 0.0
        self._stale = True  # the folders are read at the next refresh
        self._run_seen: tuple[int, bool] | None = None  # (id of the current run, whether it was active)
        self.filter.observe(self.feedback.guard(lambda _change: self._render()), names="value")
        self.metric.observe(self.feedback.guard(lambda _change: self._render()), names="value")
        self.refresh_button.on_click(self.feedback.guard(lambda _b: self.rescan()))
        self.overlay_button.on_click(self.feedback.guard(lambda _b: self.overlay_selected()))
        self.widget = ipywidgets.VBox(
            [
                ipywidgets.HBox([self.filter, self.metric, self.refresh_button, self.overlay_button]),
                ipywidgets.HBox(
                    [ipywidgets.HTML(layout=ipywidgets.Layout(width="2.2em")), *self.headers],
                    layout=ipywidgets.Layout(overflow="auto hidden"),
                ),
                self.rows,
                self.count,
                self.stopped,
                self.feedback.widget,
                ipywidgets.HTML("<b>This session's metrics</b>"),
                self.summary,
            ]
        )
        self.widget.add_class("wb-runs")

    # ------------------------------------------------------------------------------------------ actions

    def rescan(self) -> None:
        """Read the model folders again and redraw the table."""
        self.entries = self.listing.scan()
        self._stopped_notes = {}
        for entry in self.entries:
            own = entry.model_id == self.session.model_id
            if own and self.session.current_run is not None:
                continue  # the session's own run is in the Train tab and the status bar
            note = (
                stopped_run_note(entry.folder, self.session.resume_point)
                if own
                else self._stopped_note(entry.folder)
            )
            if note is not None:
                self._stopped_notes[entry.model_id] = note
        self._summaries, self._summarized_rows = {}, 0  # rows a rewind marked discarded are left out
        self.summary.value = ""
        names = sorted({name for entry in self.entries for name in entry.metrics} | {self.metric.value})
        if list(self.metric.options) != names:
            chosen = self.metric.value
            self.metric.options = names
            self.metric.value = chosen
        self._stale = False
        self._render()

    def _stopped_note(self, folder: Path) -> str | None:
        """`stopped_run_note` of another folder, read again only when its state checkpoints change (a
        checkpoint lands or goes by a rename or removal in that folder, which moves its mtime)."""
        try:
            stamp = kind_dir(folder, "state").stat().st_mtime_ns
        except OSError:
            return None  # no state checkpoint: no run to resume
        seen = self._stopped_seen.get(folder)
        if seen is None or seen[0] != stamp:
            seen = self._stopped_seen[folder] = (stamp, stopped_run_note(folder, None))
        return seen[1]

    def sort_by(self, title: str) -> None:
        """Sort by the column titled `title`; sorting by it again reverses the order."""
        column = next(c for c in COLUMNS if c.title == title)
        self.descending = not self.descending if column is self.sort_column else column.title == "created"
        self.sort_column = column
        self._render()

    def select(self, model_ids: Sequence[str]) -> None:
        """Tick exactly these runs (what ticking their boxes does)."""
        for model_id, box in self._checkboxes.items():
            box.value = model_id in model_ids
        self.selected = {model_id for model_id in model_ids if model_id in self._checkboxes}

    def overlay_selected(self) -> None:
        """Overlay the ticked runs in the Metrics tab (this session's own folder is its live lines)."""
        folders = [
            entry.folder
            for entry in self.entries
            if entry.model_id in self.selected and entry.model_id != self.session.model_id
        ]
        missing = [folder.name for folder in folders if not (folder / HISTORY_FILE).is_file()]
        if missing:
            raise ValueError(f"no history to overlay for {', '.join(missing)}")
        self.overlay_runs(folders)
        self.feedback.info(f"overlaid {len(folders)} run{'s' * (len(folders) != 1)} in Metrics")

    # ------------------------------------------------------------------------------------------ views

    def visible_entries(self) -> list[RunEntry]:
        """The rows shown: filtered, then sorted."""
        kept = [entry for entry in self.entries if entry.matches(self.filter.value)]
        return sorted_entries(kept, self.sort_column, self.metric.value, self.descending)

    def _row(self, entry: RunEntry) -> ipywidgets.HBox:
        box = self._checkboxes.get(entry.model_id)
        if box is None:
            box = ipywidgets.Checkbox(
                value=entry.model_id in self.selected,
                indent=False,
                layout=ipywidgets.Layout(width="2.2em"),
            )
            box.observe(
                lambda change, model_id=entry.model_id: self._ticked(model_id, change["new"]), names="value"
            )
            self._checkboxes[entry.model_id] = box
            self._row_boxes[entry.model_id] = ipywidgets.HBox([box, ipywidgets.HTML()])
            self._row_boxes[entry.model_id].add_class("wb-runs-row")
        row = self._row_boxes[entry.model_id]
        own = entry.model_id == self.session.model_id
        stopped = self._stopped_notes.get(entry.model_id)

        def cell(column: Column) -> str:
            text = column.text(entry, self.metric.value)
            detail = None if column.detail is None else column.detail(entry)
            if column.title == "run" and own:
                text = OWN_MARK + text
            if column.title == "step" and stopped is not None:
                text, detail = text + STOPPED_MARK, stopped
            return _cell(text, column.width_em, bold=own and column.title == "run", detail=detail)

        cells = "".join(cell(column) for column in COLUMNS)
        cells = f'<div style="white-space:nowrap">{cells}</div>'
        label = row.children[1]
        if label.value != cells:
            label.value = cells
        return row

    def _ticked(self, model_id: str, ticked: bool) -> None:
        if ticked:
            self.selected.add(model_id)
        else:
            self.selected.discard(model_id)

    def _render(self) -> None:
        shown = self.visible_entries()
        rows = [self._row(entry) for entry in shown[:MAX_ROWS]]
        if list(self.rows.children) != rows:
            self.rows.children = rows
        for button, column in zip(self.headers, COLUMNS, strict=True):
            arrow = (" ▼" if self.descending else " ▲") if column is self.sort_column else ""
            button.description = column.title + arrow
        hidden = len(shown) - len(rows)
        self.count.value = (
            f"<small>{len(shown)} of {len(self.entries)} runs"
            + (f", the first {len(rows)} shown" if hidden else "")
            + f" · sorted by {self.sort_column.title} · {OWN_MARK}this session</small>"
        )
        notes = [
            (entry.model_id, self._stopped_notes[entry.model_id])
            for entry in shown
            if entry.model_id in self._stopped_notes
        ]
        self.stopped.value = "".join(
            f"<div><small>{STOPPED_MARK.strip()} <b>{html.escape(model_id)}</b>: <code>{html.escape(note)}</code></small></div>"
            for model_id, note in notes
        )
        listed = {entry.model_id for entry in self.entries}
        for model_id in [m for m in self._checkboxes if m not in listed]:  # folders removed
            self._row_boxes.pop(model_id).close()
            self._checkboxes.pop(model_id).close()
            self.selected.discard(model_id)

    def _refresh_summary(self) -> None:
        rows = self.session.history.rows
        if len(rows) < self._summarized_rows:  # a new history (a checkpoint loaded): afresh
            self._summaries, self._summarized_rows = {}, 0
        if len(rows) == self._summarized_rows and self.summary.value:
            return
        if time.monotonic() - self._summary_at < SUMMARY_S and self.summary.value:
            return
        end = len(rows)
        summarize(rows[self._summarized_rows : end], into=self._summaries)
        self._summarized_rows = end
        self._summary_at = time.monotonic()
        self.summary.value = summary_table(self._summaries)

    def opened(self) -> None:
        """Opening the tab reads the folders again."""
        self._stale = True

    def refresh(self) -> None:
        run = self.session.current_run
        seen = None if run is None else (id(run), run.active)
        if self._run_seen is not None and seen != self._run_seen and seen is not None and not seen[1]:
            self._stale = True  # a run ended: its folder's last rows are on disk
        self._run_seen = seen
        if self._stale:
            self.rescan()
        self._refresh_summary()
