"""In-loop evaluation: a held-out check run every k steps of a run, recorded beside the training metrics.

`sess.run(step_fn, steps, evaluate=eval_fn, eval_every=k)` calls `eval_fn(sess) -> {metric: value}`
before run steps 0, k, 2k, … (step 0 gives the baseline) and once more after the last step, and records
what it returns as history rows of op `"eval"` at the optimizer step the weights had. Plots draw those
rows as their own line (`run/eval`), so a held-out `reward:mean` sits next to the sampled one; W&B gets
them under `run/eval/...`; `pause_if` rules see them like any row of the step.

The evaluation runs on the run's thread inside the step, so pause, stop and triggers treat a step and
its evaluation as one. It must not train: it samples or calls `forward` on held-out data.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from workbench.notebook.run import RUN_MODEL, StepFn

if TYPE_CHECKING:
    from workbench.notebook.session import Session

EvalFn = Callable[["Session"], Mapping[str, float]]
"""`eval_fn(sess) -> metrics`: a held-out evaluation of the current weights."""

EVAL_OP = "eval"


def record_evaluation(sess: Session, evaluate: EvalFn) -> dict[str, float]:
    """Run `evaluate(sess)` and record its metrics as an `"eval"` row at the current optimizer step."""
    metrics = evaluate(sess)
    if not isinstance(metrics, Mapping):
        raise TypeError(f"evaluate must return a dict of metrics, got {type(metrics).__name__}")
    sess.engine.record(EVAL_OP, RUN_MODEL, sess.step, metrics).result()
    return dict(metrics)


def with_evaluation(step_fn: StepFn, evaluate: EvalFn, every: int) -> StepFn:
    """`step_fn` with `evaluate` run before steps 0, every, 2·every, … and after the run's last step."""
    if not callable(evaluate):
        raise TypeError(f"evaluate must be a function eval_fn(sess) -> metrics, got {evaluate!r}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"eval_every must be a positive integer, got {every!r}")

    @functools.wraps(step_fn)
    def step(sess: Session, i: int) -> Mapping[str, float] | None:
        if i % every == 0:
            record_evaluation(sess, evaluate)
        metrics = step_fn(sess, i)
        run = sess.current_run
        if run is not None and i + 1 == run.steps:
            record_evaluation(sess, evaluate)
        return metrics

    return step
