"""async_run.py: `sess.run_async` samples ahead of training within its staleness bound, equals the
synchronous loop bit for bit at max_steps_off_policy=0, and stops, pauses and records like `sess.run`."""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any

import pytest
import torch

import workbench as wb
from tests.datums import rl_datum

PROMPTS = [[5, 17, 42, 9], [8, 3, 77, 21]]
PARAMS = wb.SamplingParams(max_tokens=6, temperature=1.0)


def seeded(params: wb.SamplingParams, j: int, group: int) -> wb.SamplingParams:
    """Batch j's group's own seed: with k >= 1 batches' requests interleave on the engine in an order
    set by timing, and a seeded request draws the same whatever ran before it."""
    return dataclasses.replace(params, seed=1000 * j + group)


def sample_groups(sess: wb.Session, client: Any, j: int) -> list[tuple[list[int], wb.SampleResponse]]:
    """Two prompts, four replies each: the batch for one step."""
    futures = [(prompt, client.sample(prompt, 4, seeded(PARAMS, j, g))) for g, prompt in enumerate(PROMPTS)]
    return [(prompt, future.result()) for prompt, future in futures]


def train_groups(sess: wb.Session, i: int, batch: list[tuple[list[int], wb.SampleResponse]]) -> dict:
    """Importance sampling on group-relative advantages of a made-up reward (even tokens)."""
    data, rewards = [], []
    for prompt, response in batch:
        group = [sum(t % 2 == 0 for t in s.tokens) / len(s.tokens) for s in response.sequences]
        rewards += group
        mean = sum(group) / len(group)
        for sequence, reward in zip(response.sequences, group, strict=True):
            logprobs = [0.0] * (len(prompt) - 1) + list(sequence.logprobs)
            data.append(rl_datum(prompt + list(sequence.tokens), len(prompt), logprobs, reward - mean))
    sess.policy.forward_backward(data, "importance_sampling").result()
    sess.policy.optim_step(sess.current_run.adam_params).result()
    return {"reward:mean": sum(rewards) / len(rewards)}


def _session() -> wb.Session:
    return wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)


def _run_rows(sess: wb.Session) -> list[dict]:
    return [row for row in sess.history.rows if row["op"] == "run_step"]


def test_no_steps_off_policy_is_the_synchronous_run_bit_for_bit() -> None:
    adam = wb.AdamParams(learning_rate=5e-2)
    with _session() as sync:

        def sync_step(sess: wb.Session, i: int) -> dict:
            client = sess.policy.save_weights_and_get_sampling_client(kind="inflight").result()
            return train_groups(sess, i, sample_groups(sess, client, i))

        sync.run(sync_step, 4, adam_params=adam).wait()
        sync_rewards = [row["reward:mean"] for row in _run_rows(sync)]
        sync_digest = sync.engine.state_digest()
    with _session() as asynchronous:
        run = asynchronous.run_async(sample_groups, train_groups, 4, max_steps_off_policy=0, adam_params=adam)
        assert run.wait() is wb.RunState.FINISHED, run.traceback
        rows = _run_rows(asynchronous)
        assert [row["reward:mean"] for row in rows] == sync_rewards
        assert all(row["async/staleness:max"] == 0.0 for row in rows)
        assert asynchronous.engine.state_digest() == sync_digest
        assert len(set(sync_rewards)) > 1  # the reward moved: the runs compared trained something


@pytest.mark.parametrize("inflight", [True, False])
def test_staleness_never_exceeds_the_bound(inflight: bool) -> None:
    def slow_train(sess: wb.Session, i: int, batch: Any) -> dict:
        time.sleep(0.3)  # the sampler gets ahead while the trainer trains
        return train_groups(sess, i, batch)

    with _session() as sess:
        run = sess.run_async(
            sample_groups,
            slow_train,
            6,
            max_steps_off_policy=2,
            inflight=inflight,
            adam_params={"learning_rate": 1e-2},
        )
        assert run.wait() is wb.RunState.FINISHED, run.traceback
        rows = _run_rows(sess)
        staleness = [row["async/staleness:max"] for row in rows]
        assert len(rows) == 6 and max(staleness) <= 2
        assert max(staleness) > 0  # it did sample ahead
        assert all(row["async/trainer_wait_s"] >= 0 and row["async/sample_wait_s"] >= 0 for row in rows)


def test_the_next_batch_samples_while_this_one_is_rewarded() -> None:
    """At k = 1 batch j + 1's `sample_fn` starts while batch j's reward is still running (the reward
    waits for that start, with a timeout a serial sampler would run out), and never more than k + 1
    batches sample at once."""
    steps, k = 4, 1
    started = [threading.Event() for _ in range(steps)]
    overlapped: dict[int, bool] = {}
    in_flight, most_in_flight = 0, 0
    lock = threading.Lock()

    def sample_then_slow_reward(sess: wb.Session, client: Any, j: int) -> Any:
        nonlocal in_flight, most_in_flight
        with lock:
            in_flight += 1
            most_in_flight = max(most_in_flight, in_flight)
        started[j].set()
        try:
            batch = sample_groups(sess, client, j)
            if j + 1 < steps:  # the reward runs until the next batch has started sampling
                overlapped[j] = started[j + 1].wait(timeout=30)
            return batch
        finally:
            with lock:
                in_flight -= 1

    with _session() as sess:
        run = sess.run_async(sample_then_slow_reward, train_groups, steps, max_steps_off_policy=k)
        assert run.wait() is wb.RunState.FINISHED, run.traceback
        assert overlapped == {j: True for j in range(steps - 1)}
        assert most_in_flight <= k + 1


