"""Every rollout a run recorded, by batch: in memory for the live views and in `rollouts.jsonl`.

`Session.record_rollouts(groups)` appends one batch (usually one RL step's groups); the rollout explorer
reads batches from here. The file is one JSON object per group, flushed per batch, carrying its batch
number, so a run can be explored after the kernel is gone: `RolloutLog.load(model_dir)`. A resumed
session appends to the same file and numbers its batches after the ones already there.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from workbench.loops.rollout_groups import RolloutGroup

ROLLOUTS_FILE = "rollouts.jsonl"


def _read(path: Path) -> list[list[RolloutGroup]]:
    batches: dict[int, list[RolloutGroup]] = {}
    with path.open(encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                batches.setdefault(int(record["batch"]), []).append(RolloutGroup.from_json(record))
    return [batches[k] for k in sorted(batches)]


class RolloutLog:
    """The recorded batches of rollout groups, oldest first; `log[k]` is batch k."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self.batches: list[list[RolloutGroup]] = _read(path) if path is not None and path.exists() else []

    @classmethod
    def load(cls, model_dir: str | Path) -> RolloutLog:
        """The rollouts of the run whose folder is `model_dir` (read only: nothing is appended to it)."""
        path = Path(model_dir) / ROLLOUTS_FILE
        if not path.exists():
            raise FileNotFoundError(f"{path} does not exist: the run recorded no rollouts")
        log = cls()
        log.batches = _read(path)
        return log

    def append(self, groups: Sequence[RolloutGroup]) -> int:
        """Add one batch (written to the file first, so memory never holds what the file lacks);
        returns its number."""
        batch = len(self.batches)
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as file:
                for group in groups:
                    file.write(json.dumps({"batch": batch, **group.to_json()}) + "\n")
        self.batches.append(list(groups))
        return batch

    def __getitem__(self, batch: int) -> list[RolloutGroup]:
        return self.batches[batch]

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[RolloutGroup]]:
        return iter(self.batches)

    def __repr__(self) -> str:
        return f"RolloutLog({len(self.batches)} batches, path={str(self.path) if self.path else None!r})"
