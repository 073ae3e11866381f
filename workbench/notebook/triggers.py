"""Pause triggers: a run pauses itself at the step where a watched metric crosses a line.

Entropy collapse, KL blow-ups and reward hacking are usually found after the fact, in a plot, many
steps after they began. `sess.run(step_fn, steps, pause_if={...})` watches the metrics each step
records and pauses the run at the end of the first step where one crosses its threshold, so the
samples and weights that crossed are still there to look at (`run.trigger` says which metric, its
value and the step); `run.resume()` goes on, `run.stop()` ends it.

    pause_if={"kl_policy_reference:mean": ("above", 0.5), "entropy:mean": ("below", 0.05)}

A rule is `metric: ("above" | "below", threshold)`, the metric named as in the history (`sess.history.
names()`), read from every row the step recorded (its operations', `record_rollouts`' and the step
function's own). A NaN value also fires the rule: a diverged metric is a reason to stop and look.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Direction = Literal["above", "below"]
PauseIf = Mapping[str, tuple[Direction, float]]
"""What `Session.run(pause_if=...)` takes: `{metric: ("above" | "below", threshold)}`."""


@dataclass(frozen=True)
class PauseRule:
    """Pause when `metric` is strictly above (or below) `threshold`, or NaN."""

    metric: str
    direction: Direction
    threshold: float

    def crossed(self, value: float) -> bool:
        if math.isnan(value):
            return True
        return value > self.threshold if self.direction == "above" else value < self.threshold


@dataclass(frozen=True)
class Trigger:
    """A rule that fired: the value seen, the history row's step and the run's step index."""

    rule: PauseRule
    value: float
    step: int
    run_step: int

    def __str__(self) -> str:
        return (
            f"{self.rule.metric} = {self.value:.4g} ({self.rule.direction} {self.rule.threshold:g}) "
            f"at run step {self.run_step} (optimizer step {self.step})"
        )


def pause_rules(pause_if: PauseIf | None) -> list[PauseRule]:
    """The rules of a `pause_if` mapping; raises ValueError naming the first malformed rule."""
    if pause_if is None:
        return []
    if not isinstance(pause_if, Mapping):
        raise ValueError(
            f"pause_if must be a dict {{metric: ('above' | 'below', threshold)}}, got {pause_if!r}"
        )
    rules = []
    for metric, rule in pause_if.items():
        if not isinstance(metric, str):
            raise ValueError(f"pause_if keys must be metric names, got {metric!r}")
        if not (isinstance(rule, tuple | list) and len(rule) == 2 and rule[0] in ("above", "below")):
            raise ValueError(f"pause_if[{metric!r}] must be ('above' | 'below', threshold), got {rule!r}")
        threshold = rule[1]
        if (
            isinstance(threshold, bool)
            or not isinstance(threshold, int | float)
            or not math.isfinite(threshold)
        ):
            raise ValueError(
                f"pause_if[{metric!r}] needs a finite number as its threshold, got {threshold!r}"
            )
        rules.append(PauseRule(metric, rule[0], float(threshold)))
    return rules


def first_trigger(
    rules: Iterable[PauseRule], rows: Iterable[Mapping[str, Any]], run_step: int
) -> Trigger | None:
    """The first rule, in row order, that one of `rows` crosses; None when none does."""
    rules = list(rules)
    for row in rows:
        for rule in rules:
            if rule.metric in row and rule.crossed(float(row[rule.metric])):
                return Trigger(rule, float(row[rule.metric]), int(row["step"]), run_step)
    return None
