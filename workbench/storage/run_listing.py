"""Every model folder under the models root, as the runs view lists it: read from the files, no model
loaded.

A row (`RunEntry`) is what the folder says: `run.json` (the base model, the LoRA config, when it was
made), `settings.json` (the AdamParams and loss it trained with), `notes.json` (the user's notes and
tags: `workbench.storage.run_description`) and `history.jsonl`, summarized into each metric's last,
least and greatest value (`workbench.metrics.summarize`) and the last optimizer step.

`RunListing.scan()` is cheap to call again: a folder whose files did not change is not read again, and a
history that grew (a live run's) is read from where the last scan stopped, complete lines only. A
history that shrank (a run rewound it) is read afresh.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workbench.metrics import MetricSummary, summarize
from workbench.storage.checkpoint_store import CheckpointError
from workbench.storage.model_folders import MODEL_INFO, model_folders, read_model_info
from workbench.storage.run_description import NOTES_FILE, SETTINGS_FILE, read_notes, read_settings

HISTORY_FILE = "history.jsonl"


@dataclass(frozen=True)
class RunEntry:
    """One model folder, as listed."""

    model_id: str
    folder: Path
    base_model: str
    created_at: float
    lora: dict[str, Any]
    settings: dict[str, dict[str, Any]]
    """`{role: {"adam_params": {...}, "loss": {"loss_fn": ..., "loss_fn_config": {...}}}}`."""
    notes: str
    tags: list[str]
    last_step: int
    """The greatest optimizer step in its history (0 for none)."""
    metrics: dict[str, MetricSummary]

    def metric(self, name: str) -> MetricSummary:
        return self.metrics.get(name, MetricSummary())

    @property
    def learning_rate(self) -> float:
        """The policy's last learning rate (NaN when it never stepped)."""
        adam = self.settings.get("policy", {}).get("adam_params", {})
        rate = adam.get("learning_rate")
        return float(rate) if isinstance(rate, int | float) else math.nan

    @property
    def loss_fn(self) -> str:
        """The policy's last loss (or the critic's, for a critic-only run), "" when it never trained."""
        for role in ("policy", "critic"):
            loss = self.settings.get(role, {}).get("loss", {})
            if isinstance(loss.get("loss_fn"), str):
                return loss["loss_fn"]
        return ""

    def matches(self, text: str) -> bool:
        """Whether every word of `text` is in its id, base model, loss, tags or notes (case-insensitive)."""
        haystack = " ".join([self.model_id, self.base_model, self.loss_fn, *self.tags, self.notes]).lower()
        return all(word in haystack for word in text.lower().split())


@dataclass
class _HistoryRead:
    """How far a folder's history was read, and the summaries so far."""

    size: int = 0
    inode: int = -1
    last_step: int = 0
    metrics: dict[str, MetricSummary] = field(default_factory=dict)


def _signature(folder: Path) -> tuple[tuple[int, int], ...]:
    """What changes when the folder's description files do (mtime and size of each)."""
    stamps = []
    for name in (MODEL_INFO, SETTINGS_FILE, NOTES_FILE):
        try:
            stat = (folder / name).stat()
            stamps.append((stat.st_mtime_ns, stat.st_size))
        except OSError:
            stamps.append((0, -1))
    return tuple(stamps)


class RunListing:
    """The model folders under the models root (and `known` ones elsewhere), rescanned on `scan()`."""

    def __init__(self, known: Mapping[str, Path] | None = None) -> None:
        self.known = dict(known or {})
        self._described: dict[Path, tuple[tuple[tuple[int, int], ...], dict[str, Any]]] = {}
        self._histories: dict[Path, _HistoryRead] = {}

    def scan(self) -> list[RunEntry]:
        """Every model folder, newest first."""
        entries = []
        for model_id, folder in model_folders(self.known).items():
            entry = self._entry(model_id, folder)
            if entry is not None:
                entries.append(entry)
        return sorted(entries, key=lambda entry: entry.created_at, reverse=True)

    def _entry(self, model_id: str, folder: Path) -> RunEntry | None:
        signature = _signature(folder)
        cached = self._described.get(folder)
        if cached is None or cached[0] != signature:
            try:
                info = read_model_info(folder)
            except CheckpointError:
                info = None
            if info is None:
                return None
            notes, tags = read_notes(folder)
            described = {"info": info, "settings": read_settings(folder), "notes": notes, "tags": tags}
            self._described[folder] = (signature, described)
        else:
            described = cached[1]
        info = described["info"]
        history = self._read_history(folder)
        created_at = info.get("created_at")
        return RunEntry(
            model_id=model_id,
            folder=folder,
            base_model=str(info.get("base_model", "")),
            created_at=float(created_at) if isinstance(created_at, int | float) else 0.0,
            lora=dict(info.get("lora") or {}),
            settings=described["settings"],
            notes=described["notes"],
            tags=described["tags"],
            last_step=history.last_step,
            metrics=dict(history.metrics),
        )

    def _read_history(self, folder: Path) -> _HistoryRead:
        path = folder / HISTORY_FILE
        read = self._histories.setdefault(folder, _HistoryRead())
        try:
            stat = path.stat()
        except OSError:
            self._histories[folder] = _HistoryRead()
            return self._histories[folder]
        if stat.st_ino != read.inode or stat.st_size < read.size:  # replaced or rewound: afresh
            read = self._histories[folder] = _HistoryRead(inode=stat.st_ino)
        if stat.st_size == read.size:
            return read
        with path.open("rb") as handle:
            handle.seek(read.size)
            chunk = handle.read(stat.st_size - read.size)
        complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written is read next time
        rows = []
        for line in complete.splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError:
                    continue  # a torn line (a crash mid-write) is skipped, as pandas would fail on it
        summarize(rows, into=read.metrics)
        steps = [row["step"] for row in rows if isinstance(row.get("step"), int)]
        read.last_step = max([read.last_step, *steps])
        read.size += len(complete)
        return read
