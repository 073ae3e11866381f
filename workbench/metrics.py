"""The session's metrics history, and the sinks that forward it (JSONL, Weights & Biases).

Every operation appends one row: which op, on which model, at which optimizer step (the policy's step
count: the x-axis of every plot and of W&B), when, and its metrics. Sinks receive each row as it is
recorded; a sink that raises is reported with a warning and never breaks the operation.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Protocol


class Sink(Protocol):
    """Receives every history row (e.g. a JSONL file, a W&B run)."""

    def write(self, row: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


class MetricsHistory:
    """An append-only table of metric rows: `[{"step", "op", "model", "time", <metric>: value, ...}]`.

    `series(name)` gives one metric against the step; `to_pandas()` the whole table.
    """

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self.sinks: list[Sink] = []

    def record(self, op: str, model: str, step: int, metrics: Mapping[str, float]) -> dict[str, Any]:
        row: dict[str, Any] = {"step": step, "op": op, "model": model, "time": time.time()}
        row.update({key: float(value) for key, value in metrics.items()})
        self.rows.append(row)
        for sink in list(self.sinks):
            try:
                sink.write(row)
            except Exception as error:  # a broken sink must never break a training step
                warnings.warn(f"metrics sink {type(sink).__name__} failed: {error!r}", RuntimeWarning, stacklevel=2)
        return row

    def series(self, name: str, op: str | None = None) -> tuple[list[int], list[float]]:
        """Steps and values of one metric, optionally from one kind of op only."""
        steps: list[int] = []
        values: list[float] = []
        for row in self.rows:
            if name in row and (op is None or row["op"] == op):
                steps.append(row["step"])
                values.append(row[name])
        return steps, values

    def names(self) -> list[str]:
        """Every metric name recorded so far (excluding the row's own columns)."""
        seen: dict[str, None] = {}
        for row in self.rows:
            for key in row:
                if key not in ("step", "op", "model", "time"):
                    seen.setdefault(key)
        return list(seen)

    def last(self, name: str) -> float:
        for row in reversed(self.rows):
            if name in row:
                return row[name]
        return math.nan

    def to_pandas(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.rows)

    def __repr__(self) -> str:
        return f"MetricsHistory({len(self.rows)} rows, metrics={self.names()})"
