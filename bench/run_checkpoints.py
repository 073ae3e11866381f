"""What `save_every` costs a run: steps per second of an SFT run (one datum a step) with run
checkpoints every `--save-every` steps (default 100, the recommended cadence `RECOMMENDED_SAVE_EVERY`)
against none, on the same session's model, in one process. A run with `save_every` also saves at its
start and its end, so the default `--steps` 400 holds five saves (steps 0, 100, 200, 300, 400).
Each configuration runs twice, alternating, and the faster of its two is kept (a shared machine's
noise only ever slows a run down). Target: the checkpointed run within 5% of the plain one.

    python bench/run_checkpoints.py --model tiny
    python bench/run_checkpoints.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")

import workbench as wb
from tests.datums import sft_datum
from workbench.notebook.run_checkpoints import RECOMMENDED_SAVE_EVERY


def _steps_per_second(model: str, folder: Path, steps: int, save_every: int | None) -> float:
    with wb.Session(model, wb.LoraConfig(rank=8), seed=0, model_dir=folder, wandb=False) as sess:
        data = [
            sft_datum(sess.tokenizer, f"User: question {k}.", f" Assistant: answer {k * 7}.")
            for k in range(8)
        ]

        def step(s: wb.Session, i: int) -> None:
            run = s.current_run
            assert run is not None
            s.policy.forward_backward([data[i % len(data)]], "cross_entropy").result()
            s.policy.optim_step(run.adam_params).result()

        started = time.perf_counter()
        run = sess.run(step, steps, save_every=save_every)
        assert run.wait() is wb.RunState.FINISHED, run.traceback
        return steps / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=4 * RECOMMENDED_SAVE_EVERY)
    parser.add_argument("--save-every", type=int, default=RECOMMENDED_SAVE_EVERY)
    args = parser.parse_args()
    best: dict[str, float] = {"none": 0.0, f"save_every={args.save_every}": 0.0}
    with tempfile.TemporaryDirectory() as root:
        for attempt in range(2):
            for label, every in (("none", None), (f"save_every={args.save_every}", args.save_every)):
                rate = _steps_per_second(args.model, Path(root) / f"{label}-{attempt}", args.steps, every)
                best[label] = max(best[label], rate)
    plain, saved = best.values()
    for label, rate in best.items():
        print(f"{args.model:>14}  {label:>14}  {rate:7.2f} steps/s")
    print(f"{args.model:>14}  cost of save_every={args.save_every}: {1 - saved / plain:+.1%} (target <= 5%)")


if __name__ == "__main__":
    main()
