"""Asynchronous runs: batches for the next steps are sampled while the current step trains, up to
`max_steps_off_policy` optimizer steps ahead (`Session.run_async`).

A synchronous RL step samples, waits for every reward, then trains: the engine idles while a grader,
a tool or the user's reward Python answers, and the sampler idles while the trainer trains. Here a
launcher thread starts `sample_fn(sess, sampling_client, j)` for batches j = 0, 1, … in order, each on
a worker of a pool of k + 1 threads (k = `max_steps_off_policy`), and the run thread (a
`workbench.notebook.run.Run`, with its Pause, Step, Stop, `set(learning_rate=...)` and `pause_if`)
calls `train_fn(sess, i, batch)` on them in index order, then publishes the new weights to the
sampler: an inflight save (`kind="inflight"`, the default: clients already sampling follow it) or a
new snapshot client. Up to k + 1 batches' `sample_fn` run at once, so batch j + 1 samples on the engine
while batch j's rewards run in Python and while earlier batches train; one `sample_fn` per batch
(sampling, then rewards) would leave the engine idle during every reward.

**Interleaved requests.** With k ≥ 1 several batches' sampling requests interleave on the engine's
queue in an order set by thread timing, so a request without an explicit `SamplingParams.seed` draws
from the engine's generator at a timing-dependent point: give each request a seed (from j and the
group) for reproducible draws. With k = 0 one batch is in flight at a time and the order is fixed.

**The staleness bound.** Batch j may start sampling once batch j − 1 has started and j − k batches
have been trained, so with one optimizer step per run step it samples weights at most k steps older
than the step that trains it. Its sampling version is the weights version published when it started
(an inflight client's requests can only run on that version or newer, so this bounds theirs); a group
that reports its own version (a `RolloutGroup` built from a `SampleResponse`) is counted by it.
**Rule:** at training time, a batch whose oldest group was sampled more than k optimizer steps before
the policy's current version (possible when `train_fn` takes several optimizer steps) is dropped whole,
counted in `async/dropped`, and the step trains the next batch. With k = 0 every batch is sampled
after the previous step's weights are published, so the run does what the synchronous loop `sample,
then train` does, operation for operation, and is bit-exact with it (seeded, CPU).

Each step's row (op `"run_step"`) adds to `train_fn`'s metrics `async/staleness:max` and `:mean` (policy
version minus each trained group's sampling version), `async/trainer_wait_s` (how long the trainer
waited for the batch), `async/sample_wait_s` (how long the sampled batch waited for the trainer), and
`async/dropped` (batches dropped before this one); `pause_if` reads them like any metric.

**Stop** drains: every batch being sampled is let finish (a user's `sample_fn` cannot be interrupted
safely mid-call), and they and every sampled batch not yet trained are discarded; `run.discarded`
counts them and the run prints how many of each (`stop_note`).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from workbench.loops.rollout_groups import RolloutGroup
from workbench.notebook.run import Run, RunState, check_no_active_run, check_no_active_sweep
from workbench.notebook.triggers import PauseIf
from workbench.sdk_conversion import to_adam_params
from workbench.types import AdamParams

if TYPE_CHECKING:
    from workbench.notebook.session import Session
    from workbench.tinker_api.clients import SamplingClient

SampleFn = Callable[["Session", "SamplingClient", int], Any]
"""`sample_fn(sess, sampling_client, j) -> batch`: sample (and reward) batch j on a sampler worker thread."""

TrainFn = Callable[["Session", int, Any], Mapping[str, float] | None]
"""`train_fn(sess, i, batch) -> metrics`: train step i on a batch; reads `sess.current_run.adam_params`."""

SAMPLER_POLL_S = 0.5  # how often a waiting launcher thread looks whether its session was closed


@dataclasses.dataclass
class SampledBatch:
    """What `sample_fn` returned for batch `index`, the weights version published when it started, and
    when it was ready."""

    index: int
    batch: Any
    version: int
    ready_at: float

    def group_versions(self) -> list[int]:
        """Each group's sampling version: its own where it reports one, else the batch's."""
        groups = self.batch if isinstance(self.batch, list) else [self.batch]
        versions = [
            group.weights_version
            for group in groups
            if isinstance(group, RolloutGroup) and group.weights_version is not None
        ]
        return versions or [self.version]


class AsyncRun(Run):
    """A `Run` whose steps train batches its sampler threads sample ahead (see the module docstring).
    Adds `max_steps_off_policy`, `inflight`, `discarded` and `stop_note`."""

    def __init__(
        self,
        session: Session,
        sample_fn: SampleFn,
        train_fn: TrainFn,
        steps: int,
        adam_params: AdamParams,
        *,
        max_steps_off_policy: int,
        inflight: bool,
        paused: bool = False,
        pause_if: PauseIf | None = None,
    ) -> None:
        if not callable(sample_fn) or not callable(train_fn):
            raise TypeError(
                "sample_fn(sess, sampling_client, j) and train_fn(sess, i, batch) must be functions"
            )
        if (
            isinstance(max_steps_off_policy, bool)
            or not isinstance(max_steps_off_policy, int)
            or max_steps_off_policy < 0
        ):
            raise ValueError(f"max_steps_off_policy must be an integer >= 0, got {max_steps_off_policy!r}")
        super().__init__(session, self._step, steps, adam_params, paused=paused, pause_if=pause_if)
        self.sample_fn, self.train_fn = sample_fn, train_fn
        self.max_steps_off_policy = max_steps_off_policy
        self.inflight = inflight
        self.discarded = 0
        """Batches sampled and never trained: dropped as too stale, or left when the run ended."""
        self.stop_note: str | None = None
        self._dropped = 0
        self._trained_batches = 0  # batches the trainer is done with (trained or dropped)
        self._ready: dict[int, SampledBatch] = {}  # sampled, not yet taken, by batch index
        self._sampling = 0  # batches whose `sample_fn` is running
        self._sampler_error: BaseException | None = None
        self._sampler_done = False
        self._ending = False
        self._sampler_stopped = False  # the run has ended and its sampler threads with it
        self._batches = threading.Condition()
        self._client: SamplingClient | None = None
        self._published_version = 0
        self._sampler = threading.Thread(target=self._launch_loop, name="workbench-sampler", daemon=True)

    def start(self) -> AsyncRun:
        self._publish()
        super().start()
        self._sampler.start()
        return self

    # ------------------------------------------------------------------------------------------ sampler

    def _publish(self) -> None:
        """Give the sampler the weights the operations queued so far leave (after they have run)."""
        kind = "inflight" if self.inflight else "snapshot"
        client = self.session.policy.save_weights_and_get_sampling_client(kind=kind).result()
        with self._batches:  # a replaced snapshot client is released once the sampler lets go of it
            self._client = client
            self._published_version = client.weights_version or 0
            self._batches.notify_all()

    def _may_sample(self, index: int) -> bool:
        """Within the bound, and a batch some step still needs (one per step, and one per drop)."""
        return (
            index <= self._trained_batches + self.max_steps_off_policy and index < self.steps + self._dropped
        )

    def _may_start(self, index: int) -> bool:
        """`_may_sample`, and a worker free (implied by the bound: at most k + 1 batches untrained)."""
        return self._may_sample(index) and self._sampling <= self.max_steps_off_policy

    def _launch_loop(self) -> None:
        """Start batches 0, 1, … in order on a pool of k + 1 workers; leaving the pool drains it."""
        index = 0
        with ThreadPoolExecutor(self.max_steps_off_policy + 1, thread_name_prefix="workbench-sample") as pool:
            try:
                while True:
                    with self._batches:
                        while not self._ending and self._sampler_error is None and not self._may_start(index):
                            self._batches.wait(SAMPLER_POLL_S)
                            if self.session.closed:
                                return
                        if self._ending or self._sampler_error is not None:
                            return
                        client, version = self._client, self._published_version
                        self._sampling += 1
                    assert client is not None
                    pool.submit(self._sample_batch, index, client, version)
                    index += 1
            except BaseException as error:  # the trainer raises it: the run fails with it
                with self._batches:
                    self._sampler_error = error
                    self._batches.notify_all()
            finally:
                with self._batches:
                    self._sampler_done = True
                    self._batches.notify_all()

    def _sample_batch(self, index: int, client: SamplingClient, version: int) -> None:
        """Run `sample_fn` for batch `index` on a worker; its result or error goes to the trainer."""
        try:
            batch = self.sample_fn(self.session, client, index)
        except BaseException as error:  # the trainer raises it: the run fails with it
            with self._batches:
                self._sampling -= 1
                if self._sampler_error is None:
                    self._sampler_error = error
                self._batches.notify_all()
            return
        with self._batches:
            self._sampling -= 1
            self._ready[index] = SampledBatch(index, batch, version, time.monotonic())
            self._batches.notify_all()

    # ------------------------------------------------------------------------------------------ trainer

    def _take_batch(self) -> tuple[SampledBatch, float, float]:
        """The next sampled batch, how long the trainer waited for it, and how long it waited for the
        trainer."""
        started = time.monotonic()
        with self._batches:
            index = self._trained_batches  # batches are trained (or dropped) in index order
            while index not in self._ready:
                if self._sampler_error is not None:
                    raise RuntimeError("sample_fn failed on a sampler thread") from self._sampler_error
                if self._sampler_done or self.session.closed:
                    raise RuntimeError("the sampler threads ended before the run")
                self._batches.wait(SAMPLER_POLL_S)
            sampled, taken = self._ready.pop(index), time.monotonic()
        return sampled, taken - started, max(0.0, taken - sampled.ready_at)

    def _step(self, sess: Session, i: int) -> dict[str, float]:
        trainer_wait_s = 0.0
        while True:
            sampled, waited, sample_wait_s = self._take_batch()
            trainer_wait_s += waited
            version = sess.engine.model_status(sess.model_id).weights_version
            staleness = [version - sampled_version for sampled_version in sampled.group_versions()]
            if max(staleness) <= self.max_steps_off_policy:
                break
            with self._batches:  # too stale to train (see the module docstring's rule)
                self._dropped += 1
                self.discarded += 1
                self._trained_batches += 1
                self._batches.notify_all()
        metrics = dict(self.train_fn(sess, i, sampled.batch) or {})
        self._publish()
        with self._batches:
            self._trained_batches += 1
            self._batches.notify_all()
        metrics.update(
            {
                "async/staleness:max": float(max(staleness)),
                "async/staleness:mean": sum(staleness) / len(staleness),
                "async/trainer_wait_s": trainer_wait_s,
                "async/sample_wait_s": sample_wait_s,
                "async/dropped": float(self._dropped),
            }
        )
        return metrics

    def _end(self) -> None:
        with self._batches:
            self._ending = True
            drained = self._sampling
            self._batches.notify_all()
        if threading.current_thread() is not self._sampler:
            self._sampler.join()  # after its pool's workers have finished
        with self._batches:
            left = len(self._ready)
            self._ready.clear()
            self.discarded += left
        if self.state is RunState.STOPPED:
            self.stop_note = (
                f"stopped after step {self.i}: {drained} batch(es) being sampled were drained (let "
                f"finish), and {left} sampled batch(es) not trained were discarded"
            )
            print(self.stop_note)
        if self._client is not None:
            self._client.close()
        self._sampler_stopped = True
        super()._end()  # wakes `wait()`, which returns only now

    def _idle(self) -> bool:
        return super()._idle() and (self.active or self._sampler_stopped)


def start_async_run(
    session: Session,
    sample_fn: SampleFn,
    train_fn: TrainFn,
    steps: int,
    *,
    max_steps_off_policy: int,
    inflight: bool,
    adam_params: Any,
    paused: bool,
    pause_if: PauseIf | None,
) -> AsyncRun:
    """Create and start an asynchronous run (what `Session.run_async` does), refusing while another
    run, or a sweep of the session, is active."""
    check_no_active_run(session)
    check_no_active_sweep(session)
    run = AsyncRun(
        session,
        sample_fn,
        train_fn,
        steps,
        to_adam_params(adam_params if adam_params is not None else AdamParams()),
        max_steps_off_policy=max_steps_off_policy,
        inflight=inflight,
        paused=paused,
        pause_if=pause_if,
    )
    session.current_run = run
    return run.start()
