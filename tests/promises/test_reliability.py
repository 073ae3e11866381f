"""What workbench promises when things go wrong: no hangs, no split state after Ctrl-C, no leaks.

Each test provokes a failure the way a user meets it: a custom loss that waits for another operation, a
sampling client freed by the garbage collector in the middle of the worker's copy-on-write, `close()`
racing a thread that submits, Ctrl-C while a call waits behind queued work, a notebook cell re-run
without `close()`. docs/reliability.md states what these tests check.
"""

from __future__ import annotations

import contextlib
import gc
import json
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import workbench as wb
from tests.datums import unweighted_datum
from tests.interrupts import TOKENS, WAIT_S, Blocker, ctrl_c_once_waiting
from workbench.engine.local import model_lifecycle
from workbench.engine.worker import Worker


def _session(**kwargs: object) -> wb.Session:
    return wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, **kwargs)


# ---------------------------------------------------------------------------------------------- hangs


@pytest.mark.timeout(120)
def test_a_custom_loss_that_waits_for_another_operation_raises_instead_of_deadlocking() -> None:
    """The worker runs one operation at a time: a custom loss waiting there for a later one would wait
    forever, and every later operation and close() with it. It raises ReentrantWaitError instead, the
    call fails whole, and the session carries on."""
    with _session() as sess:
        sess.policy.forward_backward([unweighted_datum(TOKENS)], "cross_entropy").result()
        before = sess.state_digest()

        def waits_for_the_reference(data: list[wb.Datum], logprobs: list[torch.Tensor]) -> tuple:
            reference = sess.reference.forward(data, "cross_entropy").result()
            return -logprobs[0].sum() + reference.metrics["loss:sum"], {}

        def waits_for_a_sampler(data: list[wb.Datum], logprobs: list[torch.Tensor]) -> tuple:
            sess.policy.save_weights_and_get_sampling_client().result()
            return -logprobs[0].sum(), {}

        for loss in (waits_for_the_reference, waits_for_a_sampler):
            with pytest.raises(wb.ReentrantWaitError, match="from inside another operation"):
                sess.policy.forward_backward_custom([unweighted_datum(TOKENS)], loss).result(timeout=WAIT_S)
            assert sess.state_digest() == before
        assert sess.policy.optim_step().result(timeout=WAIT_S).applied
    assert sess.closed


