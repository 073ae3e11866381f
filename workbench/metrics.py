"""The session's metrics history, and the sinks that forward it (JSONL, Weights & Biases).

Every operation appends one row: which op, on which model, at which optimizer step (the policy's step
count: the x-axis of every plot and of W&B), when, and its metrics. Sinks receive each row as it is
recorded; a sink that raises is reported with a warning and never breaks the operation.

`JsonlSink` keeps a plain-text copy of the rows next to the session's files: one JSON object a line,
flushed per row, so a crash loses at most the row being written and any tool (pandas, jq) can read it.

`WandbSink` forwards rows to a W&B run. Several operations share one optimizer step (a
`forward_backward` per micro-batch, `forward` on held-out data, then `optim_step`), so rows cannot be
logged with `run.log(..., step=step)`: W&B keeps one row per step there (a second micro-batch's loss
would overwrite the first's) and ignores a step smaller than the last. Instead every row is its own `run.log` call (W&B's internal `_step` counts rows) carrying the
`optimizer_step` metric, and `define_metric` makes `optimizer_step` the x-axis of every model's
metrics. Keys are `"{model}/{op}/{metric}"`, e.g. `policy/forward_backward/loss:sum`: the W&B UI
groups charts by the part before the first `/`, so each model gets its own section, and keeping the op
in the key keeps a held-out `forward` loss and the training `forward_backward` loss on separate lines
instead of one line that zig-zags between them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import wandb

ROW_COLUMNS = ("step", "op", "model", "time")
"""The columns every history row has; the other keys are metrics."""

DISCARDED = "discarded"
"""The mark of a row whose step a resumed run trained again (`workbench.notebook.run_checkpoints`):
kept in the file, left out of series and names."""


def metric_values(metrics: Mapping[str, Any]) -> dict[str, float]:
    """A row's metrics as floats, checked: each name a string other than the row's own columns
    (`ROW_COLUMNS`, which a metric would overwrite in the history, the JSONL file and the plots), each
    value a number. Raises ValueError naming the first bad metric."""
    if not isinstance(metrics, Mapping):
        raise ValueError(f"metrics must be a dict of {{name: number}}, got {type(metrics).__name__}")
    values: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise ValueError(f"metric names must be strings, got {name!r}")
        if name in ROW_COLUMNS:
            raise ValueError(
                f"metric {name!r} would overwrite the history's own {name!r} column: the names "
                f"{list(ROW_COLUMNS)} are reserved, use another (e.g. {'my_' + name!r})"
            )
        if isinstance(value, (str, bytes)):
            raise ValueError(f"metric {name!r} must be a number, got {value!r}")
        try:
            values[name] = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"metric {name!r} must be a number, got {value!r}") from None
    return values


class Sink(Protocol):
    """Receives every history row and event (e.g. a JSONL file, a W&B run)."""

    def write(self, row: Mapping[str, Any]) -> None: ...

    def log_event(self, name: str, payload: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsHistory:
    """An append-only table of metric rows: `[{"step", "op", "model", "time", <metric>: value, ...}]`.

    `series(name)` gives one metric against the step; `to_pandas()` the whole table.
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.sinks: list[Sink] = []

    def record(self, op: str, model: str, step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
        """Append a row; raises ValueError (and appends nothing) for a metric named like a column or not
        a number (`metric_values`)."""
        values = metric_values(metrics)
        row: dict[str, Any] = {"step": step, "op": op, "model": model, "time": time.time()}
        row.update(values)
        self.rows.append(row)
        for sink in list(self.sinks):
            try:
                sink.write(row)
            except Exception as error:  # a broken sink must never break a training step
                warnings.warn(
                    f"metrics sink {type(sink).__name__} failed: {error!r}", RuntimeWarning, stacklevel=2
                )
        return row

    def event(self, name: str, payload: Mapping[str, Any]) -> None:
        """Tell the sinks about a one-off fact of the run (e.g. a saved checkpoint: its name, kind, path,
        step); a sink that raises is reported with a warning and never breaks the operation."""
        for sink in list(self.sinks):
            try:
                sink.log_event(name, payload)
            except Exception as error:
                warnings.warn(
                    f"metrics sink {type(sink).__name__} did not record event {name!r}: {error!r}",
                    RuntimeWarning,
                    stacklevel=2,
                )

    @classmethod
    def from_jsonl(cls, path: str | Path) -> MetricsHistory:
        """The rows a `JsonlSink` wrote: a run's `history.jsonl`, or the model folder that holds it (to
        plot a finished run, or compare runs). The history has no sinks."""
        path = Path(path)
        if path.is_dir():
            path = path / "history.jsonl"
        history = cls()
        with path.open(encoding="utf-8") as lines:
            history.rows = [json.loads(line) for line in lines if line.strip()]
        return history

    def series(self, name: str, op: str | None = None) -> tuple[list[int], list[float]]:
        """Steps and values of one metric, optionally from one kind of op only."""
        steps: list[int] = []
        values: list[float] = []
        for row in self.rows:
            if name in row and (op is None or row["op"] == op) and not row.get(DISCARDED):
                steps.append(row["step"])
                values.append(row[name])
        return steps, values

    def names(self) -> list[str]:
        """Every metric name recorded so far (excluding the row's own columns)."""
        seen: dict[str, None] = {}
        for row in self.rows:
            for key in row:
                if key not in ROW_COLUMNS and key != DISCARDED and not row.get(DISCARDED):
                    seen.setdefault(key)
        return list(seen)

    def last(self, name: str) -> float:
        for row in reversed(self.rows):
            if name in row:
                return row[name]
        return math.nan

    def summary(self) -> dict[str, MetricSummary]:
        """Every metric's last, least and greatest value and count (`summarize`)."""
        return summarize(self.rows)

    def to_pandas(self) -> Any:
        """The rows as a DataFrame; `step` stays an integer column."""
        import pandas as pd

        frame = pd.DataFrame(self.rows)
        if "step" in frame:
            frame["step"] = frame["step"].astype("Int64")
        return frame

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __repr__(self) -> str:
        return f"MetricsHistory({len(self.rows)} rows, metrics={self.names()})"


@dataclasses.dataclass
class MetricSummary:
    """One metric over a run: its last value, the least and greatest of its finite values (NaN while
    it has none), and how many rows carried it."""

    last: float = math.nan
    min: float = math.nan
    max: float = math.nan
    count: int = 0

    def add(self, value: float) -> None:
        self.last = value
        self.count += 1
        if value - value == 0.0:  # finite: NaN and ±inf give NaN
            if not self.min <= value:  # also while min is NaN (no finite value yet)
                self.min = value
            if not self.max >= value:
                self.max = value


_NOT_METRICS = frozenset((*ROW_COLUMNS, DISCARDED))


def summarize(
    rows: Iterable[Mapping[str, Any]], into: dict[str, MetricSummary] | None = None
) -> dict[str, MetricSummary]:
    """Every metric's `MetricSummary` over `rows` (rows marked discarded left out), by name in the order
    first seen; with `into`, the summaries of earlier rows are carried on (a growing history is
    summarized once per row, not once per look)."""
    summaries = {} if into is None else into
    for row in rows:
        if row.get(DISCARDED):
            continue
        for key, value in row.items():
            if key in _NOT_METRICS or type(value) not in (float, int):
                continue
            summary = summaries.get(key)
            if summary is None:
                summary = summaries[key] = MetricSummary()
            summary.add(float(value))
    return summaries


def history_run_name(path: str | Path) -> str:
    """The name of the run whose folder, or whose `history.jsonl`, is at `path`: the folder's name."""
    path = Path(path).absolute()
    return path.name if path.is_dir() else path.parent.name


class JsonlSink:
    """Appends every row to a JSON Lines file, flushed per row.

    NaN metrics are written as `NaN`, which Python's `json` and pandas read back; the file is opened in
    append mode so a resumed session continues the same file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, row: Mapping[str, Any]) -> None:
        self._file.write(json.dumps(dict(row)) + "\n")
        self._file.flush()

    def reopen(self) -> None:
        """Append to the file now at `path`: after it was replaced (a run rewound its history), the
        open handle would write to the old, unlinked one."""
        self._file.close()
        self._file = self.path.open("a", encoding="utf-8")

    def log_event(self, name: str, payload: Mapping[str, Any]) -> None:
        """The file holds metric rows only: events (saved checkpoints) are facts the model folder itself
        keeps (its checkpoint folders)."""

    def close(self) -> None:
        self._file.close()

    def __repr__(self) -> str:
        return f"JsonlSink({str(self.path)!r})"


WandbSetting = bool | Mapping[str, Any] | None
"""What `Session(wandb=...)` accepts: False (off), None or True (on), or extra `wandb.init` kwargs."""

STEP_METRIC = "optimizer_step"
"""The W&B metric that carries each row's optimizer step: the x-axis of every model's charts."""


class WandbSink:
    """Forwards history rows to a W&B run; see the module docstring for the key layout and the x-axis.

    Create it with `open_wandb_run`. Checkpoint events go to `log_event`.
    """

    def __init__(self, run: wandb.Run) -> None:
        self._run = run
        self._run.define_metric(STEP_METRIC)
        self._models: set[str] = set()

    @property
    def run_id(self) -> str:
        return self._run.id

    @property
    def url(self) -> str | None:
        """The run's page, or None for an offline run (sync it with `wandb sync <directory>`)."""
        return None if self._run.offline else self._run.url

    @property
    def mode(self) -> str:
        """`"online"` or `"offline"`."""
        return self._run.settings.mode

    @property
    def directory(self) -> Path:
        """The run's local folder, e.g. `<dir>/wandb/offline-run-<time>-<run_id>`."""
        return Path(self._run.settings.sync_dir)

    def write(self, row: Mapping[str, Any]) -> None:
        model, op = row["model"], row["op"]
        if model not in self._models:
            self._run.define_metric(f"{model}/*", step_metric=STEP_METRIC)
            self._models.add(model)
        data = {f"{model}/{op}/{key}": value for key, value in row.items() if key not in ROW_COLUMNS}
        data[STEP_METRIC] = row["step"]
        self._run.log(data)

    def log_event(self, name: str, payload: Mapping[str, Any]) -> None:
        """Record a one-off event (e.g. a saved checkpoint) in the run summary under `event/{name}`.

        Events are facts about the run, not series, so they go to the summary shown on the run's
        overview page rather than to the charts; a later event of the same name replaces the earlier one
        (the latest checkpoint is the one worth showing there).
        """
        self._run.summary[f"event/{name}"] = dict(payload)

    def describe(self, notes: str, tags: Sequence[str]) -> None:
        """Set the run's notes and tags (what `sess.describe` writes to the model folder)."""
        self._run.notes = notes
        self._run.tags = tuple(tags)

    def alert(self, title: str, text: str) -> None:
        """Send a W&B alert at level WARN (`wandb.Run.alert`: an e-mail or Slack message per the user's
        W&B settings; an offline run keeps it in its run file, and `wandb sync` sends it). W&B sends
        at most one alert of a title per minute."""
        self._run.alert(title=title[:63], text=text, level="WARN")

    def close(self) -> None:
        """Finish the run (an offline run is then complete and ready for `wandb sync`)."""
        self._run.finish()

    def __repr__(self) -> str:
        return f"WandbSink(run_id={self.run_id!r}, mode={self.mode!r}, directory={str(self.directory)!r})"


def open_wandb_run(
    setting: WandbSetting,
    *,
    config: Mapping[str, Any],
    run_id: str | None,
    project: str,
    directory: Path,
) -> WandbSink | None:
    """Start the W&B run for a session, or return None when W&B is off.

    The mode is the first of: a `"mode"` in `setting`, the `WANDB_MODE` environment variable, then
    `"online"` if W&B credentials are configured (`WANDB_API_KEY`, a netrc entry or `wandb login`, as
    found by `wandb.login(prompt=False, verify=False)`, which never prompts) and `"offline"` otherwise:
    an offline run is a local folder that `wandb sync` uploads later. Mode `"disabled"` returns None.

    Every session gets its own run (`reinit="create_new"`), so several sessions in one notebook never
    finish each other's runs, and nothing here relies on the global `wandb.run`.

    Args:
        setting: False for no run; None or True for the default run; a mapping of extra `wandb.init`
            kwargs (e.g. `{"project": "x", "mode": "offline"}`), which override the ones below.
        config: The session config, logged once as the run config.
        run_id: Resume (or create) the run with this id, so a resumed session continues the same run;
            None for a fresh id.
        project: The W&B project, unless `WANDB_PROJECT` or `setting` names one.
        directory: Where W&B puts its `wandb/` folder of run files (created if missing), unless
            `WANDB_DIR` or `setting` says otherwise.

    Returns:
        The sink to add to `MetricsHistory.sinks`, or None.
    """
    if not (setting is None or isinstance(setting, bool | Mapping)):
        raise TypeError(f"wandb must be False, True, None or a dict of wandb.init kwargs, got {setting!r}")
    if setting is False:
        return None
    import wandb  # imported here: sessions without W&B do not pay for importing it

    extra = dict(setting) if isinstance(setting, Mapping) else {}
    mode = extra.get("mode") or os.environ.get("WANDB_MODE")
    if mode is None:
        mode = "online" if wandb.login(prompt=False, verify=False) else "offline"
    if mode == "disabled":
        return None
    init_kwargs: dict[str, Any] = {"config": dict(config), "mode": mode, "reinit": "create_new"}
    # W&B's own environment variables (WANDB_PROJECT, WANDB_DIR, WANDB_ENTITY, WANDB_RUN_GROUP,
    # WANDB_TAGS, WANDB_NAME) are read by wandb.init for every argument not passed; workbench's defaults
    # apply only where neither the caller nor the environment says otherwise.
    if "WANDB_PROJECT" not in os.environ:
        init_kwargs["project"] = project
    if "WANDB_DIR" not in os.environ:
        directory.mkdir(parents=True, exist_ok=True)
        init_kwargs["dir"] = directory
    if run_id is not None:
        init_kwargs |= {"id": run_id, "resume": "allow"}
    return WandbSink(wandb.init(**(init_kwargs | extra)))
