"""Training data checked before step 0: the silent mask bugs that train the wrong tokens.

A datum can be well formed (every loss accepts it) and still teach the wrong thing: the prompt trained
along with the answer, an end-of-turn token never trained (the model never learns to stop; only one
at or after the first trained target counts, since a prompt's own turn ends are context), targets
that are not the next tokens (an off-by-one in the shift), an RL batch whose advantages are all 0
(its group's rewards tied: no gradient), or a sequence longer than the model reads. `check_data`
names each such datum and what is wrong with it; clean data gives an empty list. A run checks its
first batch the same way and warns (`workbench.notebook.run`).

Each check looks only at what the datum carries: `model_input`, `target_tokens`, `weights`,
`advantages` (a datum without `weights` trains where its advantage is not 0 when it has advantages,
as the RL losses read it, and every position otherwise, as `cross_entropy` does).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from workbench.types import Datum

DEFECTS = {
    "nothing_trained": "every weight is 0: the datum trains nothing",
    "prompt_trained": "every weight is 1: the prompt is trained along with the answer",
    "last_target_untrained": "the last target token has weight 0: the answer's end is never learnt",
    "end_of_turn_untrained": "no end-of-turn token among the targets is trained: the model never learns to stop",
    "targets_not_shifted": "target_tokens are not model_input shifted by one",
    "advantages_all_zero": "every advantage is 0: the RL datum gives no gradient",
    "too_long": "the sequence is longer than the model's context",
}
"""Each defect's name and what it means."""


@dataclasses.dataclass(frozen=True)
class DataProblem:
    """One defect of one datum: its `index` in the batch, the defect's name (a key of `DEFECTS`) and a
    sentence saying what was found."""

    index: int
    defect: str
    detail: str

    def __str__(self) -> str:
        return f"datum {self.index}: {self.detail}"


def check_data(
    data: Sequence[Datum],
    *,
    end_of_turn: int | Sequence[int] | None = None,
    max_length: int | None = None,
) -> list[DataProblem]:
    """The defects of `data`, datum by datum; an empty list for clean data.

    Args:
        data: The batch, as `forward_backward` takes it.
        end_of_turn: The end-of-turn token id(s) (the tokenizer's `eos_token_id`): a datum whose
            targets hold one and train none is named. None: not checked.
        max_length: The model's context (`sess.base_info.max_length`): a longer datum is named.
    """
    stops = {end_of_turn} if isinstance(end_of_turn, int) else set(end_of_turn or ())
    return [
        DataProblem(index, defect, DEFECTS[defect] + found)
        for index, datum in enumerate(data)
        for defect, found in _defects(datum, stops, max_length)
    ]


def _defects(datum: Datum, stops: set[int], max_length: int | None) -> list[tuple[str, str]]:
    """`(defect, what was found)` for each defect of one datum."""
    inputs = datum.loss_fn_inputs
    tokens_T = datum.model_input.to_ints()
    advantages_T = inputs["advantages"].tolist() if "advantages" in inputs else None
    if "weights" in inputs:
        weights_T = inputs["weights"].tolist()
    elif advantages_T is not None:  # an RL loss trains where the advantage is not 0
        weights_T = [float(a != 0) for a in advantages_T]
    else:
        weights_T = [1.0] * len(tokens_T)
    found: list[tuple[str, str]] = []
    if advantages_T is not None and not any(a != 0 for a in advantages_T):
        found.append(("advantages_all_zero", ""))
    elif weights_T and all(w == 0 for w in weights_T):
        found.append(("nothing_trained", ""))
    elif len(weights_T) > 1 and all(w == 1 for w in weights_T):
        found.append(("prompt_trained", ""))
    elif weights_T and weights_T[-1] == 0:
        found.append(("last_target_untrained", ""))
    if "target_tokens" in inputs:
        targets_T = inputs["target_tokens"].tolist()
        # position i reads tokens_T[: i + 1] and predicts the next token: targets_T[i] == tokens_T[i + 1]
        if len(targets_T) != len(tokens_T) or targets_T[:-1] != tokens_T[1:]:
            shift = next((s for s in (0, 2) if targets_T[: len(tokens_T) - s] == tokens_T[s:]), None)
            found.append(("targets_not_shifted", "" if shift is None else f" (they are shifted by {shift})"))
        # the end of a turn inside the trained span or after it: a prompt's own turn ends (before the
        # first trained target) are context, and a sampled reply cut at max_tokens has no end at all
        first_trained = next((i for i, w in enumerate(weights_T) if w), len(weights_T))
        stop_positions = [i for i, token in enumerate(targets_T) if token in stops and i >= first_trained]
        if stop_positions and not any(weights_T[i] for i in stop_positions):
            found.append(("end_of_turn_untrained", f" (at positions {stop_positions})"))
    if max_length is not None and len(tokens_T) > max_length:
        found.append(("too_long", f" ({len(tokens_T)} tokens > {max_length})"))
    return found