@pytest.mark.timeout(120)
def test_a_client_collected_inside_the_copy_on_write_does_not_hang_the_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sampling client in a reference cycle is freed by whichever garbage-collector pass comes next,
    on whatever thread: here, deterministically, a pass on the worker thread in the middle of copying
    the weights it pinned, right before an optimizer step changes them. Its release must not wait for
    anything the worker holds there."""
    with _session() as sess:
        client = sess.sampling_client()
        client.cycle = client  # type: ignore[attr-defined]  # only the garbage collector frees it
        pinned = client.weights_version
        collected = weakref.ref(client)
        real_clone = torch.Tensor.clone
        passes: list[bool] = []

        def clone_then_collect(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            copy = real_clone(tensor, *args, **kwargs)
            if threading.current_thread().name == "workbench-worker" and not passes:
                gc.collect()
                passes.append(collected() is None)
            return copy

        gc.disable()  # no automatic pass frees the client before the worker's
        try:
            del client
            monkeypatch.setattr(torch.Tensor, "clone", clone_then_collect)
            sess.policy.forward_backward([unweighted_datum(TOKENS)], "cross_entropy")
            step = sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result(timeout=WAIT_S)
            monkeypatch.undo()
        finally:
            gc.enable()
        assert passes == [True], "the client was not collected inside the copy-on-write"
        assert step.applied
        assert sess.live_versions() == [pinned + 1]  # the release reached the worker, after the step
        assert sess.engine.model_status(sess.model_id).snapshot_bytes == 0


@pytest.mark.timeout(120)
def test_close_racing_a_submitting_thread_resolves_every_future() -> None:
    """Every future resolves, with its result or SessionClosedError, however close() and a submission
    interleave. Thread switches are forced every microsecond to try the interleavings a busy kernel
    meets once in thousands of calls."""
    switch_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    futures_seen = 0
    rounds = 0
    try:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            worker = Worker()
            futures: list[wb.APIFuture] = []
            submitting = threading.Event()

            def submit(worker: Worker = worker, futures: list = futures, submitting=submitting) -> None:
                while True:
                    try:
                        futures.append(worker.submit(lambda: 1))
                    except wb.SessionClosedError:
                        return
                    submitting.set()

            thread = threading.Thread(target=submit)
            thread.start()
            assert submitting.wait(WAIT_S)
            worker.close()
            thread.join(WAIT_S)
            assert not thread.is_alive()
            for future in futures:
                with contextlib.suppress(wb.SessionClosedError):
                    assert future.result(timeout=WAIT_S) == 1
            futures_seen += len(futures)
            rounds += 1
    finally:
        sys.setswitchinterval(switch_interval)
    assert rounds > 10 and futures_seen > 1000


@pytest.mark.timeout(120)
def test_closing_a_session_while_another_thread_submits_resolves_every_future() -> None:
    for _ in range(3):
        sess = _session()
        futures: list[wb.APIFuture] = []
        submitted = threading.Event()

        def submit(sess: wb.Session = sess, futures: list = futures, submitted=submitted) -> None:
            while len(futures) < 30:
                try:
                    futures.append(sess.policy.forward([unweighted_datum(TOKENS)], "cross_entropy"))
                except wb.SessionClosedError:
                    return
                if len(futures) == 5:
                    submitted.set()

        thread = threading.Thread(target=submit)
        thread.start()
        assert submitted.wait(WAIT_S)
        sess.close()
        thread.join(WAIT_S)
        assert not thread.is_alive()
        done = 0
        for future in futures:
            with contextlib.suppress(wb.SessionClosedError):
                future.result(timeout=WAIT_S)
                done += 1
        assert done >= 5


# ---------------------------------------------------------------------------------------------- interrupts


def _adapters(sess: wb.Session) -> list[str]:
    return list(sess.engine.torch_model.peft_config)


@pytest.mark.timeout(120)
def test_ctrl_c_while_create_critic_waits_behind_queued_work_leaves_no_trace() -> None:
    sess = _session()
    try:
        blocker = Blocker()
        held = blocker.hold(sess)
        with pytest.raises(KeyboardInterrupt), ctrl_c_once_waiting():
            sess.create_critic()
        blocker.release()
        held.result(timeout=WAIT_S)
        # withdrawn before it ran: no critic anywhere, and the session and the engine agree
        assert sess.critic is None and sess.config.critic is None
        assert _adapters(sess) == ["policy"]
        critic = sess.create_critic()  # the retry works
        assert sess.critic is critic and sess.config.critic is not None
        assert _adapters(sess) == ["policy", "critic"]
        values = critic.forward([unweighted_datum(TOKENS)], "ppo_critic").result(timeout=WAIT_S)
        assert len(values.loss_fn_outputs[0]["values"]) == 4
        saved = sess.policy.save_state("after-ctrl-c").result(timeout=WAIT_S)
        digest = sess.state_digest()
        sess.close()  # the resumed session continues in its model folder, which a live session holds
        with wb.Session.from_checkpoint(saved.path, wandb=False) as resumed:
            assert resumed.critic is not None and resumed.state_digest() == digest
    finally:
        sess.close()


@pytest.mark.timeout(120)
def test_ctrl_c_once_create_critic_runs_lets_it_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    sess = _session()
    try:
        running = threading.Event()
        finish = threading.Event()
        real_add_critic = model_lifecycle.add_critic

        def slow_add_critic(*args: object, **kwargs: object) -> None:
            running.set()
            assert finish.wait(WAIT_S)
            real_add_critic(*args, **kwargs)

        monkeypatch.setattr(model_lifecycle, "add_critic", slow_add_critic)

        def once_running() -> None:
            assert running.wait(WAIT_S)

        with pytest.raises(KeyboardInterrupt), ctrl_c_once_waiting(before=once_running, after=finish.set):
            sess.create_critic()
        # it had started, so the interrupted call waited for it to finish: the critic is whole
        assert sess.critic is not None and sess.config.critic is not None
        assert _adapters(sess) == ["policy", "critic"]
        with pytest.raises(ValueError, match="already has a critic"):
            sess.create_critic()
        sess.critic.forward([unweighted_datum(TOKENS)], "ppo_critic").result(timeout=WAIT_S)
        saved = sess.policy.save_state("critic-made").result(timeout=WAIT_S)
        sess.load_state(saved.path)
    finally:
        sess.close()


@pytest.mark.timeout(120)
def test_ctrl_c_while_delete_critic_waits_behind_queued_work_leaves_no_trace() -> None:
    sess = _session(critic=True)
    try:
        blocker = Blocker()
        held = blocker.hold(sess)
        with pytest.raises(KeyboardInterrupt), ctrl_c_once_waiting():
            sess.delete_critic()
        blocker.release()
        held.result(timeout=WAIT_S)
        assert sess.critic is not None and sess.config.critic is not None
        assert _adapters(sess) == ["policy", "critic"]
        saved = sess.policy.save_state("with-critic").result(timeout=WAIT_S)
        sess.load_state(saved.path)  # the session's view matches the engine's: its checkpoints load
        sess.delete_critic()  # the retry works
        assert sess.critic is None and sess.config.critic is None and _adapters(sess) == ["policy"]
    finally:
        sess.close()


@pytest.mark.timeout(120)
def test_ctrl_c_during_close_then_close_again_frees_the_session() -> None:
    sess = _session()
    model = weakref.ref(sess.engine.torch_model)
    blocker = Blocker()
    held = blocker.hold(sess)
    with pytest.raises(KeyboardInterrupt), ctrl_c_once_waiting():
        sess.close()
    assert sess.closed
    with pytest.raises(wb.SessionClosedError):
        sess.policy.forward([unweighted_datum(TOKENS)], "cross_entropy")
    blocker.release()
    assert held.result(timeout=WAIT_S).metrics["loss:sum"] > 0  # queued work still finishes
    sess.close()  # the retry frees what the interrupted call did not
    gc.collect()
    assert model() is None
    sess.close()


def test_state_digest_of_a_closed_session_raises() -> None:
    sess = _session()
    sess.close()
    with pytest.raises(wb.SessionClosedError):
        sess.state_digest()


# ---------------------------------------------------------------------------------------------- leaks


def _freed(engine: weakref.ref, model: weakref.ref) -> bool:
    """Whether the engine and its model are gone, giving a garbage-collector pass a few chances (a run
    thread may hold its run for a moment before it waits)."""
    for _ in range(50):
        gc.collect()
        if engine() is None and model() is None:
            return True
        time.sleep(0.02)
    return False


def _worker_threads() -> int:
    return sum(thread.name == "workbench-worker" and thread.is_alive() for thread in threading.enumerate())


def _trained(sess: wb.Session) -> None:
    sess.policy.forward_backward([unweighted_datum(TOKENS)], "cross_entropy").result()
    sess.policy.optim_step().result()
    sess.sampling_client().sample([5, 6, 7], 2, wb.SamplingParams(max_tokens=3)).result()


def _with_dropped_clients(sess: wb.Session) -> Path:
    client = sess.policy.save_weights_and_get_sampling_client().result()
    client.cycle = client  # type: ignore[attr-defined]
    client.sample([5, 6, 7], 1, wb.SamplingParams(max_tokens=2))  # still queued when the session goes
    sess.sampling_client(base=True)
    return sess.model_dir / "history.jsonl"


def _after_a_finished_run(sess: wb.Session) -> None:
    assert sess.run(wb.train_step([unweighted_datum(TOKENS)]), 2).wait(WAIT_S) is wb.RunState.FINISHED


def _with_a_paused_run(sess: wb.Session) -> None:
    assert (
        sess.run(wb.train_step([unweighted_datum(TOKENS)]), 5, paused=True).wait(WAIT_S) is wb.RunState.PAUSED
    )


def _with_a_panel(sess: wb.Session) -> wb.Panel:
    return sess.panel(
        train_data=[unweighted_datum(TOKENS)]
    )  # ipywidgets keeps every widget until it is closed


@pytest.mark.parametrize(
    "use",
    [_trained, _with_dropped_clients, _after_a_finished_run, _with_a_paused_run, _with_a_panel],
    ids=["trained", "dropped-clients", "finished-run", "paused-run", "panel"],
)
def test_a_session_dropped_without_close_is_freed(use: Callable[[wb.Session], object]) -> None:
    """Re-running the notebook cell that made a session drops it without close(): its model, optimizer
    state and worker thread go with the last reference, whatever the session was used for."""
    threads = _worker_threads()
    sess = _session()
    engine, model = weakref.ref(sess.engine), weakref.ref(sess.engine.torch_model)
    kept = use(sess)
    del sess
    assert _freed(engine, model)
    deadline = time.monotonic() + WAIT_S
    while _worker_threads() > threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _worker_threads() == threads
    if isinstance(kept, Path):  # operations queued before the drop finish, and their rows are written
        assert json.loads(kept.read_text().splitlines()[-1])["op"] == "sample"
    if isinstance(kept, wb.Panel):  # the panel says its session is gone, and its timer ends
        kept.refresh()
        assert '"session"><b>session</b> freed' in kept.status.widget.value
        kept._timer.join(WAIT_S)
        assert not kept.polling
        kept.train.step_button.click()
        assert "the session of this panel was freed" in kept.train.feedback.text
        with pytest.raises(wb.SessionClosedError, match="freed"):
            kept.session  # noqa: B018
        kept.close()


def test_a_paused_run_of_a_dropped_session_ends_its_thread() -> None:
    sess = _session()
    run = sess.run(wb.train_step([unweighted_datum(TOKENS)]), 5, paused=True)
    thread = run._thread
    engine, model = weakref.ref(sess.engine), weakref.ref(sess.engine.torch_model)
    del sess, run
    assert _freed(engine, model)
    thread.join(WAIT_S)
    assert not thread.is_alive()


def test_what_still_holds_a_session_keeps_it() -> None:
    """A live sampling client keeps its engine (it can still sample), a running run its session (it is
    still training), and a paused run its session while the run is referenced (it can be resumed)."""
    sess = _session()
    engine, model = weakref.ref(sess.engine), weakref.ref(sess.engine.torch_model)
    client = sess.sampling_client()
    run = sess.run(wb.train_step([unweighted_datum(TOKENS)]), 3, paused=True)
    del sess
    gc.collect()
    assert engine() is not None
    assert client.sample([5, 6], 1, wb.SamplingParams(max_tokens=2)).result(timeout=WAIT_S).sequences
    run.resume()
    assert run.wait(WAIT_S) is wb.RunState.FINISHED and run.i == 3
    del client, run
    assert _freed(engine, model)


def test_a_dropped_session_closes_its_wandb_run(no_wandb_credentials) -> None:
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=None)
    assert sess.wandb_run is not None and sess.wandb_run.mode == "offline"
    sess.policy.forward_backward([unweighted_datum(TOKENS)], "cross_entropy").result()
    folder = sess.wandb_run.directory
    engine, model = weakref.ref(sess.engine), weakref.ref(sess.engine.torch_model)
    del sess
    assert _freed(engine, model)
    assert any(folder.glob("*.wandb"))


@pytest.mark.integration
def test_rss_stays_flat_over_ten_dropped_smollm2_sessions() -> None:
    """Each dropped SmolLM2-135M session used to keep about 545 MiB (its model, adapter, optimizer state
    and worker thread). Ten create-train-drop cycles now leave the process's memory where the first
    left it, within what the allocator keeps for reuse."""
    import psutil

    process = psutil.Process()
    data = [unweighted_datum(TOKENS)]
    rss_mib: list[float] = []
    for _ in range(10):
        sess = wb.Session("smollm2-135m", wb.LoraConfig(rank=8), seed=0, wandb=False)
        sess.policy.forward_backward(data, "cross_entropy").result()
        sess.policy.optim_step().result()
        del sess
        gc.collect()
        rss_mib.append(process.memory_info().rss / 2**20)
    growth = max(rss_mib[1:]) - rss_mib[1]
    assert growth < 150, f"RSS after each cycle (MiB): {[round(r) for r in rss_mib]}"
