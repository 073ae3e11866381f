"""Several devices against one: SFT and GRPO-step throughput with `devices=2` against the one-process engine.

One run measures, one session after the other (a process holds one multi-device session at a time):
  - the one-process engine (`wb.Session(model)`),
  - two ranks, data parallel (`devices=2`: two CPU ranks without CUDA, each call's datums split by tokens,
    gradients summed with one all_reduce),
  - two ranks with the base sharded across them (`shard_base=True`; every rank runs the whole call,
    sample calls too, so this is what the memory saving costs),
and prints each one's SFT tokens/s (forward_backward + optim_step, median of `--steps` after one warm-up
step) and GRPO step time (8 prompts × 4 samples, ≤ 16 new tokens, then forward_backward(importance_sampling)
and optim_step), with the ratios against the one-process engine. On a CPU it measures twice, quiet and
with a second process keeping one core busy (`bench/contention.py`).

Where two CUDA GPUs or more exist, it also runs SFT on 1, 2, ... N GPUs and prints the scaling per GPU:
tokens/s on n GPUs / (n × tokens/s on one).

Two CPU ranks share the machine's cores: on a 2-core machine each rank gets one, where the one-process
engine has both, so the CPU figures say what the rank machinery costs, not what a second GPU buys.

    python bench/devices.py                      # tiny
    python bench/devices.py --model smollm2-135m --steps 2
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import torch
from contention import quiet_and_contended  # bench/contention.py, beside this script

import workbench as wb

SFT_BATCH = {"tiny": (16, 128), "smollm2-135m": (8, 128)}
GROUPS, GROUP_SIZE, PROMPT_TOKENS, NEW_TOKENS = 8, 4, 16, 16
ADAM = wb.AdamParams(learning_rate=1e-5)


@dataclass(frozen=True)
class Figures:
    """One setup's SFT tokens/s and GRPO step seconds (None: not measured there)."""

    sft_tokens_per_s: float
    grpo_step_s: float | None


def random_sequences(rng: random.Random, count: int, length: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(count)]


def sft_tokens_per_s(sess: wb.Session, batch: tuple[int, int], steps: int) -> float:
    count, length = batch
    vocab = sess.engine.base_info.vocab_size
    data = [
        wb.Datum(model_input=wb.ModelInput.from_ints(s[:-1]), loss_fn_inputs={"target_tokens": s[1:]})
        for s in random_sequences(random.Random(2), count, length + 1, vocab)
    ]
    times = []
    for step in range(1 + steps):  # the first step warms the kernels up, untimed
        start = time.perf_counter()
        sess.policy.forward_backward(data, "cross_entropy").result()
        sess.policy.optim_step(ADAM).result()
        if step > 0:
            times.append(time.perf_counter() - start)
    return count * length / statistics.median(times)


def grpo_step_s(sess: wb.Session, steps: int) -> float:
    """The median time of `steps` GRPO steps: sample, forward_backward(importance_sampling), optim_step."""
    vocab = sess.engine.base_info.vocab_size
    prompts = random_sequences(random.Random(3), GROUPS, PROMPT_TOKENS, vocab)
    times = []
    for step in range(steps):
        params = wb.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, seed=step)
        start = time.perf_counter()
        client = sess.sampling_client()
        futures = [client.sample(wb.ModelInput.from_ints(p), GROUP_SIZE, params) for p in prompts]
        data = []
        for prompt, future in zip(prompts, futures, strict=True):
            kept = [s for s in future.result().sequences if s.tokens]
            rewards_G = [sum(t % 2 == 0 for t in s.tokens) / len(s.tokens) for s in kept]
            advantages_G = wb.group_relative_advantages(rewards_G).tolist() if kept else []
            data += [wb.policy_datum(prompt, s, a) for s, a in zip(kept, advantages_G, strict=True)]
        sess.policy.forward_backward(data, "importance_sampling").result()
        sess.policy.optim_step(ADAM).result()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(model: str, settings: Mapping[str, Any], steps: int, grpo: bool) -> Figures:
    with wb.Session(model, wb.LoraConfig(rank=16), seed=0, wandb=False, **settings) as sess:
        sft = sft_tokens_per_s(sess, SFT_BATCH.get(model, (8, 128)), steps)
        return Figures(sft, grpo_step_s(sess, steps) if grpo else None)


SETUPS: dict[str, tuple[dict[str, Any], bool]] = {
    "one process": ({}, True),
    "2 ranks": ({"devices": 2}, True),
    "2 ranks, base sharded": ({"devices": 2, "shard_base": True}, True),
}
"""Each setup's Session arguments, and whether it runs the GRPO step."""


def measure_setups(model: str, steps: int) -> dict[str, Figures]:
    return {label: measure(model, settings, steps, grpo) for label, (settings, grpo) in SETUPS.items()}


def report(figures: Mapping[str, Figures]) -> None:
    one = figures["one process"]
    for label, mine in figures.items():
        line = f"  {label:<22} SFT {mine.sft_tokens_per_s:8,.0f} tok/s ({mine.sft_tokens_per_s / one.sft_tokens_per_s:.2f}×)"
        if mine.grpo_step_s is not None and one.grpo_step_s is not None:
            line += (
                f"   GRPO step {mine.grpo_step_s:6.2f} s ({mine.grpo_step_s / one.grpo_step_s:.2f}× the time)"
            )
        print(line, flush=True)


def gpu_scaling(model: str, steps: int) -> None:
    """SFT tokens/s on 1..N CUDA GPUs and the scaling per GPU."""
    count = torch.cuda.device_count()
    single = 0.0
    for n in range(1, count + 1):
        tokens_per_s = measure(model, {"devices": n} if n > 1 else {}, steps, grpo=False).sft_tokens_per_s
        single = single or tokens_per_s
        print(
            f"  {n} GPU(s): SFT {tokens_per_s:,.0f} tok/s, per-GPU scaling {tokens_per_s / (n * single):.2f}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per figure (medians)")
    parser.add_argument("--quiet-only", action="store_true", help="skip the run with one core busy")
    args = parser.parse_args()
    print(
        f"bench/devices.py: {args.model}, {os.cpu_count()} cores, {torch.cuda.device_count()} CUDA device(s)"
    )
    if torch.cuda.device_count() >= 2:
        print("CUDA: per-GPU scaling (SFT)")
        gpu_scaling(args.model, args.steps)
    if torch.cuda.is_available():
        if torch.cuda.device_count() < 2:
            raise SystemExit("one CUDA GPU: the 2-rank figures need two (or run without CUDA: two CPU ranks)")
        print("on CUDA (ranks on the first two GPUs):")
        report(measure_setups(args.model, args.steps))
        return
    if args.quiet_only:
        print("quiet:")
        report(measure_setups(args.model, args.steps))
        return
    both = quiet_and_contended(lambda: measure_setups(args.model, args.steps))
    print("quiet:")
    report(both.quiet)
    print("contended:")
    report(both.contended)
    print(both.describe())


if __name__ == "__main__":
    main()
