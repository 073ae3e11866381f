"""Passes over several datums on single-threaded streams (`workbench.engine.local.streams`): the same
numbers as one stream up to float rounding, the same bits whichever stream finishes first, and a failed
chunk stops the pass with nothing changed and no stream left running."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
import torch

import workbench as wb
from tests.datums import ragged_ce_batch, rl_datum
from workbench.engine.local.streams import run_on_streams, stream_chunks


def _grads(sess: wb.Session, role: wb.Role = wb.Role.POLICY) -> dict[str, torch.Tensor]:
    gradients = sess.engine.inspect(sess.model_id, role).gradients
    assert all(g is not None for g in gradients.values())
    return gradients  # type: ignore[return-value]


def _recording_threads(sess: wb.Session) -> tuple[list[tuple[str, int]], torch.utils.hooks.RemovableHandle]:
    """A forward pre-hook on the decoder that records (thread name, torch threads) of every pass."""
    seen: list[tuple[str, int]] = []

    def record(module: torch.nn.Module, args: object) -> None:
        seen.append((threading.current_thread().name, torch.get_num_threads()))

    return seen, sess.engine.torch_model.get_decoder().register_forward_pre_hook(record)


@contextlib.contextmanager
def _passes_meet(sess: wb.Session) -> Iterator[None]:
    """Every two passes' forwards wait for each other to start (on one core too): two passes that run on
    two streams at once get through; passes run one after the other time out."""
    both_started = threading.Barrier(2, timeout=30)

    def wait_for_the_other(module: torch.nn.Module, args: object) -> None:
        both_started.wait()

    hook = sess.engine.torch_model.get_decoder().register_forward_pre_hook(wait_for_the_other)
    try:
        yield
    finally:
        hook.remove()


# ---------------------------------------------------------------------------------------------- the cut


def test_the_cut_gives_each_stream_chunks_of_about_512_tokens_within_the_limit() -> None:
    lengths = [10] * 8
    assert stream_chunks([list(range(8))], lengths, 2, None) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert stream_chunks([list(range(8))], lengths, 3, None) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # about CHUNK_TOKENS padded tokens a chunk, as many chunks for each stream: 1280 tokens, 2 each
    assert stream_chunks([list(range(32))], [40] * 32, 2, None) == [
        list(range(i, i + 8)) for i in (0, 8, 16, 24)
    ]
    # no chunk over the limit: 3 datums of 10 tokens fit in 35, and the streams take the chunks in turn
    assert stream_chunks([list(range(8))], lengths, 2, 35) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # one datum is one chunk: the call decides whether its parts make enough chunks for streams
    assert stream_chunks([[0]], [10], 2, None) == [[0]]
    assert stream_chunks([[5, 6, 7], [0, 1, 2, 3, 4]], [10] * 5 + [30] * 3, 2, 60) == [
        [5, 6],
        [7],
        [0, 1, 2, 3],
        [4],
    ]


@pytest.mark.parametrize(
    ("plan", "lengths", "streams", "limit"),
    [
        ([[0, 1, 2, 3]], [10] * 4, 1, None),  # one stream
        ([[0, 1]], [10, 50], 2, 40),  # a datum alone over the limit
    ],
)
def test_no_streams_where_they_cannot_help(
    plan: list[list[int]], lengths: list[int], streams: int, limit: int | None
) -> None:
    assert stream_chunks(plan, lengths, streams, limit) is None


def test_results_are_taken_in_chunk_order_whichever_stream_finishes_first() -> None:
    taken: list[int] = []

    def work(chunk: list[int]) -> int:
        time.sleep(0.2 if chunk[0] == 0 else 0.0)  # the first chunk finishes last
        assert torch.get_num_threads() == 1
        return chunk[0]

    threads_before = torch.get_num_threads()
    run_on_streams(work, [[i] for i in range(6)], 2, taken.append)
    assert taken == list(range(6))
    assert torch.get_num_threads() == threads_before


def test_the_first_failure_in_chunk_order_is_raised_and_no_chunk_starts_after_it() -> None:
    started: list[int] = []

    def work(chunk: list[int]) -> int:
        started.append(chunk[0])
        if chunk[0] in (1, 2):
            time.sleep(0.1 if chunk[0] == 1 else 0.0)
            raise ValueError(f"chunk {chunk[0]}")
        return chunk[0]

    taken: list[int] = []
    with pytest.raises(ValueError, match="chunk 1"):
        run_on_streams(work, [[i] for i in range(20)], 2, taken.append)
    assert taken == [0]
    assert len(started) <= 4  # 0 and 1, then 2 (fails), and at most one more that began before it did


# ---------------------------------------------------------------------------------------------- the engine


def test_a_batch_runs_on_single_threaded_streams_and_one_datum_on_the_worker() -> None:
    data = ragged_ce_batch(seed=3, count=8, min_len=10, max_len=40, vocab=900)
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=2) as sess:
        seen, hook = _recording_threads(sess)
        try:
            with _passes_meet(sess):  # both chunks' forwards at once: two streams, not one in turn
                sess.policy.forward_backward(data, "cross_entropy").result()
            streamed = list(seen)
            seen.clear()
            sess.policy.forward_backward(data[:1], "cross_entropy").result()
            alone = list(seen)
            seen.clear()
            sess.engine.forward(sess.model_id, wb.Role.REFERENCE, data, "cross_entropy").result()
            reference = list(seen)
        finally:
            hook.remove()
    assert len(streamed) == 2 and {name.startswith("workbench-stream") for name, _ in streamed} == {True}
    assert {threads for _, threads in streamed} == {1}
    assert len({name for name, _ in streamed}) == 2
    # one datum, and the reference (adapters off for the whole pass), stay on the worker's threads
    assert [threads for _, threads in alone] == [2] and not alone[0][0].startswith("workbench-stream")
    assert reference and not any(name.startswith("workbench-stream") for name, _ in reference)


def test_forward_only_datums_run_on_the_streams_beside_the_trained_ones() -> None:
    """A group RL call with one trained datum and one whose advantages are all 0: the two make one
    chunk each, and the streams run them at once instead of the forward-only one waiting for the
    other's backward. The gradient is the trained datum's alone."""
    trained = rl_datum(list(range(5, 40)), 4, [-1.0] * 34, advantage=0.7)
    forward_only = rl_datum(list(range(100, 130)), 4, [-1.5] * 29, advantage=0.0)
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=2) as sess:
        seen, hook = _recording_threads(sess)
        try:
            with _passes_meet(sess):
                both = sess.policy.forward_backward([trained, forward_only], "importance_sampling").result()
        finally:
            hook.remove()
        both_grads = _grads(sess)
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=2) as sess:
        alone = sess.policy.forward_backward([trained], "importance_sampling").result()
        alone_grads = _grads(sess)
    assert len(seen) == 2 and all(name.startswith("workbench-stream") for name, _ in seen)
    assert {threads for _, threads in seen} == {1}
    assert both.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(
        alone.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-5
    )
    for name, grad in alone_grads.items():
        torch.testing.assert_close(both_grads[name], grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("loss", ["cross_entropy", "ppo"])
def test_streams_give_one_streams_numbers_and_gradient(loss: str) -> None:
    if loss == "cross_entropy":
        data = ragged_ce_batch(seed=4, count=9, min_len=3, max_len=60, vocab=900)
    else:
        data = []
        for i in range(7):
            tokens = list(range(5 + i, 20 + 2 * i))
            advantage = 0.0 if i in (2, 5) else 0.5 - 0.2 * i  # two forward-only datums beside the rest
            data.append(rl_datum(tokens, 4, [-1.0 - 0.1 * i] * (len(tokens) - 1), advantage=advantage))
    outputs, grads = [], []
    for threads in (1, 2):
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=threads) as sess:
            outputs.append(sess.policy.forward_backward(data, loss).result())
            grads.append(_grads(sess))
    one, streamed = outputs
    assert streamed.metrics.keys() == one.metrics.keys()
    for name, value in one.metrics.items():
        assert streamed.metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    for a, b in zip(one.loss_fn_outputs, streamed.loss_fn_outputs, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key].tolist() == pytest.approx(a[key].tolist(), abs=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4)


def test_the_critic_trains_on_streams_as_on_one() -> None:
    """Two steps, so that the value head is no longer zero and every critic parameter has a gradient."""
    data = []
    for i in range(6):
        tokens = list(range(4 + i, 14 + 3 * i))
        n = len(tokens) - 1
        inputs = {"target_tokens": tokens[1:], "values": [0.0] * n, "returns": [0.1 * i] * n}
        data.append(wb.Datum(model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs))
    grads, losses = [], []
    for threads in (1, 2):
        with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=threads, critic=True) as sess:
            sess.critic.forward_backward(data, "ppo_critic").result()
            sess.critic.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
            losses.append(sess.critic.forward_backward(data, "ppo_critic").result().metrics["loss:sum"])
            grads.append(_grads(sess, wb.Role.CRITIC))
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4)


def _train_twice(data: list[wb.Datum], delay_first: bool) -> tuple[dict[str, torch.Tensor], str]:
    """The gradient of a first streamed pass and the state digest after a second one; with
    `delay_first`, the first chunk's forward waits half a second while the other stream runs the rest."""
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=2) as sess:
        calls = {"n": 0}
        lock = threading.Lock()

        def slow_first(module: torch.nn.Module, args: object) -> None:
            with lock:
                calls["n"] += 1
                first = calls["n"] == 1
            if delay_first and first:
                time.sleep(0.5)

        hook = sess.engine.torch_model.get_decoder().register_forward_pre_hook(slow_first)
        try:
            sess.policy.forward_backward(data, "cross_entropy").result()
            gradients = _grads(sess)
            sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
            sess.policy.forward_backward(data, "cross_entropy").result()
        finally:
            hook.remove()
        return gradients, sess.state_digest()


