"""`APIFuture`: the handle every operation returns, as the Tinker SDK's futures behave.

`.result(timeout)` blocks, `await fut` and `await fut.result_async()` suspend, `.future()` gives the
underlying `concurrent.futures.Future`, `.coroutine()` a coroutine for `asyncio.gather`. A
KeyboardInterrupt while waiting only stops the wait: the operation itself runs to completion on the
engine's worker thread (or, if it has not started, can be withdrawn with `wait_or_withdraw`).

Waiting on the worker thread for an operation queued behind the one running there would wait forever
(the worker runs one operation at a time): `result()` refuses it with `ReentrantWaitError` instead.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")
U = TypeVar("U")


class ReentrantWaitError(RuntimeError):
    """Raised when code running on the worker thread (a custom loss, a step function called there)
    waits for an operation that the same worker has yet to run."""


class APIFuture(Generic[T]):
    """A pending result. Awaitable, and blocking through `.result()`.

    Args:
        future: The result's `concurrent.futures.Future`.
        worker: The thread that resolves it; waiting on that thread for an unresolved result raises
            `ReentrantWaitError` rather than deadlocking. None when no single thread resolves it.
    """

    def __init__(self, future: concurrent.futures.Future[T], worker: threading.Thread | None = None):
        self._future = future
        self._worker = worker

    def result(self, timeout: float | None = None) -> T:
        if not self._future.done() and threading.current_thread() is self._worker:
            raise ReentrantWaitError(
                "waiting for an operation from inside another operation (a custom loss, or code the worker "
                "runs) would wait forever: the worker runs one operation at a time. Compute what you need "
                "before the call, or from the logprobs the custom loss is given."
            )
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()

    async def coroutine(self) -> T:
        """This future as a coroutine, for APIs that take one rather than an awaitable
        (`asyncio.create_task`); awaiting it awaits the future."""
        return await self.result_async()

    def done(self) -> bool:
        return self._future.done()

    @property
    def worker(self) -> threading.Thread | None:
        """The thread that resolves this future (None when no single thread does)."""
        return self._worker

    def then(self, convert: Callable[[T], U]) -> APIFuture[U]:
        """A future of `convert(result)`, resolved when this one is (with its exception, if it fails)."""
        out: concurrent.futures.Future[U] = concurrent.futures.Future()
        # A finished future keeps its callbacks; the callback lets go of `convert` and `out` once it has
        # run, so a result that holds this future (a client holding its pin) is not kept in a cycle.
        pending = [(convert, out)]

        def done(inner: concurrent.futures.Future[T]) -> None:
            function, target = pending.pop()
            try:
                target.set_result(function(inner.result()))
            except BaseException as error:
                target.set_exception(error)

        self._future.add_done_callback(done)
        return APIFuture(out, self._worker)

    def future(self) -> concurrent.futures.Future[T]:
        return self._future

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<APIFuture {state}>"


def wait_or_withdraw(future: APIFuture[T]) -> T:
    """Wait for an operation; on KeyboardInterrupt withdraw it if it has not started, else let it finish.

    Either way the interrupted call leaves the engine as if it had never been made or as if it had run
    whole, never in between, and the KeyboardInterrupt is raised again.
    """
    try:
        return future.result()
    except KeyboardInterrupt:
        if not future.future().cancel():
            concurrent.futures.wait([future.future()])
        raise
