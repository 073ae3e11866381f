"""The server's futures: every operation a client submits gets a request id at once, and its result
is fetched later with `retrieve_future`, as Tinker's protocol works.

A `PendingResult` is created on the server's event loop when the request is taken, and resolved there
(`call_soon_threadsafe`) when the engine's future completes on the worker thread, with the result or
the exception. `retrieve_future` long-polls: it waits on the entry's event up to the poll window, then
answers `try_again` and the SDK polls again at once. A finished entry is kept for a while after it is
fetched (a client that lost the response fetches it again) and then dropped, so results do not pile up
over a long run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# How long a finished result stays retrievable: an hour for one nobody has fetched yet, a minute once
# fetched (a client whose response was lost on the way polls again at once).
KEEP_FINISHED_S = 3600.0
KEEP_RETRIEVED_S = 60.0


@dataclass
class PendingResult:
    """One submitted operation, as the future table holds it."""

    request_id: str
    op: str  # the endpoint's operation: "forward_backward", "sample", ...
    model_id: str | None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: Any = None
    error: BaseException | None = None
    submitted_at: float = field(default_factory=time.monotonic)
    finished_at: float | None = None
    retrieved_at: float | None = None  # when a client last fetched the finished result

    def finish(self, result: Any = None, error: BaseException | None = None) -> None:
        """Resolve the entry (event loop thread); a second call changes nothing."""
        if self.done.is_set():
            return
        self.result, self.error = result, error
        self.finished_at = time.monotonic()
        self.done.set()


class FutureTable:
    """Request id -> `PendingResult`, owned by the server's event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._entries: dict[str, PendingResult] = {}
        self.on_finish: Callable[[PendingResult], None] | None = None  # the server's op log

    def add(self, op: str, model_id: str | None) -> PendingResult:
        entry = PendingResult(request_id=secrets.token_hex(12), op=op, model_id=model_id)
        self._entries[entry.request_id] = entry
        return entry

    def get(self, request_id: str) -> PendingResult | None:
        return self._entries.get(request_id)

    def fail(self, entry: PendingResult, error: BaseException) -> None:
        entry.finish(error=error)
        self._finished(entry)

    def resolve_with(
        self,
        entry: PendingResult,
        future: concurrent.futures.Future[Any],
        convert: Callable[[Any], Any] = lambda result: result,
    ) -> None:
        """Resolve `entry` when `future` (an engine future, resolved on the worker thread) completes,
        with `convert(result)` (run on the event loop) or the exception."""

        def on_loop(done: concurrent.futures.Future[Any]) -> None:
            try:
                entry.finish(result=convert(done.result()))
            except BaseException as error:  # the client sees every failure, a cancelled op's included
                entry.finish(error=error)
            self._finished(entry)

        def on_worker(done: concurrent.futures.Future[Any]) -> None:
            with contextlib.suppress(RuntimeError):  # the loop has stopped: nobody is left to tell
                self._loop.call_soon_threadsafe(on_loop, done)

        future.add_done_callback(on_worker)

    def _finished(self, entry: PendingResult) -> None:
        if self.on_finish is not None:
            self.on_finish(entry)

    async def wait(self, entry: PendingResult, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the entry; True once it is finished."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(entry.done.wait(), timeout)
        return entry.done.is_set()

    def sweep(self, now: float | None = None) -> None:
        """Drop results fetched more than `KEEP_RETRIEVED_S` ago, and unfetched ones that finished more
        than `KEEP_FINISHED_S` ago."""
        now = time.monotonic() if now is None else now
        for request_id, entry in list(self._entries.items()):
            fetched = entry.retrieved_at is not None and now - entry.retrieved_at > KEEP_RETRIEVED_S
            if fetched or (entry.finished_at is not None and now - entry.finished_at > KEEP_FINISHED_S):
                del self._entries[request_id]

    def __len__(self) -> int:
        return len(self._entries)
