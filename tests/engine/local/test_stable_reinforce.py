"""`stable_reinforce` end to end: samples recorded with `record_stability_info=True`, datums naming
them through Tinker's provenance spans, and every way such a datum can be wrong refused before
anything is queued."""

from __future__ import annotations

import dataclasses
import time

import pytest
import tinker

import workbench as wb
from workbench.engine.local import stability_records


def _sample(session: wb.Session, record: bool = True, num_samples: int = 2) -> tuple[list[int], list]:
    client = session.policy.save_weights_and_get_sampling_client(record_stability_info=record).result()
    prompt = session.tokenizer("two plus two is").input_ids
    response = client.sample(
        wb.ModelInput.from_ints(prompt), num_samples, wb.SamplingParams(max_tokens=6, stop=[], seed=3)
    ).result()
    return prompt, list(response.sequences)


def _datum(prompt: list[int], sequence: wb.SampledSequence, advantage: float) -> wb.Datum:
    """The cookbook's layout (`rl_loop.py`): the input is the prompt and all but the last sampled token;
    targets are shifted by one; prompt positions carry no advantage."""
    tokens = prompt + sequence.tokens
    n_prompt = len(prompt) - 1
    datum = wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "advantages": [0.0] * n_prompt + [advantage] * len(sequence.tokens),
            "logprobs": [0.0] * n_prompt + sequence.logprobs,
        },
    )
    sid = sequence.sequence_id
    return datum.with_provenance(
        model_input=[
            wb.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
            wb.SampledProvenanceSpan(sequence_id=sid, length=len(sequence.tokens) - 1),
        ],
        loss_fn_inputs=[
            wb.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
            wb.SampledProvenanceSpan(sequence_id=sid, length=len(sequence.tokens)),
        ],
    )


def test_on_policy_it_is_reinforce_on_the_sampled_tokens(tiny: wb.Session) -> None:
    prompt, sequences = _sample(tiny)
    assert len({s.sequence_id for s in sequences}) == 2 and all(s.sequence_id for s in sequences)
    data = [_datum(prompt, sequences[0], 1.0), _datum(prompt, sequences[1], -0.5)]
    out = tiny.policy.forward_backward(data, "stable_reinforce").result()
    # On-policy the recorded logprobs equal the learner's, so the weight is 1 and the loss is
    # -Σ A_t log p(x_t) over the sampled targets only.
    expected = 0.0
    for output, sequence, advantage in zip(out.loss_fn_outputs, sequences, (1.0, -0.5), strict=True):
        learner = output["logprobs"].tolist()[-len(sequence.tokens) :]
        assert learner == pytest.approx(sequence.logprobs, abs=1e-5)
        expected += -advantage * sum(learner)
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-5)
    assert out.metrics["ratio:mean"] == pytest.approx(1.0, abs=1e-4)
    assert tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result().applied


def test_the_sdks_own_datums_and_spans_are_accepted(tiny: wb.Session) -> None:
    prompt, sequences = _sample(tiny, num_samples=1)
    ours = _datum(prompt, sequences[0], 1.0)
    sdk = tinker.Datum(
        model_input=tinker.ModelInput.from_ints(ours.model_input.to_ints()),
        loss_fn_inputs={key: value.tolist() for key, value in ours.loss_fn_inputs.items()},
    ).with_provenance(
        model_input=[
            (
                tinker.PromptProvenanceSpan
                if isinstance(s, wb.PromptProvenanceSpan)
                else tinker.SampledProvenanceSpan
            )(sequence_id=s.sequence_id, offset=s.offset, length=s.length)
            for s in ours.model_input_spans
        ],
        loss_fn_inputs=[
            (
                tinker.PromptProvenanceSpan
                if isinstance(s, wb.PromptProvenanceSpan)
                else tinker.SampledProvenanceSpan
            )(sequence_id=s.sequence_id, offset=s.offset, length=s.length)
            for s in ours.loss_fn_input_spans
        ],
    )
    assert (
        tiny.policy.forward([sdk], "stable_reinforce").result().metrics["loss:sum"]
        == tiny.policy.forward([ours], "stable_reinforce").result().metrics["loss:sum"]
    )


