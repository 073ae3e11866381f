"""Tutorial 04's RL task on smollm2-135m (bare-number answers to single-digit sums with one worked
example, an exact reward, importance sampling on group baselines, 8 prompts x 4 replies a step, learning
rate 3e-4), run synchronously with `sess.run` and asynchronously with
`sess.run_async(max_steps_off_policy=1)`: both raise the sampled reward.

10 of the tutorial's 15 steps (about 40 s a run on a quiet 2-core machine). Measured (seeded requests;
with k = 1 which weights a batch samples depends on timing, so its curve varies from run to run): mean
reward of steps 0-2 against steps 7-9, 0.20 -> 0.41 synchronous, 0.12 -> 0.39 asynchronous; the
assertion asks for a rise of 0.1.
"""

from __future__ import annotations

import dataclasses

import pytest

import workbench as wb
from workbench.loops.datasets import QA, addition_problems

pytestmark = [pytest.mark.integration, pytest.mark.tutorial_task]

PROMPTS_PER_STEP, GROUP_SIZE, STEPS, LEARNING_RATE = 8, 4, 10, 3e-4
SAMPLING = wb.SamplingParams(max_tokens=8, temperature=1.0)
EXAMPLE = [
    {"role": "system", "content": "You are a calculator."},
    {"role": "user", "content": "What is 2 + 2? Reply with the number only."},
    {"role": "assistant", "content": "4"},
]
TRAIN = addition_problems(STEPS * PROMPTS_PER_STEP, seed=0)
WINDOW, RISE = 3, 0.1  # mean reward of the first and last WINDOW steps; the late one must exceed by RISE
Batch = list[wb.RolloutGroup]


def reward(text: str, answer: str) -> float:
    """Tutorial 04's reward: 1.0 for exactly the answer, 0.0 for anything else."""
    return 1.0 if text == answer else 0.0


def sample_batch(sess: wb.Session, client: wb.SamplingClient, j: int) -> Batch:
    """Batch j's groups, rewarded; each request seeded by (j, prompt), so asynchronous draws do not
    depend on which batch's requests the engine ran first."""
    tok = sess.tokenizer
    problems: list[QA] = TRAIN[j * PROMPTS_PER_STEP : (j + 1) * PROMPTS_PER_STEP]
    prompts = [wb.chat_prompt(tok, [*EXAMPLE, {"role": "user", "content": p.question}]) for p in problems]
    futures = [
        client.sample(prompt, GROUP_SIZE, dataclasses.replace(SAMPLING, seed=1000 * j + g))
        for g, prompt in enumerate(prompts)
    ]
    groups = []
    for problem, prompt, future in zip(problems, prompts, futures, strict=True):
        response = future.result()
        replies = [tok.decode(s.tokens).removesuffix(tok.eos_token).strip() for s in response.sequences]
        groups.append(wb.RolloutGroup.of(prompt, response, [reward(r, problem.answer) for r in replies]))
    return groups


def train_batch(sess: wb.Session, i: int, groups: Batch) -> dict[str, float]:
    """Tutorial 04's update: importance sampling on the groups that carry a signal, then one optim_step."""
    data = wb.rollout_data(groups)
    trained = None
    if data:
        trained = sess.policy.forward_backward(data, "importance_sampling").result()
        sess.policy.optim_step(sess.current_run.adam_params).result()
    sess.record_rollouts(groups, trained=trained)
    return {"datums:sum": float(len(data))}


def sync_step(sess: wb.Session, i: int) -> dict[str, float]:
    """Tutorial 04's `rl_step`: sample on the current weights, then train."""
    client = sess.policy.save_weights_and_get_sampling_client()
    try:
        return train_batch(sess, i, sample_batch(sess, client, i))
    finally:
        client.close()


@pytest.mark.parametrize("max_steps_off_policy", [None, 1], ids=["sync", "async-k1"])
def test_tutorial_04_task_raises_the_reward(max_steps_off_policy: int | None) -> None:
    adam = wb.AdamParams(learning_rate=LEARNING_RATE)
    with wb.Session("smollm2-135m", wb.LoraConfig(rank=16), seed=0, wandb=False) as sess:
        if max_steps_off_policy is None:
            run = sess.run(sync_step, STEPS, adam_params=adam)
        else:
            run = sess.run_async(
                sample_batch, train_batch, STEPS, max_steps_off_policy=max_steps_off_policy, adam_params=adam
            )
        assert run.wait() is wb.RunState.FINISHED, run.traceback
        rewards = list(sess.history.series("reward:mean")[1])
        staleness = [
            row.get("async/staleness:max", 0.0) for row in sess.history.rows if row["op"] == "run_step"
        ]
    assert len(rewards) == STEPS
    assert max(staleness) <= (max_steps_off_policy or 0), staleness
    early, late = sum(rewards[:WINDOW]) / WINDOW, sum(rewards[-WINDOW:]) / WINDOW
    assert late > early + RISE, (early, late, rewards)
