"""The session's single worker thread: every operation that touches model state runs here, in order.

One thread means no locks around the model, the adapters or the optimizers, and Tinker's ordering
guarantee for free: `forward_backward` then `optim_step` submitted back to back run in that order.
Operations that can share a forward pass (sampling requests for the same weights) are submitted with a
`batch_key`; adjacent queued operations with the same key run together in one call.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workbench.futures import APIFuture

T = TypeVar("T")

# How long a batchable operation waits for companions submitted right after it (concurrent sample calls).
BATCH_LINGER_S = 0.005


@dataclass
class _Job:
    future: concurrent.futures.Future[Any]
    run: Callable[[], Any] | None = None
    batch_key: Hashable | None = None
    item: Any = None
    run_batch: Callable[[Sequence[Any]], Sequence[Any]] | None = None
    submitted_at: float = field(default_factory=time.perf_counter)


class SessionClosedError(RuntimeError):
    """Raised for operations submitted after `Session.close()`."""


class Worker:
    """Runs submitted callables one at a time, in submission order, on a daemon thread."""

    def __init__(self, name: str = "workbench-worker"):
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._pending: list[_Job] = []  # jobs taken off the queue while looking for batch companions
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def submit(self, run: Callable[[], T]) -> APIFuture[T]:
        """Queue `run()`; its return value (or exception) resolves the returned future."""
        return self._put(_Job(concurrent.futures.Future(), run=run))

    def submit_batchable(
        self, batch_key: Hashable, item: Any, run_batch: Callable[[Sequence[Any]], Sequence[Any]]
    ) -> APIFuture[Any]:
        """Queue `item`; adjacent items with the same key are passed together to `run_batch`, which
        returns one result per item, in order."""
        return self._put(_Job(concurrent.futures.Future(), batch_key=batch_key, item=item, run_batch=run_batch))

    def _put(self, job: _Job) -> APIFuture[Any]:
        if self._closed:
            raise SessionClosedError("this session is closed; create a new Session")
        self._queue.put(job)
        return APIFuture(job.future)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued operations, then stop the thread."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _next(self, block: bool, timeout: float | None = None) -> _Job | None:
        if self._pending:
            return self._pending.pop(0)
        return self._queue.get(block=block, timeout=timeout)

    def _loop(self) -> None:
        while True:
            job = self._next(block=True)
            if job is None:
                return
            if job.batch_key is None:
                self._run_single(job)
                continue
            batch = [job]
            stop = False
            while True:
                try:
                    nxt = self._next(block=True, timeout=BATCH_LINGER_S)
                except queue.Empty:
                    break
                if nxt is not None and nxt.batch_key == job.batch_key:
                    batch.append(nxt)
                    continue
                if nxt is None:
                    stop = True
                else:
                    self._pending.insert(0, nxt)
                break
            self._run_batch(batch)
            if stop:
                return

    @staticmethod
    def _run_single(job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        assert job.run is not None
        try:
            result = job.run()
        except BaseException as error:  # the caller sees every failure, including KeyboardInterrupt
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    @staticmethod
    def _run_batch(jobs: list[_Job]) -> None:
        live = [job for job in jobs if job.future.set_running_or_notify_cancel()]
        if not live:
            return
        assert live[0].run_batch is not None
        try:
            results = live[0].run_batch([job.item for job in live])
        except BaseException as error:
            for job in live:
                job.future.set_exception(error)
            return
        for job, result in zip(live, results, strict=True):
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)
