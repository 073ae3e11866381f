"""What a sweep costs: four SFT configurations (learning rates 3e-3, 1e-3, 3e-4, 1e-4; one datum a step)
trained three ways, each in a fresh child process, so that one way's memory never counts in another's:

- `sweep`: one session, `sess.sweep(step, 4 configs, steps)`: four LoRA members on one base, in turn;
- `sequential`: one session, four `sess.run`s one after another, the policy reset to its initial state
  (`load_state`) before each;
- `sessions`: four sessions held at once in one process (four bases, one Python runtime), their runs
  going at the same time;
- `kernels`: four processes at once, one session and one run each, as four notebooks' kernels would
  be: their peak resident memories summed, the slowest one's wall time.

Each child reports its wall time (from the first session's creation to the last step, base loads
included) and its peak resident memory (`ru_maxrss`, the process's high-water mark). The parent
prints the figures and the ratios. Targets: sweep time <= 1.05x sequential, sweep memory <= 0.4x
four separate sessions (both baselines printed: four in one process share its runtime, four kernels do
not). On a shared machine the times are noisy: `--repeat` runs each way that many times, keeping
the fastest (noise only ever slows a run down) and the largest peak.

    python bench/sweep.py --model tiny
    python bench/sweep.py --model smollm2-135m --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

LEARNING_RATES = (3e-3, 1e-3, 3e-4, 1e-4)
WAYS = ("sweep", "sequential", "sessions", "kernels")
"""How the four configurations are trained; `kernels` runs the `single` child four times at once."""
CHILDREN = (*WAYS[:3], "single")
RANK = 8


def _child(way: str, model: str, steps: int, folder: Path, learning_rate: float) -> dict[str, float]:
    """Train the four configurations `way` (`single`: the one at `learning_rate`); the wall time and this
    process's peak RSS."""
    import workbench as wb
    from tests.datums import sft_datum

    def step(sess: wb.Session, i: int) -> None:
        run = sess.current_run
        assert run is not None
        datum = sft_datum(sess.tokenizer, f"User: question {i % 8}.", f" Assistant: answer {i % 8 * 7}.")
        sess.policy.forward_backward([datum], "cross_entropy").result()
        sess.policy.optim_step(run.adam_params).result()

    def session(name: str) -> wb.Session:
        return wb.Session(model, wb.LoraConfig(rank=RANK), seed=0, model_dir=folder / name, wandb=False)

    started = time.perf_counter()
    if way == "sweep":
        with session("sweep") as sess:
            sweep = sess.sweep(step, wb.grid(learning_rate=list(LEARNING_RATES)), steps)
            assert sweep.wait() is wb.RunState.FINISHED
    elif way == "single":
        with session("single") as sess:
            run = sess.run(step, steps, adam_params={"learning_rate": learning_rate})
            assert run.wait() is wb.RunState.FINISHED, run.traceback
    elif way == "sequential":
        with session("sequential") as sess:
            initial = sess.policy.save_state("initial").result().path
            for lr in LEARNING_RATES:
                sess.load_state(initial)
                run = sess.run(step, steps, adam_params={"learning_rate": lr})
                assert run.wait() is wb.RunState.FINISHED, run.traceback
    else:
        sessions = [session(f"session-{k}") for k in range(len(LEARNING_RATES))]
        try:
            runs = [
                s.run(step, steps, adam_params={"learning_rate": lr})
                for s, lr in zip(sessions, LEARNING_RATES, strict=True)
            ]
            assert all(run.wait() is wb.RunState.FINISHED for run in runs)
        finally:
            for s in sessions:
                s.close()
    wall = time.perf_counter() - started
    return {"wall_s": wall, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def _command(way: str, model: str, steps: int, folder: str, learning_rate: float = 0.0) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--child",
        way,
        "--model",
        model,
        "--steps",
        str(steps),
        "--folder",
        folder,
        "--learning-rate",
        str(learning_rate),
    ]


def _measure(way: str, model: str, steps: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        if way != "kernels":
            output = subprocess.run(
                _command(way, model, steps, folder), check=True, capture_output=True, text=True
            ).stdout
            return json.loads(output.strip().splitlines()[-1])
        children = [
            subprocess.Popen(
                _command("single", model, steps, f"{folder}/{k}", rate), stdout=subprocess.PIPE, text=True
            )
            for k, rate in enumerate(LEARNING_RATES)
        ]
        results = []
        for child in children:
            output, _ = child.communicate()
            assert child.returncode == 0, f"a kernel child failed with {child.returncode}"
            results.append(json.loads(output.strip().splitlines()[-1]))
    return {
        "wall_s": max(r["wall_s"] for r in results),
        "peak_rss_bytes": sum(r["peak_rss_bytes"] for r in results),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=50, help="steps per configuration")
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--child", choices=CHILDREN, help=argparse.SUPPRESS)
    parser.add_argument("--learning-rate", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--folder", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(_child(args.child, args.model, args.steps, args.folder, args.learning_rate)))
        return
    best: dict[str, dict[str, float]] = {}
    for _ in range(args.repeat):
        for way in WAYS:
            measured = _measure(way, args.model, args.steps)
            kept = best.setdefault(way, measured)
            kept["wall_s"] = min(kept["wall_s"], measured["wall_s"])
            kept["peak_rss_bytes"] = max(kept["peak_rss_bytes"], measured["peak_rss_bytes"])
    print(f"{args.model}: 4 configurations x {args.steps} steps, rank {RANK}")
    for way in WAYS:
        print(
            f"  {way:<11} {best[way]['wall_s']:8.1f} s   peak RSS {best[way]['peak_rss_bytes'] / 2**20:8.0f} MiB"
        )
    time_ratio = best["sweep"]["wall_s"] / best["sequential"]["wall_s"]
    print(f"  sweep time / sequential time:             {time_ratio:.2f}x (target <= 1.05x)")
    for way, what in (("sessions", "4 sessions in one process"), ("kernels", "4 kernels")):
        ratio = best["sweep"]["peak_rss_bytes"] / best[way]["peak_rss_bytes"]
        print(f"  sweep memory / {what + ' memory:':<35}{ratio:.2f}x (target <= 0.40x)")


if __name__ == "__main__":
    main()
