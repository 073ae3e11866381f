"""The panel's progress line: where the current run is and how fast it goes, in one line.

`step 12/40 · 3.1 s/step · ETA 1m27s · trained 410 tok/s · sampled 95 tok/s · computed 23% of tokens ·
loss 12.3`, then, when a pause trigger fired, why the run paused. A run that records rollouts (an RL
run) shows its reward, KL and entropy where the loss would be (`rl_fields`). Seconds per step is the
mean of the last `RECENT_STEPS` steps (the first step is often slower: compilation, caches), the ETA that
times the steps left (a paused run has none: it says "paused"); trained tokens per second counts the
trained tokens (`num_tokens:sum` of the run's `forward_backward` rows), sampled tokens per second the
tokens of the replies its steps recorded with `record_rollouts`, each over the time the run's steps took:
in an RL step sampling often takes most of the time, so the two together say where it goes. Where datums
shared prompts, the share of the submitted tokens the training passes computed (`computed_tokens:sum`
over `submitted_tokens:sum`: each shared prefix is computed once), and the share of the prompt tokens
sampling took from the HF sampler's prompt cache (`prefill_cached_tokens:sum` over
`prefill_tokens:sum`), where it took any. An asynchronous run (`sess.run_async`) adds its last step's
staleness against its bound (`staleness 1/2`: `async/staleness:max` of `max_steps_off_policy`) and, over
the last `RECENT_STEPS` steps, the mean seconds the trainer waited for samples (`async/trainer_wait_s`:
sampling is the bottleneck) and that samples waited for the trainer (`async/sample_wait_s`: training is).
"""

from __future__ import annotations

import html
import math
from typing import TYPE_CHECKING

import ipywidgets

from workbench.notebook.async_run import AsyncRun
from workbench.notebook.run import Run, RunState

if TYPE_CHECKING:
    from workbench.metrics import MetricsHistory
    from workbench.notebook.rollout_log import RolloutLog
    from workbench.notebook.session import Session

RECENT_STEPS = 5


