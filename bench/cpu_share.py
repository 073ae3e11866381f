"""Where the CPU goes when another process keeps a core busy: for the two halves of a GRPO step, wall
seconds, the session's CPU seconds and cores, and the busy process's cores, quiet and contended.

Why. On a machine whose scheduler is fair to threads, a process of two runnable threads beside one busy
thread gets two thirds of each of two cores, 4/3 of a core: work that uses both cores fully when quiet
takes 2 / (4/3) = 1.5x as long, with the same CPU seconds. Below 1.5x only comes from work that does not
use both cores fully when quiet; above it from work that cannot be split without costing more CPU
seconds. This script shows which a step's halves are:
  - forward_backward(importance_sampling) over 32 datums of 56 tokens (44 of prompt): the batch runs on
    one single-threaded stream per core (`workbench/engine/local/streams.py`);
  - sampling 8 prompts of 44 tokens x 4 samples x 16 new tokens (no early stop), one `generate` batch on
    one thread per free core (`workbench/engine/threads.py`).
Random token ids from a seeded generator, a rank-16 LoRA on attention and MLP (as `bench/peers.py`); each figure the median of 3 calls
after one untimed call.

    python bench/cpu_share.py
    python bench/cpu_share.py --model tiny
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import psutil
import torch
from contention import MARGIN_S, MAX_SLOWDOWN, MODES, busy_core  # bench/contention.py, beside this script

import workbench as wb

DATUMS, DATUM_TOKENS, PROMPT_TOKENS = 32, 56, 44
PROMPTS, SAMPLES, NEW_TOKENS = 8, 4, 16
CALLS = 3


@dataclass(frozen=True)
class Share:
    """One call's wall seconds, this process's CPU seconds over them, and the busy process's cores."""

    wall_s: float
    cpu_s: float
    busy_cores: float

    @property
    def cores(self) -> float:
        return self.cpu_s / self.wall_s


def measured(call: Callable[[], None], busy: psutil.Process | None) -> Share:
    """`call` once untimed, then the median-wall of CALLS timed calls."""
    call()
    shares = []
    for _ in range(CALLS):
        busy_cpu = sum(busy.cpu_times()[:2]) if busy is not None else 0.0
        cpu, start = time.process_time(), time.perf_counter()
        call()
        wall = time.perf_counter() - start
        busy_cores = (sum(busy.cpu_times()[:2]) - busy_cpu) / wall if busy is not None else 0.0
        shares.append(Share(wall, time.process_time() - cpu, busy_cores))
    return sorted(shares, key=lambda share: share.wall_s)[len(shares) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    session = wb.Session(
        args.model,
        wb.LoraConfig(rank=16, train_unembed=False),
        seed=0,
        wandb=False,
        model_dir=tempfile.mkdtemp(),
    )
    generator = torch.Generator().manual_seed(0)
    vocab = min(len(session.tokenizer), 40_000)

    def tokens(n: int) -> list[int]:
        return torch.randint(100, vocab, (n,), generator=generator).tolist()

    completion = DATUM_TOKENS - PROMPT_TOKENS
    data = [
        wb.Datum(
            model_input=wb.ModelInput.from_ints(sequence[:-1]),
            loss_fn_inputs={
                "target_tokens": sequence[1:],
                "logprobs": [-1.0] * (DATUM_TOKENS - 1),
                "advantages": [0.0] * (PROMPT_TOKENS - 1) + [0.5] * completion,
            },
        )
        for sequence in (tokens(DATUM_TOKENS) for _ in range(DATUMS))
    ]
    prompts = [wb.ModelInput.from_ints(tokens(PROMPT_TOKENS)) for _ in range(PROMPTS)]
    params = wb.SamplingParams(max_tokens=NEW_TOKENS, temperature=1.0, stop=[])

    def forward_backward() -> None:
        session.policy.forward_backward(data, "importance_sampling").result()

    def sample() -> None:
        client = session.policy.save_weights_and_get_sampling_client()
        for future in [client.sample(prompt, SAMPLES, params) for prompt in prompts]:
            future.result()

    calls = {
        f"forward_backward, {DATUMS} x {DATUM_TOKENS} tokens": forward_backward,
        f"sampling, {PROMPTS} x {SAMPLES} x {NEW_TOKENS} tokens": sample,
    }
    figures: dict[tuple[str, str], Share] = {}
    start = time.monotonic()
    for name, call in calls.items():
        figures["quiet", name] = measured(call, None)
    quiet_s = time.monotonic() - start
    with busy_core(MAX_SLOWDOWN * quiet_s + MARGIN_S) as busy:
        time.sleep(1.0)  # the thread policy sees the busy core before the first call
        process = psutil.Process(busy.process.pid)
        for name, call in calls.items():
            figures["contended", name] = measured(call, process)
    session.close()

    print(
        f"model={args.model} fp32 cpu, {len(os.sched_getaffinity(0))} usable cores, torch {torch.__version__}"
    )
    print(f"{'call':38s} {'mode':10s} {'wall s':>7s} {'CPU s':>6s} {'cores':>6s} {'busy':>5s}")
    for name in calls:
        for mode in MODES:
            share = figures[mode, name]
            print(
                f"{name:38s} {mode:10s} {share.wall_s:7.2f} {share.cpu_s:6.2f} {share.cores:6.2f} "
                f"{share.busy_cores:5.2f}"
            )
        quiet, contended = figures["quiet", name], figures["contended", name]
        print(
            f"  contended / quiet: {contended.wall_s / quiet.wall_s:.2f}x wall, "
            f"{contended.cpu_s / quiet.cpu_s:.2f}x CPU seconds"
        )


if __name__ == "__main__":
    main()
