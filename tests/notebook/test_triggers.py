"""Pause triggers: `sess.run(..., pause_if=...)` pauses at the step whose rows cross a rule, says why,
and resumes; malformed rules are refused before the run starts."""

from __future__ import annotations

import math

import pytest

import workbench as wb
from workbench.notebook.triggers import PauseRule, first_trigger, pause_rules

WAIT_S = 30.0


def _metric_steps(values: list[float]) -> wb.notebook.run.StepFn:
    def step(sess: wb.Session, i: int) -> dict[str, float]:
        return {"kl:mean": values[i], "entropy:mean": 1.0}

    return step


def test_a_run_pauses_at_the_step_that_crosses_and_resumes(tiny: wb.Session) -> None:
    run = tiny.run(
        _metric_steps([0.1, 0.2, 0.7, 0.3, 0.9, 0.1]),
        6,
        pause_if={"kl:mean": ("above", 0.5), "entropy:mean": ("below", 0.05)},
    )
    assert run.wait(WAIT_S) is wb.RunState.PAUSED
    assert run.i == 3  # steps 0, 1, 2 ran; step 2 crossed
    assert run.trigger is not None and run.trigger.run_step == 2 and run.trigger.value == pytest.approx(0.7)
    assert "kl:mean = 0.7 (above 0.5) at run step 2" in str(run.trigger)
    run.resume()
    assert run.trigger is None
    assert run.wait(WAIT_S) is wb.RunState.PAUSED and run.i == 5 and run.trigger.run_step == 4
    run.step()  # a single step that does not cross stays paused, as single steps do
    assert run.wait(WAIT_S) is wb.RunState.FINISHED and run.i == 6
    assert len(run.step_seconds) == 6


def test_below_and_nan_fire_and_an_untouched_rule_never_does(tiny: wb.Session) -> None:
    def step(sess: wb.Session, i: int) -> dict[str, float]:
        return {"entropy:mean": [0.5, 0.01, math.nan][i]}

    run = tiny.run(step, 3, pause_if={"entropy:mean": ("below", 0.05), "absent:mean": ("above", 0.0)})
    assert run.wait(WAIT_S) is wb.RunState.PAUSED and run.i == 2
    assert run.trigger is not None and run.trigger.rule == PauseRule("entropy:mean", "below", 0.05)
    run.resume()
    assert run.wait(WAIT_S) is wb.RunState.FINISHED
    assert run.trigger is not None and math.isnan(run.trigger.value)  # NaN fires on the last step too


def test_operation_rows_of_the_step_are_watched(tiny: wb.Session) -> None:
    """A trigger reads the loss the step's own forward_backward recorded, not only returned metrics."""
    data = [
        wb.Datum(
            model_input=wb.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
    ]
    run = tiny.run(wb.train_step(data), 3, pause_if={"loss:sum": ("above", 0.0)})
    assert run.wait(WAIT_S) is wb.RunState.PAUSED and run.i == 1
    assert run.trigger is not None and run.trigger.rule.metric == "loss:sum" and run.trigger.step == 0
    run.stop()
    assert run.wait(WAIT_S) is wb.RunState.STOPPED


@pytest.mark.parametrize(
    ("pause_if", "message"),
    [
        ({"kl:mean": ("over", 0.5)}, "must be"),
        ({"kl:mean": ("above", math.inf)}, "finite number"),
        ({"kl:mean": 0.5}, "must be"),
        (["kl:mean"], "must be a dict"),
    ],
)
def test_malformed_rules_are_refused_before_the_run_starts(
    tiny: wb.Session, pause_if: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        tiny.run(_metric_steps([0.0]), 1, pause_if=pause_if)  # type: ignore[arg-type]
    assert tiny.current_run is None


def test_first_trigger_reads_rows_in_order() -> None:
    rules = pause_rules({"a": ("above", 1.0), "b": ("below", 0.0)})
    rows = [{"step": 3, "b": -1.0}, {"step": 3, "a": 2.0}]
    found = first_trigger(rules, rows, run_step=7)
    assert found is not None and found.rule.metric == "b" and found.run_step == 7
    assert first_trigger(rules, [{"step": 0, "a": 1.0, "b": 0.0}], run_step=0) is None  # strict


def test_an_evaluation_runs_every_k_steps_and_after_the_last(tiny: wb.Session) -> None:
    """`evaluate` before steps 0, 2, 4 and after the last (step 5), at the weights' optimizer step; its
    rows are their own `run/eval` line, and triggers watch them."""
    data = [
        wb.Datum(
            model_input=wb.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
    ]
    held_out = [
        wb.Datum(
            model_input=wb.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]},
        )
    ]
    calls = []

    def evaluate(sess: wb.Session) -> dict[str, float]:
        calls.append(sess.step)
        out = sess.policy.forward(held_out, "cross_entropy").result()
        return {"held_out_loss:sum": out.metrics["loss:sum"]}

    run = tiny.run(
        wb.train_step(data), 5, adam_params={"learning_rate": 1e-2}, evaluate=evaluate, eval_every=2
    )
    assert run.wait(WAIT_S) is wb.RunState.FINISHED, run.traceback
    assert calls == [0, 2, 4, 5]
    steps, losses = tiny.history.series("held_out_loss:sum", op="eval")
    assert steps == [0, 2, 4, 5] and losses[-1] < losses[0]  # training on the same tokens lowers it
    from workbench.notebook.plots import metric_lines

    assert "run/eval" in metric_lines(tiny.history, "held_out_loss:sum")

    # a trigger on the held-out metric pauses the run at the step whose evaluation crossed
    run = tiny.run(
        wb.train_step(data),
        6,
        evaluate=evaluate,
        eval_every=3,
        pause_if={"held_out_loss:sum": ("below", 1e9)},
    )
    assert (
        run.wait(WAIT_S) is wb.RunState.PAUSED
        and run.i == 1
        and run.trigger.rule.metric == "held_out_loss:sum"
    )
    run.stop()
    run.wait(WAIT_S)
    with pytest.raises(ValueError, match="eval_every"):
        tiny.run(wb.train_step(data), 2, evaluate=evaluate, eval_every=0)
