"""What a sampler recorded about the sequences it sampled with `record_stability_info=True`.

Tinker's `stable_reinforce` trains on information captured at sampling time, referenced from training
data by `SampledSequence.sequence_id`: "Recorded sequences belong to the session that sampled them, and
can be trained on for one day after sampling. Each training request that uses a sequence restarts that
day." Here the session is the engine; each record keeps the request's prompt, the sampled tokens, the
logprob the sampler computed for each, and the weights that sampled them.

Records are written on the worker thread (by the sampling operation) and read in callers' threads (a
training call's validation, before anything is queued), so the store has its own lock.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

RECORD_LIFETIME_S = 24 * 60 * 60
"""A record lives one day after its sampling or its latest use in a training call."""


@dataclass(frozen=True)
class StabilityRecord:
    """One sampled sequence as its sampler saw it."""

    prompt_tokens: tuple[int, ...]
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]  # the sampler's logprob of each sampled token
    model_id: str | None  # the run whose policy sampled it (None: the base model or a sampler checkpoint)
    weights_version: int | None


class UnknownSequenceError(ValueError):
    """A training call names a sequence the engine holds no record of: never sampled with
    `record_stability_info=True` on this engine, or expired."""

    def __init__(self, sequence_id: str, others: int):
        self.sequence_id = sequence_id
        super().__init__(
            f"no sampling record for sequence {sequence_id!r}"
            + (f" (nor for {others} more)" if others else "")
            + ": sample with record_stability_info=True on this engine; a record expires one day after its "
            "sampling or its last use in a training call"
        )


class StabilityRecords:
    """Records by sequence id, each expiring `RECORD_LIFETIME_S` after it was last written or used."""

    def __init__(self) -> None:
        # id -> (record, expires at), in order of expiry: a write or a use moves the record to the end
        self._records: dict[str, tuple[StabilityRecord, float]] = {}
        self._lock = threading.Lock()

    def add(self, sequence_id: str, record: StabilityRecord) -> None:
        now = time.time()
        with self._lock:
            self._drop_expired(now)
            self._records.pop(sequence_id, None)
            self._records[sequence_id] = (record, now + RECORD_LIFETIME_S)

    def use(self, sequence_ids: set[str]) -> dict[str, StabilityRecord]:
        """The records of these sequences, each one's day restarted; raises `UnknownSequenceError`
        naming the first id without a live record (and then restarts none)."""
        now = time.time()
        with self._lock:
            self._drop_expired(now)
            missing = sorted(sequence_id for sequence_id in sequence_ids if sequence_id not in self._records)
            if missing:
                raise UnknownSequenceError(missing[0], len(missing) - 1)
            found = {}
            for sequence_id in sorted(sequence_ids):
                record, _ = self._records.pop(sequence_id)
                self._records[sequence_id] = (record, now + RECORD_LIFETIME_S)
                found[sequence_id] = record
            return found

    def __len__(self) -> int:
        with self._lock:
            self._drop_expired(time.time())
            return len(self._records)

    def _drop_expired(self, now: float) -> None:
        """Drop expired records from the front (the soonest to expire): costs only what it drops."""
        while self._records:
            oldest = next(iter(self._records))
            if self._records[oldest][1] > now:
                return
            del self._records[oldest]