def format_duration(seconds: float) -> str:
    """`42s`, `3m07s`, `2h05m`."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _latest(history: MetricsHistory, name: str, op: str | None, since: float) -> float:
    for row in reversed(history.rows):
        if row["time"] < since:
            break
        if name in row and (op is None or row["op"] == op):
            return float(row[name])
    return math.nan


def sampled_tokens(rollouts: RolloutLog, since_step: int) -> int:
    """The reply tokens of the rollout groups sampled at optimizer step `since_step` or later."""
    total = 0
    for batch in reversed(list(rollouts)):
        if batch and batch[0].step < since_step:
            break
        total += sum(len(sequence.tokens) for group in batch for sequence in group.sequences)
    return total


def async_fields(run: AsyncRun, history: MetricsHistory) -> list[tuple[str, str]]:
    """The line's staleness and wait fields for an asynchronous run's steps (none before its first)."""
    since = run.started_at or 0.0
    steps = [
        row
        for row in history.rows
        if row["time"] >= since and row["op"] == "run_step" and "async/staleness:max" in row
    ][-RECENT_STEPS:]
    if not steps:
        return []
    trainer_wait = sum(row["async/trainer_wait_s"] for row in steps) / len(steps)
    sample_wait = sum(row["async/sample_wait_s"] for row in steps) / len(steps)
    return [
        ("staleness", f"staleness {steps[-1]['async/staleness:max']:.0f}/{run.max_steps_off_policy}"),
        ("trainer-wait", f"trainer waited {trainer_wait:.2f} s/step"),
        ("sample-wait", f"samples waited {sample_wait:.2f} s/step"),
    ]


def supervised_fields(history: MetricsHistory, since: float) -> list[tuple[str, str]]:
    """The latest loss, and a reward where the step function returned one."""
    fields = []
    loss = _latest(history, "loss:sum", "forward_backward", since)
    if math.isfinite(loss):
        fields.append(("loss", f"loss {loss:.4g}"))
    reward = _latest(history, "reward:mean", None, since)
    if not math.isnan(reward):
        fields.append(("reward", f"reward {reward:.3g}"))
    return fields


def rl_fields(history: MetricsHistory, since: float) -> list[tuple[str, str]]:
    """An RL run's latest reward, KL and entropy, where its rows have them. Its loss is left out: a policy
    loss's value is a surrogate (importance sampling's −Σ ρ·A sums to about 0 with advantages centred
    on their group), which says nothing about how the run goes. The KL is the policy's to its reference
    (`kl_policy_reference:mean`, recorded where groups carry reference logprobs), else the sampler's to
    the trainer (`kl_sample_train_v1:mean`: ~0 unless they disagree); the entropy is the policy's on the
    trained tokens (`entropy:mean`, the built-in losses'), else the sampler's (`sampler_entropy:mean`)."""
    fields = []
    reward = _latest(history, "reward:mean", None, since)
    if not math.isnan(reward):
        fields.append(("reward", f"reward {reward:.3g}"))
    for field, label, names in (
        (
            "kl",
            "KL",
            (("kl_policy_reference:mean", "to reference"), ("kl_sample_train_v1:mean", "sampler–trainer")),
        ),
        ("entropy", "entropy", (("entropy:mean", ""), ("sampler_entropy:mean", "sampler"))),
    ):
        for name, which in names:
            value = _latest(history, name, None, since)
            if math.isfinite(value):
                fields.append((field, f"{label} {f'({which}) ' if which else ''}{value:.3g}"))
                break
    return fields


def progress_fields(run: Run, history: MetricsHistory, sampled: int = 0) -> list[tuple[str, str]]:
    """The line's `(field, text)` pairs for `run` (those with no value yet are left out); `sampled` is the
    number of tokens its steps sampled (`sampled_tokens`)."""
    fields = [("run-step", f"step {run.i}/{run.steps}")]
    recent = run.step_seconds[-RECENT_STEPS:]
    if recent:
        per_step = sum(recent) / len(recent)
        fields.append(("seconds-per-step", f"{per_step:.2f} s/step"))
        if run.state is RunState.RUNNING:
            fields.append(("eta", f"ETA {format_duration(per_step * (run.steps - run.i))}"))
        elif run.state is RunState.PAUSED:
            fields.append(("eta", "paused"))
    since = run.started_at or 0.0
    trained_tokens = sum(
        row.get("num_tokens:sum", 0.0)
        for row in history.rows
        if row["time"] >= since and row["op"] == "forward_backward"
    )
    busy_seconds = sum(run.step_seconds)
    if trained_tokens and busy_seconds > 0:
        fields.append(("tokens-per-second", f"trained {trained_tokens / busy_seconds:,.0f} tok/s"))
    if sampled and busy_seconds > 0:
        fields.append(("sampled-tokens-per-second", f"sampled {sampled / busy_seconds:,.0f} tok/s"))
    run_rows = [row for row in history.rows if row["time"] >= since]
    submitted = sum(row.get("submitted_tokens:sum", 0.0) for row in run_rows)
    computed = sum(row.get("computed_tokens:sum", 0.0) for row in run_rows)
    if submitted and computed < submitted:
        fields.append(("computed-tokens", f"computed {computed / submitted:.0%} of tokens"))
    prefilled = sum(row.get("prefill_tokens:sum", 0.0) for row in run_rows)
    cached = sum(row.get("prefill_cached_tokens:sum", 0.0) for row in run_rows)
    if cached:
        fields.append(("prompt-cache", f"prompt cache {cached / prefilled:.0%}"))
    fields += (
        rl_fields(history, since)
        if any(row["op"] == "rollouts" for row in run_rows)
        else supervised_fields(history, since)
    )
    if isinstance(run, AsyncRun):
        fields += async_fields(run, history)
    return fields


def run_alerts(run: Run) -> list[tuple[str, str]]:
    """`(field, text)` for what the run wants its user to see: why it paused on an error (its step
    function raised; the Train tab shows the whole traceback), a step the watchdog names stalled (with
    where it waits), a save that failed, and what
    `wb.check_data` found in its first batch."""
    alerts: list[tuple[str, str]] = []
    if run.error is not None and run.traceback is not None:
        where = "failed" if run.state is RunState.FAILED else f"paused at step {run.i}"
        last = run.traceback.strip().splitlines()[-1]
        alerts.append(("step-error", f"step {run.failed_step} raised, {where}: {last}"))
    stall = run.stall
    if stall is not None:
        alerts.append(("stall", f"stalled: {stall}"))
    if run.save_error is not None:
        alerts.append(("save-error", run.save_error))
    if run.data_problems:
        first = run.data_problems[0]
        more = f" (+{len(run.data_problems) - 1} more)" if len(run.data_problems) > 1 else ""
        alerts.append(("data", f"data check: {first}{more}"))
    return alerts


class ProgressLine:
    """One HTML line under the status bar; empty before the first run."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.widget = ipywidgets.HTML()
        self.widget.add_class("wb-progress-line")

    def refresh(self) -> None:
        run = self.session.current_run
        if run is None:
            self.widget.value = ""
            return
        parts = [
            f'<span data-field="{name}">{html.escape(text)}</span>'
            for name, text in progress_fields(
                run, self.session.history, sampled_tokens(self.session.rollouts, run.started_step)
            )
        ]
        if run.trigger is not None:
            what = "paused by trigger" if run.state is RunState.PAUSED else "trigger fired"
            parts.append(
                f'<span data-field="trigger" style="color:#b00020"><b>{what}:</b> '
                f"{html.escape(str(run.trigger))}</span>"
            )
        parts += [
            f'<span data-field="{name}" style="color:#b00020">{html.escape(text)}</span>'
            for name, text in run_alerts(run)
        ]
        self.widget.value = (
            '<div style="display:flex;flex-wrap:wrap;gap:0 1.2em">' + "".join(parts) + "</div>"
        )
