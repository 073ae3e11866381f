"""The Sweep tab: the session's newest sweep (`Session.sweep`), its members side by side and live.

Above, one chart per metric with every member's curve overlaid (`sweep_chart`), one colour a member, the
legend naming each by the settings in which the members differ (`differing_settings`: its learning
rate, seed, rank, options...). Below, the members' table: colour, name, state, those settings, step, and
the latest and best value of the metric picked above it (best: the least or the greatest, as picked).
The rows start in the sweep's order (`#`); a header's button sorts by its column (again: the other way). Each row has the member's controls,
each calling the `Member` / `Sweep` method a cell would: Pause, Resume, Stop (`member.stop()`, which
frees its model), Clone (`sweep.clone(member, **changes)`, the changes typed in the "clone with" field:
`learning_rate=3e-4, name=slow`) and Promote (`sweep.promote(member)`).

A control redraws the table at once, so the page acknowledges it within the callback (the panel's
widget subshell serves it while a cell waits in `sweep.wait()`); the charts and the table follow the
sweep at the panel's refresh. Traffic: a row's text is sent only when it changed (its step does once a
round, ~0.3 KB), and while the sweep trains the charts are redrawn at most every `CHART_S` and no more
often in rounds than their bytes allow at `CHART_BYTES_PER_ROUND` a round, so a round costs the page
well under the panel's 20 KB.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ipywidgets

from workbench.notebook.panel.feedback import Feedback
from workbench.notebook.panel.sweep_chart import PALETTE, ChartLine, overlay_svg
from workbench.notebook.run import RunState

if TYPE_CHECKING:
    from workbench.notebook.session import Session
    from workbench.notebook.sweep import Member, Sweep

CHART_S = 2.0
"""The shortest time between two redraws of a training sweep's charts."""
CHART_BYTES_PER_ROUND = 8_000
"""What the charts send the page per round of a training sweep, at most on average: a redraw of N bytes
waits ceil(N / CHART_BYTES_PER_ROUND) rounds before the next."""

STYLE = (
    "<style>"
    ".wb-sweep-cell{display:inline-block;box-sizing:border-box;overflow:hidden;text-overflow:ellipsis;"
    "white-space:nowrap;vertical-align:middle;padding-right:.4em}"
    ".wb-sweep-charts{display:flex;flex-wrap:wrap;gap:8px}"
    "</style>"
)
"""The table's cell rule, once for the tab: each cell then carries only its width."""


def _flat_settings(member: Member) -> dict[str, Any]:
    """A member's settings as one flat dict: its LoRA fields, its current AdamParams' fields (a clone's
    changed ones), its seed and its step function's options."""
    settings = member.settings
    flat: dict[str, Any] = {
        **{k: v for k, v in dataclasses.asdict(settings.lora).items() if k != "seed"},
        **dataclasses.asdict(member.adam_params),
        "seed": settings.seed,
    }
    flat.update({k: v for k, v in settings.options.items() if isinstance(v, int | float | str | bool)})
    return flat


def differing_settings(members: Sequence[Member]) -> list[str]:
    """The setting names whose values differ between `members` (in a stable order): what tells the
    members apart, for the legend and the table's columns."""
    flats = [_flat_settings(member) for member in members]
    names = list(dict.fromkeys(name for flat in flats for name in flat))
    return [name for name in names if len({repr(flat.get(name)) for flat in flats}) > 1]


def _shown(value: object) -> str:
    if isinstance(value, float):
        return "–" if math.isnan(value) else f"{value:.4g}"
    return str(value)