def _with(datum: wb.Datum, **changes: object) -> wb.Datum:
    return dataclasses.replace(datum, **changes)


def _inputs(datum: wb.Datum, key: str, position: int, value: float) -> wb.Datum:
    inputs = {k: v.tolist() for k, v in datum.loss_fn_inputs.items()}
    inputs[key][position] = value
    return _with(datum, loss_fn_inputs=inputs)


BAD = [
    (
        "no provenance",
        lambda d, s: _with(d, model_input_spans=None, loss_fn_input_spans=None),
        "needs provenance",
    ),
    (
        "unknown sequence",
        lambda d, s: _with(
            d,
            loss_fn_input_spans=(
                d.loss_fn_input_spans[0],
                wb.SampledProvenanceSpan(sequence_id="seq-never-sampled", length=len(s.tokens)),
            ),
        ),
        "datum 0: no sampling record for sequence 'seq-never-sampled'",
    ),
    (
        "spans do not tile",
        lambda d, s: _with(d, loss_fn_input_spans=d.loss_fn_input_spans[:1]),
        "loss_fn_input_spans cover",
    ),
    (
        "span past the sequence",
        lambda d, s: _with(
            d,
            loss_fn_input_spans=(
                d.loss_fn_input_spans[0],
                wb.SampledProvenanceSpan(sequence_id=s.sequence_id, offset=1, length=len(s.tokens)),
            ),
        ),
        "which has 6",
    ),
    (
        "a target that was not sampled",
        lambda d, s: _inputs(d, "target_tokens", -1, (s.tokens[-1] + 1) % 900),
        "but the datum has",
    ),
    ("advantage on a prompt token", lambda d, s: _inputs(d, "advantages", 0, 1.0), "not a sampled token"),
    (
        "logprobs that are not the sampler's",
        lambda d, s: _inputs(d, "logprobs", -1, -0.01),
        "the sampler recorded",
    ),
]


@pytest.mark.parametrize(("case", "corrupt", "message"), BAD, ids=[case for case, _, _ in BAD])
def test_bad_provenance_is_refused_before_anything_is_queued(
    tiny: wb.Session, case, corrupt, message
) -> None:
    prompt, sequences = _sample(tiny, num_samples=1)
    good = _datum(prompt, sequences[0], 1.0)
    before = tiny.state_digest()
    with pytest.raises(ValueError, match=message):
        tiny.policy.forward_backward([corrupt(good, sequences[0])], "stable_reinforce")
    assert tiny.state_digest() == before
    tiny.policy.forward_backward([good], "stable_reinforce").result()  # the good one still trains


def test_samples_drawn_without_recording_cannot_train_it(tiny: wb.Session) -> None:
    prompt, sequences = _sample(tiny, record=False, num_samples=1)
    with pytest.raises(ValueError, match="sample with record_stability_info=True"):
        tiny.policy.forward([_datum(prompt, sequences[0], 1.0)], "stable_reinforce")


def test_records_expire_a_day_after_their_last_use(tiny: wb.Session, monkeypatch: pytest.MonkeyPatch) -> None:
    prompt, sequences = _sample(tiny)
    now = time.time()
    clock = [now]
    monkeypatch.setattr(stability_records.time, "time", lambda: clock[0])
    first, second = (_datum(prompt, s, 1.0) for s in sequences)
    clock[0] = now + 20 * 3600
    tiny.policy.forward([first], "stable_reinforce").result()  # restarts the first record's day
    clock[0] = now + 30 * 3600  # past a day since sampling, not since the first one's use
    tiny.policy.forward([first], "stable_reinforce").result()
    with pytest.raises(ValueError, match="no sampling record"):
        tiny.policy.forward([second], "stable_reinforce")
    clock[0] = now + 55 * 3600
    with pytest.raises(ValueError, match="no sampling record"):
        tiny.policy.forward([first], "stable_reinforce")
