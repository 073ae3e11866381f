"""Asynchronous RL: steps per second of an RL loop whose reward takes 0.5 s per group (a sleep standing
in for a tool or a grader on another machine), synchronous against `sess.run_async` at
max_steps_off_policy = 1 and 2, on inflight sampling clients.

Each step samples `--groups` prompts x `--samples` replies, rewards each group (the sleep, then a
made-up score), and trains one importance-sampling step on group-relative advantages. The synchronous
loop pays sample + rewards + train per step; the asynchronous one runs up to k + 1 batches' sampling
and rewards at once, so the rewards hide behind the engine's sampling and training (and, where the
sampler has its own process or device, the sampling behind the training).

    python bench/async_rl.py                      # tiny
    python bench/async_rl.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import workbench as wb

REWARD_SECONDS = 0.5


def sample_and_reward(groups: int, samples: int, max_tokens: int) -> Any:
    params = wb.SamplingParams(max_tokens=max_tokens, temperature=1.0)

    def sample_fn(sess: wb.Session, client: Any, j: int) -> list[tuple[list[int], Any, list[float]]]:
        prompts = [[5 + (7 * (j + g)) % 90, 17, 42, 9 + g] for g in range(groups)]
        # a seed per request: at k >= 1 batches' requests interleave on the engine in timing's order
        futures = [
            (prompt, client.sample(prompt, samples, dataclasses.replace(params, seed=1000 * j + g)))
            for g, prompt in enumerate(prompts)
        ]
        batch = []
        for prompt, future in futures:
            response = future.result()
            time.sleep(REWARD_SECONDS)  # the tool / grader answering for this group
            rewards = [sum(t % 2 == 0 for t in s.tokens) / max(len(s.tokens), 1) for s in response.sequences]
            batch.append((prompt, response, rewards))
        return batch

    return sample_fn


def train_fn(sess: wb.Session, i: int, batch: list[tuple[list[int], Any, list[float]]]) -> dict[str, float]:
    data = []
    for prompt, response, rewards in batch:
        mean = sum(rewards) / len(rewards)
        for sequence, reward in zip(response.sequences, rewards, strict=True):
            tokens = prompt + list(sequence.tokens)
            n = len(tokens) - 1
            completion = [k >= len(prompt) - 1 for k in range(n)]
            logprobs = [0.0] * (len(prompt) - 1) + list(sequence.logprobs)
            data.append(
                wb.Datum(
                    model_input=wb.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [lp if c else 0.0 for lp, c in zip(logprobs, completion, strict=True)],
                        "advantages": [reward - mean if c else 0.0 for c in completion],
                    },
                )
            )
    sess.policy.forward_backward(data, "importance_sampling").result()
    sess.policy.optim_step(sess.current_run.adam_params).result()
    return {"reward:mean": sum(r for _, _, rewards in batch for r in rewards) / sum(len(b[2]) for b in batch)}


def steps_per_second(args: argparse.Namespace, k: int | None) -> float:
    """One run of `args.steps` steps: synchronous when `k` is None."""
    sample_fn = sample_and_reward(args.groups, args.samples, args.max_tokens)
    adam = wb.AdamParams(learning_rate=1e-4)
    with wb.Session(args.model, wb.LoraConfig(rank=8), seed=0, wandb=False) as sess:
        start = time.perf_counter()
        if k is None:

            def step(sess: wb.Session, i: int) -> dict[str, float]:
                client = sess.policy.save_weights_and_get_sampling_client(kind="inflight").result()
                return train_fn(sess, i, sample_fn(sess, client, i))

            run = sess.run(step, args.steps, adam_params=adam)
        else:
            run = sess.run_async(sample_fn, train_fn, args.steps, max_steps_off_policy=k, adam_params=adam)
        state = run.wait()
        assert state is wb.RunState.FINISHED, run.traceback
        return args.steps / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    sync = steps_per_second(args, None)
    print(
        f"{args.model}: reward {REWARD_SECONDS} s/group, {args.groups} groups x {args.samples} samples, {args.steps} steps"
    )
    print(f"  sync        {sync:.3f} steps/s")
    for k in (1, 2):
        rate = steps_per_second(args, k)
        print(f"  async k={k}   {rate:.3f} steps/s  ({rate / sync:.2f}x)")


if __name__ == "__main__":
    main()
