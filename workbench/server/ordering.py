"""Tinker's ordering and retry rules: a model's requests run in `seq_id` order, whatever order they
arrive in, and a request sent again gets the future it got the first time.

Each TrainingClient numbers its requests 1, 2, 3, ... (`seq_id`) and expects the server to execute them
in that order; it may send several at once (the chunks of one `forward_backward` go out together, the
first one last), and it re-sends a request whose response it did not get. So, per model:

* a request is handed to the engine only when every lower `seq_id` has been: early arrivals wait here
  (`waiting`), and the engine's worker runs them in the order they are handed over, which is therefore
  the seq order;
* a request whose `seq_id` was already taken, with the same content (same digest), is a retry and gets
  the same request id; with different content it is refused with 409, and nothing changes.

* a request refused before it was taken (its body not valid, too large) still uses its seq_id
  (`consume`): the client counted it, and the next one must not wait for it;
* a seq_id more than `RETRY_WINDOW` ahead of the next one is refused, so that nobody can park an
  unbounded number of requests.

Sampling requests use the same retry rule, without the ordering (each sample is independent).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

from workbench.server.errors import RequestError
from workbench.server.future_table import PendingResult

# How many past seq_ids per model are remembered for retries.
RETRY_WINDOW = 4096


def digest_of(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()


@dataclass
class _Taken:
    digest: str
    request_id: str


@dataclass
class _Stream:
    """One model's (or one sampler's) requests."""

    next_seq: int = 1
    waiting: dict[int, Callable[[], None]] = field(default_factory=dict)
    taken: dict[int, _Taken] = field(default_factory=dict)


class Sequencer:
    """Hands requests over in seq order, per stream (a model id or a sampling session id)."""

    def __init__(self) -> None:
        self._streams: dict[str, _Stream] = {}

    def take(
        self,
        stream: str,
        seq_id: int,
        payload: bytes,
        new_entry: Callable[[], PendingResult],
        start: Callable[[PendingResult], None],
        ordered: bool = True,
    ) -> str:
        """The request id for request `seq_id` of `stream`: a retry's earlier one, or that of a new entry
        whose `start` runs once every lower seq_id has started (at once when not `ordered`). `start` must
        not raise: it resolves the entry with any failure."""
        lowest = 1 if ordered else 0  # a TrainingClient counts from 1, a SamplingClient from 0
        if isinstance(seq_id, bool) or not isinstance(seq_id, int) or seq_id < lowest:
            raise RequestError(f"seq_id must be an integer >= {lowest}, got {seq_id!r}")
        state = self._streams.setdefault(stream, _Stream())
        digest = digest_of(payload)
        earlier = state.taken.get(seq_id)
        if earlier is not None:
            if earlier.digest != digest:
                raise RequestError(
                    f"seq_id {seq_id} of {stream!r} was already used by a different request; "
                    "a retry must repeat the same request",
                    409,
                )
            return earlier.request_id
        if ordered and seq_id < state.next_seq:
            raise RequestError(f"seq_id {seq_id} of {stream!r} is older than the requests kept for retries")
        if ordered and seq_id >= state.next_seq + RETRY_WINDOW:
            raise RequestError(
                f"seq_id {seq_id} of {stream!r} is more than {RETRY_WINDOW} ahead of the next one the "
                f"server expects ({state.next_seq})"
            )
        entry = new_entry()
        state.taken[seq_id] = _Taken(digest, entry.request_id)
        for old in [s for s in state.taken if s < seq_id - RETRY_WINDOW]:
            del state.taken[old]
        while len(state.taken) > RETRY_WINDOW:  # seq_ids sent out of any order: the oldest taken go
            del state.taken[next(iter(state.taken))]
        if not ordered:
            start(entry)
            return entry.request_id
        state.waiting[seq_id] = lambda: start(entry)
        while state.next_seq in state.waiting:
            state.waiting.pop(state.next_seq)()
            state.next_seq += 1
        return entry.request_id

    def consume(
        self,
        stream: str,
        seq_id: int,
        payload: bytes,
        new_entry: Callable[[], PendingResult],
        fail: Callable[[PendingResult], None],
    ) -> None:
        """Take a refused request's seq_id with an operation that fails (`fail`), so that the stream's
        later requests do not wait for it: the client counted it. A seq_id already taken, or one the
        stream could not take, is left as it is."""
        with contextlib.suppress(RequestError):
            self.take(stream, seq_id, payload, new_entry, fail)

    def waiting_for(self, stream: str) -> list[int]:
        """The seq_ids of `stream` that arrived before a lower one, still held back."""
        state = self._streams.get(stream)
        return sorted(state.waiting) if state is not None else []

    def forget(self, stream: str) -> list[Callable[[], None]]:
        """Drop a stream (its model or sampler is gone); returns the starts still waiting, for the caller
        to run (they fail, the model being gone)."""
        state = self._streams.pop(stream, None)
        return list(state.waiting.values()) if state is not None else []
