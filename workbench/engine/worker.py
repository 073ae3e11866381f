"""The engine's single worker thread: every operation that touches model state runs here, in order.

One thread means no locks around the model, the adapters or the optimizers, and Tinker's ordering
guarantee for free: operations submitted back to back (`forward_backward`, `optim_step`, pinning a
sampler's weights) take effect in that order. Operations that can share a forward pass (sampling
requests) are submitted with a `batch_key`; adjacent queued operations with the same key run together
in one call.

The queue is a `queue.SimpleQueue`, whose `put` is safe to call from a garbage-collector finalizer at
any point of any thread (a `threading.Lock` is not): `post` uses it for work that has no caller to wait
for it, such as releasing the weights a collected sampling client had pinned.

Every future resolves: with the operation's result or exception, or with `SessionClosedError` for an
operation that was still queued when the worker stopped.

At interpreter exit every worker still running finishes its queued operations and stops before the
interpreter tears down (`_close_live_workers`). A daemon thread that is still inside torch then would be
killed when it next takes the GIL, by unwinding through C++ frames that must not unwind: the process
aborts ("terminate called without an active exception", exit code 134) after the script has succeeded.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from workbench.futures import APIFuture

T = TypeVar("T")

# How long a batchable operation waits for companions submitted right after it (concurrent sample calls).
BATCH_LINGER_S = 0.005


@dataclass
class _Job:
    future: concurrent.futures.Future[Any] | None  # None for posted work, which nobody waits for
    run: Callable[[], Any] | None = None
    batch_key: Hashable | None = None
    item: Any = None
    run_batch: Callable[[Sequence[Any]], Sequence[Any]] | None = None
    submitted_at: float = field(default_factory=time.perf_counter)


class SessionClosedError(RuntimeError):
    """Raised for operations submitted after `close()`, and by those still queued when it stopped them."""


_STOP = object()  # the sentinel that ends the loop


class Worker:
    """Runs submitted callables one at a time, in submission order, on a daemon thread."""

    def __init__(self, name: str = "workbench-worker", before_each: Callable[[], None] | None = None):
        """`before_each` runs on the worker thread before each operation (or batch of operations), e.g.
        to set the thread count the operation's torch kernels use."""
        self._before_each = before_each
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: list[_Job] = []  # jobs taken off the queue while looking for batch companions
        self._closed = False
        self._submitting = threading.Lock()  # orders submissions against close(): none lands after the stop
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _live_workers.add(self)

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, run: Callable[[], T]) -> APIFuture[T]:
        """Queue `run()`; its return value (or exception) resolves the returned future."""
        return self._put(_Job(concurrent.futures.Future(), run=run))

    def submit_batchable(
        self, batch_key: Hashable, item: Any, run_batch: Callable[[Sequence[Any]], Sequence[Any]]
    ) -> APIFuture[Any]:
        """Queue `item`; adjacent items with the same key are passed together to `run_batch`, which
        returns one result (or exception instance) per item, in order."""
        return self._put(
            _Job(concurrent.futures.Future(), batch_key=batch_key, item=item, run_batch=run_batch)
        )

    def post(self, run: Callable[[], None]) -> bool:
        """Queue `run()` with no future and without taking any lock: safe from finalizers. Returns
        whether it was queued: once the worker is closed it is dropped (there is nothing left for it to
        act on)."""
        if self._closed:
            return False
        self._queue.put(_Job(None, run=run))
        return True

    def _put(self, job: _Job) -> APIFuture[Any]:
        assert job.future is not None
        with self._submitting:
            if self._closed:
                raise SessionClosedError("this session is closed; create a new Session")
            self._queue.put(job)
        return APIFuture(job.future, self._thread)

    def close(self, wait: bool = True) -> None:
        """Let the queued operations finish, then stop the thread. Safe to call again, also after an
        interrupted call (it waits again)."""
        with self._submitting:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def fail_queued(self, error: BaseException) -> None:
        """Fail every operation still queued with `error`, from any thread (an engine whose other rank
        died: nothing queued can run); the operation running now ends as it will."""
        for job in self._take_queued():
            if job is _STOP:
                self._queue.put(_STOP)
            elif job.future is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(error)

    # ------------------------------------------------------------------------------------------ loop

    def _next(self, timeout: float | None = None) -> Any:
        if self._pending:
            return self._pending.pop(0)
        return self._queue.get(timeout=timeout)

    def _loop(self) -> None:
        job: Any = None
        while True:
            job = self._next()
            if job is _STOP:
                break
            if self._before_each is not None:
                with contextlib.suppress(Exception):  # a failed preparation must not stop the worker
                    self._before_each()
            if job.batch_key is None:
                self._run_single(job)
                job = None  # an idle worker holds no job (and nothing the job's closure holds)
                continue
            batch = [job]
            stop = False
            while True:
                try:
                    nxt = self._next(timeout=BATCH_LINGER_S)
                except queue.Empty:
                    break
                if nxt is not _STOP and nxt.batch_key == job.batch_key:
                    batch.append(nxt)
                    continue
                if nxt is _STOP:
                    stop = True
                else:
                    self._pending.insert(0, nxt)
                break
            self._run_batch(batch)
            job = batch = None
            if stop:
                break
        self._fail_leftovers()

    def _take_queued(self) -> list[Any]:
        """Every job still in the queue, taken out of it (from any thread)."""
        jobs: list[Any] = []
        while True:
            try:
                jobs.append(self._queue.get_nowait())
            except queue.Empty:
                return jobs

    def _fail_leftovers(self) -> None:
        """Resolve whatever is still queued after the stop: nothing submitted is left hanging."""
        leftovers = [*self._pending, *self._take_queued()]
        self._pending.clear()
        for job in leftovers:
            if job is not _STOP and job.future is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(
                    SessionClosedError("the session was closed before this operation ran")
                )

    @staticmethod
    def _run_single(job: _Job) -> None:
        assert job.run is not None
        if job.future is None:
            with contextlib.suppress(
                Exception
            ):  # posted work has nobody to report to; it must not stop the worker
                job.run()
            return
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            result = job.run()
        except BaseException as error:  # the caller sees every failure
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    @staticmethod
    def _run_batch(jobs: list[_Job]) -> None:
        live = [job for job in jobs if job.future is not None and job.future.set_running_or_notify_cancel()]
        if not live:
            return
        assert live[0].run_batch is not None
        try:
            results = live[0].run_batch([job.item for job in live])
        except BaseException as error:
            for job in live:
                assert job.future is not None
                job.future.set_exception(error)
            return
        for job, result in zip(live, results, strict=True):
            assert job.future is not None
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)


_live_workers: weakref.WeakSet[Worker] = weakref.WeakSet()
"""Every worker whose thread may still run (its thread holds it, so it stays here until the thread ends)."""


def _close_live_workers() -> None:
    """Let every live worker finish its queued operations and stop, before the interpreter tears down.

    Registered with `threading._register_atexit`, as `concurrent.futures` registers its own pools: these
    callbacks run when the main thread finishes, before the non-daemon threads are joined and before any
    `atexit` function (W&B finishes its runs in one of those), while every thread can still run normally.
    """
    for worker in list(_live_workers):
        worker.close()


# The stdlib's hook for exactly this (what concurrent.futures uses); it has no public spelling.
threading._register_atexit(_close_live_workers)  # noqa: SLF001
