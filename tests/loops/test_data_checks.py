"""`wb.check_data` names each silent mask bug in a datum built with it, passes clean data silently, and
a run warns about its first batch."""

from __future__ import annotations

import warnings

import pytest

import workbench as wb
from tests.datums import ce_datum
from workbench.notebook.panel.progress_line import ProgressLine

EOS = 2
TOKENS = [5, 6, 7, 8, 9, EOS]  # a prompt (5, 6, 7) and an answer (8, 9) ending in an end-of-turn token


def _sft(
    tokens: list[int] = TOKENS, weights: list[float] | None = None, targets: list[int] | None = None
) -> wb.Datum:
    """A datum of `tokens` with next-token targets, trained on the answer (positions 2..4) by default."""
    return wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:] if targets is None else targets,
            "weights": [0.0, 0.0, 1.0, 1.0, 1.0] if weights is None else weights,
        },
    )


def _defects(data: list[wb.Datum], **options: object) -> list[tuple[int, str]]:
    return [(problem.index, problem.defect) for problem in wb.check_data(data, end_of_turn=EOS, **options)]


def test_clean_sft_and_rl_data_pass_silently() -> None:
    rl = ce_datum(TOKENS, weights=None, advantages=[0.0, 0.0, 0.5, 0.5, 0.5])
    assert wb.check_data([_sft(), _sft(), rl], end_of_turn=EOS, max_length=64) == []


@pytest.mark.parametrize(
    ("datum", "defect"),
    [
        (_sft(weights=[0.0] * 5), "nothing_trained"),
        (_sft(weights=[1.0] * 5), "prompt_trained"),
        (_sft(weights=[0.0, 0.0, 1.0, 1.0, 0.0]), "last_target_untrained"),
        (_sft(targets=TOKENS[:-1]), "targets_not_shifted"),
        (_sft(targets=[*TOKENS[2:], 0]), "targets_not_shifted"),
        (ce_datum(TOKENS, weights=None, advantages=[0.0] * 5), "advantages_all_zero"),
    ],
)
def test_each_defect_is_named_with_its_datum(datum: wb.Datum, defect: str) -> None:
    found = _defects([_sft(), datum])
    assert (1, defect) in found and all(index == 1 for index, _ in found), found


def test_an_end_of_turn_token_never_trained_is_named() -> None:
    # the answer ends in EOS at position 4, trained at 2 and 3 only; a trailing pad keeps the last target trained
    tokens = [*TOKENS, 0]
    datum = _sft(tokens, weights=[0.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    assert _defects([datum]) == [(0, "end_of_turn_untrained")]
    assert "positions [4]" in str(wb.check_data([datum], end_of_turn=EOS)[0])


def test_the_prompts_own_turn_ends_and_a_reply_cut_at_max_tokens_are_not_named() -> None:
    """An RL datum whose chat prompt holds end-of-turn tokens (untrained: context) and whose sampled
    reply was cut at max_tokens (no end-of-turn in it) trains what it should; the same datum with an
    untrained end-of-turn inside the reply is named."""
    prompt, reply = [5, EOS, 6, EOS, 7], [8, 9, 10]
    tokens = prompt + reply
    advantages = [0.0] * (len(prompt) - 1) + [0.5] * len(reply)
    cut = ce_datum(tokens, weights=None, advantages=advantages)
    assert _defects([cut]) == []
    ended = ce_datum([*tokens, EOS, 11], weights=None, advantages=[*advantages, 0.0, 0.5])
    assert _defects([ended]) == [(0, "end_of_turn_untrained")]


def test_a_datum_longer_than_the_context_is_named() -> None:
    assert _defects([_sft()], max_length=5) == []
    assert _defects([_sft()], max_length=4) == [(0, "too_long")]


def test_a_run_warns_about_its_first_batch_and_keeps_what_it_found(tiny: wb.Session) -> None:
    tokens = tiny.tokenizer("User: hi. Assistant: hello there.").input_ids
    bad = ce_datum(tokens, weights=[0.0] * (len(tokens) - 1))

    def step(sess: wb.Session, i: int) -> None:
        sess.policy.forward_backward([bad], "cross_entropy").result()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = tiny.run(step, 2)
        assert run.wait(60) is wb.RunState.FINISHED
    assert [problem.defect for problem in run.data_problems or []] == ["nothing_trained"]
    said = [str(w.message) for w in caught if "first batch" in str(w.message)]
    assert len(said) == 1 and "datum 0: every weight is 0" in said[0], said
    line = ProgressLine(tiny)  # the panel's progress line says it too
    line.refresh()
    assert "data check: datum 0: every weight is 0" in line.widget.value