def best_value(values: Sequence[float], best: str) -> float:
    """The least (`best="min"`) or greatest finite value, NaN when there is none."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return math.nan
    return min(finite) if best == "min" else max(finite)


def parse_changes(text: str) -> dict[str, Any]:
    """The "clone with" field's `name=value, name=value` as keyword arguments; a value is a Python
    literal (`3e-4`, `'cross_entropy'`, `None`) or else the bare word as a string."""
    changes: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        name, sep, value = part.partition("=")
        if not sep or not name.strip().isidentifier():
            raise ValueError(f"clone changes are name=value pairs separated by commas, got {part!r}")
        try:
            changes[name.strip()] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            changes[name.strip()] = value.strip()
    return changes


@dataclasses.dataclass(frozen=True)
class MemberRow:
    """One member as the table shows it."""

    member: Member
    index: int
    """Its place in the sweep: configs in order, then clones."""
    colour: str
    settings: Mapping[str, Any]
    """Its differing settings."""
    latest: float
    best: float

    @property
    def name(self) -> str:
        return self.member.settings.name

    @property
    def state(self) -> str:
        member = self.member
        if member.stop_requested:
            return "stopping"
        return member.state.value


@dataclasses.dataclass(frozen=True)
class Column:
    """A column of the members' table: its title, width, text and sort key."""

    title: str
    width_em: float
    text: Callable[[MemberRow], str]
    key: Callable[[MemberRow], str | float]


FIXED_COLUMNS = (
    Column("#", 2.5, lambda r: str(r.index), lambda r: float(r.index)),
    Column("member", 14, lambda r: r.name, lambda r: r.name),
    Column("state", 5.5, lambda r: r.state, lambda r: r.state),
    Column("step", 3.5, lambda r: str(r.member.i), lambda r: float(r.member.i)),
    Column("latest", 5, lambda r: _shown(r.latest), lambda r: r.latest),
    Column("best", 5, lambda r: _shown(r.best), lambda r: r.best),
)


def _setting_column(name: str) -> Column:
    def key(row: MemberRow) -> str | float:
        value = row.settings.get(name)
        return float(value) if isinstance(value, int | float) else str(value)

    return Column(name, 6, lambda r: _shown(r.settings.get(name, "")), key)


def sorted_rows(rows: Sequence[MemberRow], column: Column, descending: bool) -> list[MemberRow]:
    """`rows` by `column`'s key; rows without a value (NaN) last either way."""

    def missing(row: MemberRow) -> bool:
        value = column.key(row)
        return isinstance(value, float) and math.isnan(value)

    present = [row for row in rows if not missing(row)]
    return sorted(present, key=column.key, reverse=descending) + [row for row in rows if missing(row)]


def _cell(text: str, width_em: float, colour: str | None = None) -> str:
    swatch = f'<b style="color:{colour}">■</b> ' if colour else ""
    escaped = html.escape(text)
    return (
        f'<span class="wb-sweep-cell" style="width:{width_em}em" title="{escaped}">{swatch}{escaped}</span>'
    )


class MemberControls:
    """A row of the table: the member's cells and its buttons."""

    def __init__(self, tab: SweepTab, member: Member) -> None:
        self.member = member
        self.cells = ipywidgets.HTML()
        self.buttons: dict[str, ipywidgets.Button] = {}
        for action, icon in (
            ("pause", "pause"),
            ("resume", "play"),
            ("stop", "stop"),
            ("clone", "clone"),
            ("promote", "arrow-up"),
        ):
            button = ipywidgets.Button(
                description=action.capitalize(),
                icon=icon,
                layout=ipywidgets.Layout(width="6.5em", padding="0", margin="0 1px"),
            )
            button.add_class(f"wb-sweep-{action}")
            button.on_click(tab.feedback.guard(lambda _b, action=action: getattr(tab, action)(self.member)))
            self.buttons[action] = button
        self.widget = ipywidgets.HBox([self.cells, *self.buttons.values()])
        self.widget.add_class("wb-sweep-row")

    def show(self, cells: str) -> None:
        """Set the row's text and which of its buttons apply, sending only what changed."""
        if self.cells.value != cells:
            self.cells.value = cells
        state = self.member.state
        enabled = {
            "pause": state is RunState.RUNNING,
            "resume": state is RunState.PAUSED,
            "stop": state is not RunState.STOPPED and not self.member.stop_requested,
            "clone": state is not RunState.STOPPED,
            "promote": state is not RunState.STOPPED,
        }
        for action, button in self.buttons.items():
            if button.disabled == enabled[action]:
                button.disabled = not enabled[action]


