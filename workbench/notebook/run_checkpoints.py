"""Run checkpoints: a run saved every k steps, so that a new kernel continues it exactly.

A run checkpoint is a `save_state` checkpoint (the model's whole state: adapters, optimizer, counters,
weight versions, RNG states; atomic, with a manifest) named `run-<next step>`, whose `user_metadata`
carries the run's own state as one JSON string under `RUN_KEY`: the next step index, the optimizer
settings in use (live edits included), the pause triggers, the history and rollout-log positions, the
W&B run id and `run.loop_state`, the step function's own dict (a data cursor). The evaluation schedule
needs no saving: evaluations run at fixed step indices (`workbench.notebook.evaluation`), so a resumed run
evaluates where the uninterrupted one would. Both are in one folder written atomically,
so a checkpoint is complete or absent, never half a model and half a run.

Resuming (`Session.from_checkpoint(model_dir)`) takes the newest complete run checkpoint, restores the
model from it and rewinds the folder's logs to it: history rows recorded after the save stay in
`history.jsonl` marked `"discarded": true` (the steps they describe are trained again, so each step is
counted once), rollout batches after it are dropped (they are sampled again, identically). The step
function is then called from the saved step on.

Pruning keeps the newest `keep` run checkpoints and every one whose step is a multiple of `keep_every`;
it runs only after a save succeeded, so the newest complete checkpoint is never removed. A save that
fails leaves the previous checkpoints as they are (the store writes a temporary folder and renames it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from workbench.metrics import DISCARDED
from workbench.notebook.rollout_log import ROLLOUTS_FILE
from workbench.storage.checkpoint_store import CheckpointInfo, list_checkpoints

RUN_KEY = "workbench.run"
"""The `user_metadata` key of a state checkpoint that holds a run's own state."""
RUN_PREFIX = "run-"
HISTORY_FILE = "history.jsonl"
RECOMMENDED_SAVE_EVERY = 100
"""The cadence to start from: a run checkpoint of `tiny` holds its steps up for about 14 ms (the state's
capture; the write beside the steps takes the rest of its ~23 ms), one to two of its SFT steps (9-14 ms;
`bench/run_checkpoints.py`), so every 100 steps it costs under 5% of the run even on the smallest model, and a larger model's step grows faster than its adapter's save. `save_every` stays off
(None) unless asked for: saves write to disk. Seconds, not steps, are what a crash loses: a run of
10-second steps may want a smaller k."""


@dataclasses.dataclass(frozen=True)
class RunCheckpoint:
    """What a run saved besides the model: enough to call its step function from `next_step` on."""

    next_step: int  # the run step the resumed run starts with (steps 0 .. next_step - 1 are done)
    adam_params: dict[str, float]  # the settings the next step uses
    adam_params_from: int
    history_rows: int  # rows of history.jsonl that the saved state has seen, its own save row included
    rollout_batches: int  # batches of rollouts.jsonl recorded before the save
    wandb_run_id: str | None
    state: dict[str, Any]  # run.loop_state: the step function's own (JSON) state
    steps: int | None = None  # the steps the saving run was asked for (None: saved before it was recorded)
    pause_if: dict[str, tuple[str, float]] = dataclasses.field(default_factory=dict)  # run's PauseIf
    path: Path | None = None  # the checkpoint folder it was read from

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        del fields["path"]
        return json.dumps(fields)

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, str], path: Path | None = None) -> RunCheckpoint:
        fields = json.loads(metadata[RUN_KEY])
        fields["pause_if"] = {metric: tuple(rule) for metric, rule in fields.get("pause_if", {}).items()}
        return cls(**fields, path=path)


def checkpoint_name(next_step: int) -> str:
    return f"{RUN_PREFIX}{next_step:06d}"


def run_checkpoints(model_dir: Path) -> list[tuple[CheckpointInfo, RunCheckpoint]]:
    """The model folder's complete run checkpoints, oldest (lowest step) first."""
    found = [
        (info, RunCheckpoint.from_metadata(info.user_metadata, info.path))
        for info in list_checkpoints(model_dir)
        if info.kind == "state" and info.user_metadata and RUN_KEY in info.user_metadata
    ]
    return sorted(found, key=lambda pair: (pair[1].next_step, pair[0].time))


def newest_run_checkpoint(model_dir: Path) -> RunCheckpoint | None:
    """The newest complete run checkpoint of `model_dir`, None when it has none."""
    found = run_checkpoints(model_dir)
    return found[-1][1] if found else None


def stopped_run_note(model_dir: Path, resume_point: RunCheckpoint | None) -> str | None:
    """Where the folder's unfinished run stopped and how to continue it, for the panel's status bar; None
    when its newest run checkpoint ended its run (or it has none). `resume_point`: the session's own (made
    by `from_checkpoint(model_dir)`), whose next `run()` continues the run."""
    saved = resume_point or newest_run_checkpoint(model_dir)
    if saved is None or saved.steps is None or saved.next_step >= saved.steps:
        return None
    where = f"run stopped at step {saved.next_step} of {saved.steps}"
    if resume_point is not None:
        return f"{where}: sess.run(step_fn, {saved.steps}) continues it"
    return f"{where}: wb.Session.from_checkpoint({str(model_dir)!r}) resumes it"


def to_prune(model_dir: Path, keep: int, keep_every: int | None) -> list[str]:
    """The run checkpoints pruning removes: all but the newest `keep` and those at (positive) multiples
    of `keep_every`. The newest is always kept (`keep` is at least 1)."""
    found = run_checkpoints(model_dir)
    newest = {info.name for info, _ in found[-max(keep, 1) :]}
    return [
        info.name
        for info, saved in found
        if info.name not in newest
        and not (keep_every and saved.next_step and saved.next_step % keep_every == 0)
    ]


def rewind_logs(model_dir: Path, saved: RunCheckpoint) -> list[dict[str, Any]]:
    """Rewind the folder's history and rollout log to `saved`; returns the history's rows, those after
    the save marked discarded. Each file is replaced atomically (written aside, then renamed)."""
    history = model_dir / HISTORY_FILE
    rows: list[dict[str, Any]] = []
    if history.exists():
        with history.open(encoding="utf-8") as lines:
            rows = [json.loads(line) for line in lines if line.strip()]
        for row in rows[saved.history_rows :]:
            row[DISCARDED] = True
        write_text_atomically(history, "".join(json.dumps(row) + "\n" for row in rows))
    rollouts = model_dir / ROLLOUTS_FILE
    if rollouts.exists():
        with rollouts.open(encoding="utf-8") as lines:
            kept = [
                line for line in lines if line.strip() and json.loads(line)["batch"] < saved.rollout_batches
            ]
        write_text_atomically(rollouts, "".join(kept))
    return rows


def discard_history(model_dir: Path) -> int:
    """Mark every row of the folder's history discarded (a new model starts over in the folder: the
    earlier rows describe weights it does not have); returns how many rows the file holds."""
    history = model_dir / HISTORY_FILE
    if not history.exists():
        return 0
    with history.open(encoding="utf-8") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    if any(not row.get(DISCARDED) for row in rows):
        write_text_atomically(history, "".join(json.dumps({**row, DISCARDED: True}) + "\n" for row in rows))
    return len(rows)


def write_text_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`: written aside, flushed to disk, then renamed over it, so a reader finds
    the old file or the new one, never a part."""
    aside = path.with_name(f".{path.name}.partial")
    with open(aside, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(aside, path)
