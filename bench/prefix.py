"""Shared-prefix training: `forward_backward` over group-RL batches with each group's prompt computed once,
against the same engine with sharing off, on SmolLM2-135M.

Cases (importance sampling, fp32, rank-16 LoRA; random token ids, so the prompts of different groups
share nothing):

    long    8 groups x 8 completions, prompt 512, completion 64 tokens (4.5x fewer tokens computed)
    grpo    8 groups x 4 completions, prompt 40, completion 16 tokens (`bench/peers.py`'s GRPO batch)
    header  the same with prompts as a chat template makes them: a 27-token header common to all 8
            (the system prompt), then an 18-token question (`groups_for_streams` chooses the groups)
    none    32 datums of 56 tokens sharing no prefix (the rule finds nothing: today's path)

Each side of each case is a fresh process, run quiet and then with `bench/contention.py`'s busy process
keeping one core busy: it loads the model, runs `--warmup` untimed steps, then `--steps` timed ones,
and reports submitted tokens per second and the step's peak resident memory over the loaded model
(Linux `VmHWM`, reset before the first timed step; on a GPU the peak CUDA allocation). "plain" is the
engine with sharing off (the rule's prefix-pass cost set to infinity), the floor every ratio is
against. Targets: long >= 3.5x and lower peak memory, grpo and header >= 1.5x, none >= 0.98x.

`--rollout`: a 5-turn rollout through the HF sampler (a 200-token first prompt; each turn samples 2
replies of 32 tokens, and the first reply and a 16-token message extend the conversation), in one
process with the prompt cache on and then off (kept at 0 bytes): prompt tokens prefilled, computed,
and the seconds of the 5 sampling calls. Target: computed <= 0.3x without the cache.

    python bench/prefix.py
    python bench/prefix.py --cases grpo none --steps 3
    python bench/prefix.py --rollout
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from contention import MARGIN_S, MAX_SLOWDOWN, MODES, busy_core  # bench/contention.py, beside this script
from memory import peak_resident_mb, reset_peak, resident_mb  # bench/memory.py, beside this script

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

MODEL = "smollm2-135m"
CASES = {  # groups, completions per group, header tokens common to all prompts, prompt tokens, completion tokens
    "long": (8, 8, 0, 512, 64),
    "grpo": (8, 4, 0, 40, 16),
    "header": (8, 4, 27, 45, 16),
    "none": (32, 1, 0, 40, 16),
}
SIDES = ("plain", "shared")
TOKEN_IDS = (1000, 40_000)


def batch(case: str) -> list:
    """The case's datums: each group's completions after its prompt, with the sampler's logprobs and an
    advantage on the completion positions."""
    import workbench as wb

    groups, completions, header_length, prompt_length, completion_length = CASES[case]
    rng = random.Random(0)
    header = [rng.randrange(*TOKEN_IDS) for _ in range(header_length)]
    data = []
    for _ in range(groups):
        prompt = header + [rng.randrange(*TOKEN_IDS) for _ in range(prompt_length - header_length)]
        for _ in range(completions):
            tokens = prompt + [rng.randrange(*TOKEN_IDS) for _ in range(completion_length)]
            completion = [float(i >= prompt_length - 1) for i in range(len(tokens) - 1)]
            advantage = rng.uniform(-1, 1)
            data.append(
                wb.Datum(
                    model_input=wb.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [-2.0 * c for c in completion],
                        "advantages": [advantage * c for c in completion],
                    },
                )
            )
    return data


def measure(case: str, side: str, warmup: int, steps: int) -> dict[str, float]:
    """One fresh process: load, warm up, then the timed steps."""
    import torch

    import workbench as wb
    from workbench.engine.model import shared_prefix

    if side == "plain":
        shared_prefix.PREFIX_PASS_OVERHEAD_TOKENS = math.inf
    data = batch(case)
    with wb.Session(MODEL, wb.LoraConfig(rank=16), seed=0, wandb=False) as session:

        def step() -> None:
            session.policy.forward_backward(data, "importance_sampling").result()

        for _ in range(warmup):
            step()
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated() / 2**20
        loaded = resident_mb()
        reset_peak()
        start = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = (time.perf_counter() - start) / steps
        row = session.history.rows[-1]
        result = {
            "seconds": seconds,
            "tokens_per_second": row["submitted_tokens:sum"] / seconds,
            "computed_share": row["computed_tokens:sum"] / row["submitted_tokens:sum"],
            "step_mb": peak_resident_mb() - loaded,
        }
        if cuda:
            result["cuda_step_mb"] = torch.cuda.max_memory_allocated() / 2**20 - before
        return result


def rollout(turns: int = 5) -> None:
    """The 5-turn rollout with and without the prompt cache; prints what each prefilled."""
    import workbench as wb

    with wb.Session(MODEL, wb.LoraConfig(rank=16), seed=0, wandb=False) as session:
        cache = session.engine.prompt_cache
        figures = {}
        for side, max_bytes in (("without the cache", 0), ("with the cache", cache.max_bytes)):
            cache.max_bytes, cache.entries, cache.bytes = max_bytes, type(cache.entries)(), 0
            before = (cache.stats.prompt_tokens, cache.stats.computed_tokens)
            rng = random.Random(0)
            prompt = [rng.randrange(*TOKEN_IDS) for _ in range(200)]
            client = session.sampling_client()
            start = time.perf_counter()
            for turn in range(turns):
                params = wb.SamplingParams(max_tokens=32, temperature=1.0, seed=turn, stop=[])
                reply = client.sample(prompt, 2, params).result().sequences[0].tokens
                prompt = prompt + list(reply) + [rng.randrange(*TOKEN_IDS) for _ in range(16)]
            seconds = time.perf_counter() - start
            prefilled = cache.stats.prompt_tokens - before[0]
            computed = cache.stats.computed_tokens - before[1]
            figures[side] = computed
            print(f"  {side:18s} prefilled {prefilled} prompt tokens, computed {computed}, {seconds:.2f} s")
        ratio = figures["with the cache"] / figures["without the cache"]
        print(f"  computed with / without the cache: {ratio:.2f}x")


def run_child(case: str, side: str, mode: str, warmup: int, steps: int, bound_s: float) -> dict[str, float]:
    command = [sys.executable, str(Path(__file__)), "--child", case, side, "--warmup", str(warmup)]
    command += ["--steps", str(steps)]

    def child() -> dict[str, float]:
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        return json.loads(output.strip().splitlines()[-1])

    if mode == "quiet":
        return child()
    with busy_core(bound_s) as busy:
        result = child()
    assert busy.core_share is not None
    return {**result, "busy_core_share": busy.core_share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=2, help="timed steps")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rollout", action="store_true", help="the sampler's 5-turn rollout instead")
    parser.add_argument("--child", nargs=2, metavar=("CASE", "SIDE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rollout:
        print(f"{MODEL}, a 5-turn rollout through the HF sampler")
        rollout()
        return
    if args.child:
        print(json.dumps(measure(*args.child, args.warmup, args.steps)))
        return
    print(f"{MODEL}, forward_backward(importance_sampling), {args.warmup} warm-up + {args.steps} timed steps")
    for case in args.cases:
        groups, completions, _, prompt, completion = CASES[case]
        print(f"\n{case}: {groups} x {completions} datums, prompt {prompt}, completion {completion}")
        for mode in args.modes:
            results: dict[str, dict[str, float]] = {}
            quiet_s = 0.0
            for side in SIDES:
                start = time.monotonic()
                results[side] = run_child(
                    case, side, mode, args.warmup, args.steps, MAX_SLOWDOWN * max(quiet_s, 60.0) + MARGIN_S
                )
                quiet_s = time.monotonic() - start
            plain, shared = results["plain"], results["shared"]
            busy = f", busy core share {shared['busy_core_share']:.2f}" if "busy_core_share" in shared else ""
            print(
                f"  {mode:9s} plain {plain['tokens_per_second']:8,.0f} tok/s {plain['step_mb']:7,.0f} MB | "
                f"shared {shared['tokens_per_second']:8,.0f} tok/s {shared['step_mb']:7,.0f} MB "
                f"(computes {shared['computed_share']:.0%}) | "
                f"{shared['tokens_per_second'] / plain['tokens_per_second']:.2f}x tokens/s, "
                f"{shared['step_mb'] / max(plain['step_mb'], 1.0):.2f}x memory{busy}",
                flush=True,
            )


if __name__ == "__main__":
    main()
