"""`APIFuture`: the handle every Session operation returns, as the Tinker SDK's futures behave.

`.result(timeout)` blocks, `await fut` and `await fut.result_async()` suspend, `.future()` gives the
underlying `concurrent.futures.Future`. A KeyboardInterrupt while waiting only stops the wait: the
operation itself runs to completion on the session's worker thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Generator
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class APIFuture(Generic[T]):
    """A pending result. Awaitable, and blocking through `.result()`."""

    def __init__(self, future: concurrent.futures.Future[T]):
        self._future = future

    def result(self, timeout: float | None = None) -> T:
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        return await asyncio.wait_for(asyncio.wrap_future(self._future), timeout)

    def __await__(self) -> Generator[Any, None, T]:
        return asyncio.wrap_future(self._future).__await__()

    def done(self) -> bool:
        return self._future.done()

    def future(self) -> concurrent.futures.Future[T]:
        return self._future

    def __repr__(self) -> str:
        state = "done" if self._future.done() else "pending"
        return f"<APIFuture {state}>"


def completed(value: T) -> APIFuture[T]:
    """An `APIFuture` that already holds `value` (for operations that need no worker time)."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()
    future.set_result(value)
    return APIFuture(future)
