"""Group RL batches where only some groups train: `forward_backward` when k of the GRPO batch's 8 groups
have an advantage and the rest have none (every completion got the same reward), against the same batch
with all 8 training, the floor measured in the same process.

A datum whose advantages are all 0 has no gradient, so the engine computes it forward only, about a
third of a trained datum's cost (`workbench.engine.local.forward_backward.run_loss`). So a call that
trains k of 8 groups should never take longer than one that trains all 8; on a CPU's streams the
forward-only passes must fill the time a stream would otherwise wait. Target: k of 8 / 8 of 8 <= 1.0
for every k, quiet and with one core busy.

The batch is `bench/prefix.py`'s `grpo` case (8 groups x 4 completions, prompt 40, completion 16,
random token ids), importance sampling, SmolLM2-135M, fp32, rank-16 LoRA. The calls are interleaved
(all 8, then each k, `--rounds` times) and each figure is a median, so a slow spell of the machine
touches every figure alike.

    python bench/gradient_free.py
    python bench/gradient_free.py --rounds 5 --modes quiet
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from contention import MARGIN_S, MAX_SLOWDOWN, MODES, busy_core  # bench/contention.py, beside this script
from prefix import CASES, MODEL, batch  # bench/prefix.py, beside this script

TRAINING_GROUPS = (8, 6, 4, 1)


def measure(rounds: int) -> dict[int, float]:
    """One process: a warm-up call, then `rounds` rounds of one call per k; the median seconds per k."""
    import workbench as wb

    data = batch("grpo")
    groups, completions, *_ = CASES["grpo"]
    seconds: dict[int, list[float]] = {k: [] for k in TRAINING_GROUPS}
    with wb.Session(MODEL, wb.LoraConfig(rank=16), seed=0, wandb=False) as session:

        def call(k: int) -> float:
            """The batch with the advantages of every group from the k-th on set to 0."""
            trained = k * completions
            part = [
                datum
                if index < trained
                else wb.Datum(
                    model_input=datum.model_input,
                    loss_fn_inputs={
                        **datum.loss_fn_inputs,
                        "advantages": [0.0] * datum.model_input.length,
                    },
                )
                for index, datum in enumerate(data)
            ]
            start = time.perf_counter()
            session.policy.forward_backward(part, "importance_sampling").result()
            return time.perf_counter() - start

        call(groups)
        for _ in range(rounds):
            for k in TRAINING_GROUPS:
                seconds[k].append(call(k))
    return {k: statistics.median(values) for k, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="timed calls per k")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds)))
        return
    command = [sys.executable, str(Path(__file__)), "--child", "--rounds", str(args.rounds)]

    def child() -> dict[int, float]:
        output = subprocess.run(command, check=True, capture_output=True, text=True).stdout
        return {int(k): v for k, v in json.loads(output.strip().splitlines()[-1]).items()}

    print(
        f"{MODEL}, forward_backward(importance_sampling) of 8 groups x 4, k groups training, {args.rounds} rounds"
    )
    quiet_s = 60.0
    for mode in args.modes:
        start = time.monotonic()
        if mode == "quiet":
            seconds, busy = child(), ""
        else:
            with busy_core(MAX_SLOWDOWN * quiet_s + MARGIN_S) as core:
                seconds = child()
            busy = f", busy core share {core.core_share:.2f}"
        quiet_s = time.monotonic() - start
        floor = seconds[8]
        ratios = ", ".join(
            f"{k} of 8: {seconds[k]:.2f} s ({seconds[k] / floor:.2f}x)" for k in TRAINING_GROUPS[1:]
        )
        print(f"  {mode:9s} 8 of 8: {floor:.2f} s | {ratios}{busy}", flush=True)


if __name__ == "__main__":
    main()