def test_stop_drains_the_batch_in_flight_and_says_what_was_discarded() -> None:
    def slow_sample(sess: wb.Session, client: Any, j: int) -> Any:
        time.sleep(0.2)
        return sample_groups(sess, client, j)

    with _session() as sess:
        run = sess.run_async(slow_sample, train_groups, 50, max_steps_off_policy=1)
        while run.i < 1:
            time.sleep(0.05)
        run.stop()
        assert run.wait() is wb.RunState.STOPPED
        assert run.i < 50 and run.stop_note is not None and "drained" in run.stop_note
        assert f"{run.discarded} sampled batch" in run.stop_note
        assert not run._sampler.is_alive()


def test_pause_if_reads_the_staleness() -> None:
    def slow_train(sess: wb.Session, i: int, batch: Any) -> dict:
        time.sleep(0.3)
        return train_groups(sess, i, batch)

    with _session() as sess:
        run = sess.run_async(
            sample_groups,
            slow_train,
            20,
            max_steps_off_policy=1,
            pause_if={"async/staleness:max": ("above", 0.5)},
        )
        assert run.wait() is wb.RunState.PAUSED
        assert run.trigger is not None and run.i < 20
        run.stop()
        assert run.wait() is wb.RunState.STOPPED


LOWER_HALF_STEPS = 12


def lower_half_sample(sess: wb.Session, client: Any, j: int) -> tuple[Any, list[Any], list[float]]:
    """tests/loops/test_ppo_loop.py's task: 16 replies to one prompt, each rewarded with the fraction of
    its tokens from the lower half of the vocabulary (about 0.5 untrained)."""
    prompt = sess.tokenizer("The answer is").input_ids
    params = seeded(wb.SamplingParams(max_tokens=6, temperature=1.0), j, 0)
    group = client.sample(prompt, 16, params).result().sequences
    half = sess.base_info.vocab_size // 2
    return prompt, group, [sum(t < half for t in s.tokens) / len(s.tokens) for s in group]


def lower_half_train(sess: wb.Session, i: int, batch: tuple[Any, list[Any], list[float]]) -> dict:
    prompt, group, rewards = batch
    advantages = wb.group_relative_advantages(torch.tensor(rewards))
    data = [wb.policy_datum(prompt, s, float(a)) for s, a in zip(group, advantages, strict=True)]
    sess.policy.forward_backward(data, "importance_sampling").result()
    sess.policy.optim_step(sess.current_run.adam_params).result()
    return {"reward:mean": sum(rewards) / len(rewards)}


@pytest.mark.parametrize("max_steps_off_policy", [None, 1], ids=["synchronous", "k=1"])
def test_an_asynchronous_run_raises_the_reward_as_the_synchronous_one_does(
    max_steps_off_policy: int | None,
) -> None:
    """Over 12 steps at learning rate 3e-2 the synchronous loop raises the mean reward of the last three
    steps over the first three's by 0.27 to 0.52 for seeds 0 to 7 (tests/loops/test_ppo_loop.py; seed 0:
    0.49). Sampling one step ahead must raise it by a like margin: at k = 1 (inflight or snapshot
    clients alike) seeds 0 to 2 rose 0.49, 0.30 and 0.46; seed 3 had not started rising by step 12.
    Those draws were unseeded; with a seed per batch (`seeded`, reproducible at k = 1 too) session seed
    0 rises 0.40 synchronously and 0.35 at k = 1."""
    adam = wb.AdamParams(learning_rate=3e-2)
    with wb.Session("tiny", wb.LoraConfig(rank=8), seed=0, wandb=False) as sess:
        if max_steps_off_policy is None:

            def step(sess: wb.Session, i: int) -> dict:
                client = sess.policy.save_weights_and_get_sampling_client(kind="inflight").result()
                return lower_half_train(sess, i, lower_half_sample(sess, client, i))

            run = sess.run(step, LOWER_HALF_STEPS, adam_params=adam)
        else:
            run = sess.run_async(
                lower_half_sample,
                lower_half_train,
                LOWER_HALF_STEPS,
                max_steps_off_policy=max_steps_off_policy,
                adam_params=adam,
            )
        assert run.wait() is wb.RunState.FINISHED, run.traceback
        rows = _run_rows(sess)
        rewards = [row["reward:mean"] for row in rows]
        assert len(rewards) == LOWER_HALF_STEPS
        assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.2, rewards
        if max_steps_off_policy is not None:
            assert max(row["async/staleness:max"] for row in rows) <= max_steps_off_policy