def test_a_streamed_pass_gives_the_same_bits_whichever_stream_finishes_first() -> None:
    data = ragged_ce_batch(seed=5, count=8, min_len=10, max_len=40, vocab=900)
    (grads, digest), (delayed_grads, delayed_digest) = (_train_twice(data, delay) for delay in (False, True))
    for name, grad in grads.items():
        assert torch.equal(delayed_grads[name], grad), name
    assert delayed_digest == digest


def test_a_failed_chunk_fails_the_call_changes_nothing_and_leaves_no_stream_running() -> None:
    data = ragged_ce_batch(seed=6, count=8, min_len=10, max_len=40, vocab=900)
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=2) as sess:
        # a full-activation limit of 100 tokens cuts the 8 datums into more chunks than streams
        sess.engine._state.model.full_activation_limit = 100
        sess.policy.forward_backward(data[:2], "cross_entropy").result()
        before = sess.state_digest()
        calls = {"n": 0}
        lock = threading.Lock()

        def failing_forward(module: torch.nn.Module, args: object) -> None:
            with lock:
                calls["n"] += 1
                n = calls["n"]
            if n == 2:
                raise torch.OutOfMemoryError("simulated: out of memory")

        hook = sess.engine.torch_model.get_decoder().register_forward_pre_hook(failing_forward)
        try:
            with pytest.raises(torch.OutOfMemoryError, match="simulated"):
                sess.policy.forward_backward(data, "cross_entropy").result()
            after_call = calls["n"]
            assert after_call < 4  # the other chunks were not started
            time.sleep(0.3)
            assert calls["n"] == after_call  # nothing runs on after the call returned
        finally:
            hook.remove()
        assert sess.state_digest() == before
        sess.policy.forward_backward(data, "cross_entropy").result()
        assert sess.policy.optim_step().result().applied
