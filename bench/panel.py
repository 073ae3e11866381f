"""What a live panel costs a run: steps/s of the same SFT run with no panel, one, and two.

The run is `sess.run(wb.train_step(data), steps)` on one session; a panel (`sess.panel(...)`, its
Metrics tab open, plotting loss and grad norm) refreshes from its own timer thread while the run trains, as
it does in a notebook, so it takes GIL time from the run's thread. The floor is the same run with no
panel, timed alternately with the panelled runs in the same process (median of the rounds). Budget: one
panel costs at most 5% of steps/s on the tiny model, nothing measurable on SmolLM2-135M. Measured
quiet and with `bench/contention.py`'s busy process keeping one core busy.

    python bench/panel.py --model tiny
    python bench/panel.py --model smollm2-135m --steps 6 --rounds 2
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("MPLBACKEND", "Agg")

from contention import MODES, quiet_and_contended  # bench/contention.py, beside this script

import workbench as wb

SETTINGS = {"tiny": {"steps": 300, "rounds": 3}, "smollm2-135m": {"steps": 8, "rounds": 2}}
PANELS = (0, 1, 2)


def sft_data(sess: wb.Session) -> list[wb.Datum]:
    tok = sess.tokenizer
    data = []
    for prompt, completion in (("User: Hello!", " Assistant: Hi there."), ("The quick brown fox", " jumps.")):
        prompt_ids, completion_ids = tok(prompt).input_ids, tok(completion).input_ids
        tokens = prompt_ids + completion_ids
        weights = [0.0] * len(prompt_ids) + [1.0] * len(completion_ids)
        data.append(
            wb.Datum(
                model_input=wb.ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights[1:]},
            )
        )
    return data


def steps_per_second(sess: wb.Session, data: list[wb.Datum], steps: int, panels: int) -> float:
    """One run of `steps` steps with `panels` live panels; the panels are closed after it."""
    shown = [sess.panel(train_data=data, metrics=("loss:sum", "grad_norm")) for _ in range(panels)]
    for panel in shown:
        panel.tabs.selected_index = panel.tab_index(
            "Metrics"
        )  # the costly view: its plot redrawn as the run trains
    try:
        started = time.perf_counter()
        run = sess.run(wb.train_step(data), steps, adam_params=wb.AdamParams(learning_rate=1e-4))
        run.wait()
        return steps / (time.perf_counter() - started)
    finally:
        for panel in shown:
            panel.close()
        gc.collect()


def measure(sess: wb.Session, data: list[wb.Datum], steps: int, rounds: int) -> dict[int, float]:
    """Median steps/s per panel count, the counts alternating within each round."""
    rates: dict[int, list[float]] = {n: [] for n in PANELS}
    steps_per_second(sess, data, max(steps // 10, 2), 1)  # warm: the first plot, the first step
    for _ in range(rounds):
        for panels in PANELS:
            rates[panels].append(steps_per_second(sess, data, steps, panels))
    return {n: statistics.median(r) for n, r in rates.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(SETTINGS))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or SETTINGS[args.model]["steps"]
    rounds = args.rounds or SETTINGS[args.model]["rounds"]
    sess = wb.Session(args.model, wb.LoraConfig(rank=4), wandb=False)
    data = sft_data(sess)
    both = quiet_and_contended(lambda: measure(sess, data, steps, rounds))
    print(f"{args.model}: SFT run of {steps} steps, median of {rounds} rounds")
    for mode, rates in zip(MODES, (both.quiet, both.contended), strict=True):
        floor = rates[0]
        cells = ", ".join(
            f"{n} panel{'s' if n != 1 else ''} {rates[n]:.1f} steps/s ({rates[n] / floor:.3f}×)"
            for n in PANELS
        )
        print(f"  {mode}: {cells}")
    print(f"  {both.describe()}")
    sess.close()


if __name__ == "__main__":
    main()