class SweepTab:
    """The newest sweep's overlaid curves, its members' table with their controls, and a message line."""

    def __init__(self, session: Session, metrics: Sequence[str]) -> None:
        self.session = session
        self.feedback = Feedback()
        self.chart_metrics = list(metrics)
        """The metrics charted, one chart each (the panel's `metrics`)."""
        self.sweep: Sweep | None = None
        """The sweep shown (the session's newest)."""
        self.sort_column = FIXED_COLUMNS[0]
        self.descending = False
        self.heading = ipywidgets.HTML()
        self.metric = ipywidgets.Dropdown(options=[metrics[0]], value=metrics[0], description="metric")
        self.metric.add_class("wb-sweep-metric")
        self.best = ipywidgets.ToggleButtons(options=["min", "max"], value="min", description="best")
        self.best.style.button_width = "4em"
        self.changes = ipywidgets.Text(
            placeholder="learning_rate=3e-4",
            description="clone with",
            continuous_update=True,
            layout=ipywidgets.Layout(width="22em"),
        )
        self.changes.add_class("wb-sweep-changes")
        self.charts = ipywidgets.HTML()
        self.charts.add_class("wb-sweep-charts-box")
        self.header_box = ipywidgets.HBox(layout=ipywidgets.Layout(overflow="auto hidden"))
        self.rows = ipywidgets.VBox(layout=ipywidgets.Layout(max_height="24em", overflow="auto"))
        self.controls: dict[str, MemberControls] = {}
        """Each member's row, by model id."""
        self._headers: dict[str, ipywidgets.Button] = {}
        self.chart_renders = 0
        self.chart_bytes = 0
        """The bytes the charts' last redraw sent."""
        self._charted_at = 0.0
        self._charted_round = 0
        self._lock = threading.RLock()  # the panel's timer and the controls' callbacks both redraw
        self._syncing = False
        self.metric.observe(self.feedback.guard(self._metric_picked), names="value")
        self.best.observe(self.feedback.guard(lambda _c: self.redraw(charts=False)), names="value")
        self.widget = ipywidgets.VBox(
            [
                ipywidgets.HTML(STYLE),
                self.heading,
                self.charts,
                ipywidgets.HBox([self.metric, self.best, self.changes]),
                self.header_box,
                self.rows,
                self.feedback.widget,
            ]
        )
        self.widget.add_class("wb-sweep")
        self.refresh()

    # ------------------------------------------------------------------------------------------ controls

    def _metric_picked(self, _change: object) -> None:
        if not self._syncing:
            self.redraw(charts=True)

    def _sweep(self) -> Sweep:
        if self.sweep is None:
            raise RuntimeError("no sweep yet: start one with sess.sweep(step_fn, configs, steps)")
        return self.sweep

    def pause(self, member: Member) -> None:
        """Pause `member` after its current step."""
        member.pause()
        self.feedback.info(f"{member.settings.name}: pausing after its current step")
        self.redraw(charts=False)

    def resume(self, member: Member) -> None:
        member.resume()
        self.feedback.info(f"{member.settings.name}: resumed")
        self.redraw(charts=False)

    def stop(self, member: Member) -> None:
        """Stop `member` (after its step in progress) and free its model."""
        member.stop()
        self.feedback.info(f"{member.settings.name}: stopped, its model freed")
        self.redraw(charts=False)

    def clone(self, member: Member) -> Member:
        """A new member from `member`'s current state, with the "clone with" field's changes."""
        changes = parse_changes(self.changes.value)
        self.feedback.info(f"cloning {member.settings.name} with {changes or 'no change'}…")
        clone = self._sweep().clone(member, **changes)
        self.feedback.info(f"cloned {member.settings.name} as {clone.settings.name}")
        self.redraw(charts=False)
        return clone

    def promote(self, member: Member) -> None:
        """Make `member`'s model the session's policy."""
        self._sweep().promote(member)
        self.feedback.info(f"promoted {member.settings.name}: it is the session's policy now")

    def sort_by(self, title: str) -> None:
        """Sort by the column titled `title`; sorting by it again reverses the order."""
        column = next(c for c in self.columns() if c.title == title)
        self.descending = not self.descending if column.title == self.sort_column.title else False
        self.sort_column = column
        self.redraw(charts=False)

    # ------------------------------------------------------------------------------------------ views

    def columns(self) -> list[Column]:
        """The fixed columns, with one column per differing setting after the state."""
        members = [] if self.sweep is None else list(self.sweep.members)
        settings = [_setting_column(name) for name in differing_settings(members)]
        return [*FIXED_COLUMNS[:3], *settings, *FIXED_COLUMNS[3:]]

    def member_rows(self) -> list[MemberRow]:
        """Every member of the sweep shown, as the table shows it (in the table's sort order)."""
        if self.sweep is None:
            return []
        members = list(self.sweep.members)
        differing = differing_settings(members)
        rows = []
        for k, member in enumerate(members):
            flat = _flat_settings(member)
            values = member.history.series(self.metric.value)[1]
            rows.append(
                MemberRow(
                    member,
                    k,
                    PALETTE[k % len(PALETTE)],
                    {name: flat.get(name) for name in differing},
                    values[-1] if values else math.nan,
                    best_value(values, self.best.value),
                )
            )
        column = next((c for c in self.columns() if c.title == self.sort_column.title), FIXED_COLUMNS[0])
        return sorted_rows(rows, column, self.descending)

    def legend_name(self, row: MemberRow) -> str:
        """A member's name in the legend: its differing settings, or its name when none differ."""
        return ", ".join(f"{k}={_shown(v)}" for k, v in row.settings.items()) or row.name

    def charts_html(self, rows: Sequence[MemberRow]) -> str:
        """Every charted metric's overlay and the legend, in submission order."""
        ordered = sorted(rows, key=lambda r: r.index)
        metrics = list(dict.fromkeys([*self.chart_metrics, self.metric.value]))
        charts = "".join(
            overlay_svg(
                metric,
                [
                    ChartLine(self.legend_name(row), row.colour, *row.member.history.series(metric))
                    for row in ordered
                ],
            )
            for metric in metrics
        )
        legend = " ".join(
            f'<span style="white-space:nowrap"><b style="color:{row.colour}">━</b> '
            f"{html.escape(self.legend_name(row))}</span>"
            for row in ordered
        )
        return f'<div class="wb-sweep-charts">{charts}</div><div class="wb-sweep-legend">{legend}</div>'

    def table_html(self, rows: Sequence[MemberRow]) -> str:
        """The members' table as static HTML, for the saved record."""
        columns = self.columns()
        head = "".join(
            f"<th style='text-align:left;padding-right:1em'>{html.escape(c.title)}</th>" for c in columns
        )
        body = "".join(
            "<tr>"
            + "".join(
                "<td style='padding-right:1em'>"
                + (f'<b style="color:{row.colour}">■</b> ' if column is FIXED_COLUMNS[1] else "")
                + f"{html.escape(column.text(row))}</td>"
                for column in columns
            )
            + "</tr>"
            for row in rows
        )
        return f'<table class="wb-sweep-table" style="border-collapse:collapse">{head and f"<tr>{head}</tr>"}{body}</table>'

    def record_html(self) -> str:
        """The sweep as the saved record shows it: its heading, charts and table (empty: no sweep)."""
        with self._lock:
            self._follow_newest()
            if self.sweep is None:
                return ""
            rows = self.member_rows()
            return (
                f'<div class="wb-sweep-record">{self._heading_text()}{self.charts_html(rows)}'
                f"{self.table_html(rows)}</div>"
            )

    def _heading_text(self) -> str:
        sweep = self._sweep()
        metric = f" · <i>metric: {html.escape(self.metric.value)}, best {self.best.value}</i>"
        return (
            f"<b>sweep {html.escape(sweep.name)}</b> · {sweep.state.value} · {len(sweep.members)} members"
            f" · round {sweep.rounds} of {sweep.steps}{metric}"
        )

    def _follow_newest(self) -> None:
        newest = self.session.sweeps[-1] if self.session.sweeps else None
        if newest is self.sweep:
            return
        self.sweep = newest
        for controls in self.controls.values():
            controls.widget.close()
        self.controls = {}
        if newest is not None and newest.by is not None:
            self._syncing = True
            try:
                self.metric.options = list(dict.fromkeys([newest.by, *self.metric.options]))
                self.metric.value = newest.by
                self.best.value = newest.mode
            finally:
                self._syncing = False
        self._charted_at, self._charted_round = 0.0, 0

    def _sync_metrics(self) -> None:
        sweep = self._sweep()
        names = sorted(
            {name for member in sweep.members for name in member.history.names() if "/" not in name}
            | {self.metric.value, *self.chart_metrics}
        )
        if list(self.metric.options) != names:
            chosen = self.metric.value
            self._syncing = True  # the options' change picks another value for a moment: no redraw
            try:
                self.metric.options = names
                self.metric.value = chosen
            finally:
                self._syncing = False

    def _charts_due(self) -> bool:
        sweep = self._sweep()
        if sweep.state is not RunState.RUNNING:
            return True
        if time.monotonic() - self._charted_at < CHART_S:
            return False
        rounds = sweep.rounds - self._charted_round
        return rounds >= max(1, math.ceil(self.chart_bytes / CHART_BYTES_PER_ROUND))

    def redraw(self, *, charts: bool) -> None:
        """Redraw the table (only the rows that changed are sent) and, with `charts`, the charts."""
        with self._lock:
            self._redraw(charts)

    def _redraw(self, charts: bool) -> None:
        if self.sweep is None:
            self.heading.value = "<i>no sweep yet: sess.sweep(step_fn, configs, steps) starts one</i>"
            return
        rows = self.member_rows()
        heading = self._heading_text()
        if self.heading.value != heading:
            self.heading.value = heading
        columns = self.columns()
        titles = [c.title for c in columns]
        if list(self._headers) != titles:
            self._headers = {}
            for column in columns:
                button = ipywidgets.Button(
                    layout=ipywidgets.Layout(width=f"{column.width_em}em", padding="0", margin="0")
                )
                button.add_class(f"wb-sweep-sort-{column.title.lower().replace('_', '-')}")
                button.on_click(self.feedback.guard(lambda _b, title=column.title: self.sort_by(title)))
                self._headers[column.title] = button
            self.header_box.children = list(self._headers.values())
        for title, button in self._headers.items():
            arrow = (" ▼" if self.descending else " ▲") if title == self.sort_column.title else ""
            if button.description != title + arrow:
                button.description = title + arrow
        shown = []
        for row in rows:
            controls = self.controls.get(row.member.model_id)
            if controls is None:
                controls = self.controls[row.member.model_id] = MemberControls(self, row.member)
            cells = "".join(
                _cell(c.text(row), c.width_em, row.colour if c is FIXED_COLUMNS[1] else None) for c in columns
            )
            controls.show(f'<div style="white-space:nowrap">{cells}</div>')
            shown.append(controls.widget)
        if list(self.rows.children) != shown:
            self.rows.children = shown
        if charts:
            value = self.charts_html(rows)
            if self.charts.value != value:
                self.charts.value = value
                self.chart_bytes = len(value.encode())
                self.chart_renders += 1
            self._charted_at, self._charted_round = time.monotonic(), self._sweep().rounds

    def opened(self) -> None:
        """Opening the tab draws the charts at its next refresh, due or not."""
        self._charted_at = 0.0
        self._charted_round = -(10**9)

    def refresh(self) -> None:
        with self._lock:
            self._follow_newest()
            if self.sweep is not None:
                self._sync_metrics()
            self._redraw(self.sweep is not None and self._charts_due())
