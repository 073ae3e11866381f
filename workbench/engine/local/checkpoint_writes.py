"""Checkpoint writes beside the worker: a save captures the model's state on the worker thread (its files'
bytes, a copy), then writes, fsyncs and renames them on a thread of its own, so that the operations queued
after it (the next training step) do not wait for the disk.

At most one write is in flight: a save waits for the one before it, so saves land in the order they
were asked. An operation that reads or changes checkpoint folders (a load, a deletion, a cleanup, a
sampler checkpoint, a model made from a checkpoint) waits for the write first, as if it ran on the
worker; only those that touch memory alone (forward and backward passes, optimizer steps, sampling, a
history row) run beside it (`EngineState.submit(..., beside_writes=True)`). The save's future resolves
once its files are on disk, or with the write's error: a failed write leaves the folder's earlier
checkpoints as they were (`workbench.storage.checkpoint_store.write_atomically`). Closing the engine
waits for the write in flight; its thread is not a daemon, so the interpreter's exit waits for it too.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class CheckpointWrites:
    """The checkpoint write in flight (at most one). `start` and `wait` are called on the worker thread, and
    `wait` again by `close` once the worker has stopped."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def start(self, write: Callable[[], None]) -> None:
        """Run `write` on a thread of its own once the write before it has finished. `write` reports its
        own outcome (it resolves its save's future) and must not raise."""
        self.wait()
        thread = threading.Thread(target=write, name="workbench-checkpoint-write")
        try:
            thread.start()
        except RuntimeError:  # no new threads at the interpreter's very end: write in this one
            write()
            return
        self._thread = thread

    def wait(self) -> None:
        """Return once no write is in flight."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
