"""From a datum's provenance spans to the sampling records a loss trains on (`stable_reinforce`).

A datum names where its tokens came from (Tinker's `Datum.with_provenance`): `model_input_spans` tile
the input tokens and `loss_fn_input_spans` tile `target_tokens`, each run a `PromptProvenanceSpan`
(positions `[offset, offset + length)` of the prompt of the request that sampled a sequence) or a
`SampledProvenanceSpan` (positions of that sequence's sampled tokens). Here, in the caller's thread and
before anything is queued, every span is checked against the engine's records: the named sequences
have live records (unknown or expired ids are an error naming the datum and the id), the runs tile
their field, and the tokens a span claims are the recorded ones. The targets covered by sampled spans
become the loss's `sampled` positions, with the sampler's recorded logprob of each in
`recorded_logprobs`. Only sampled targets carry loss, so a non-zero advantage anywhere else is an
error, as is a `logprobs` input that disagrees with the record.

Using a record restarts its one-day lifetime (`StabilityRecords.use`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from workbench.engine.local.stability_records import StabilityRecord, StabilityRecords, UnknownSequenceError
from workbench.engine.model.batching import PreparedDatum
from workbench.types import Datum, PromptProvenanceSpan, ProvenanceSpan

# How far a datum's `logprobs` may be from the recorded value (float32 round trips, nothing more).
LOGPROB_TOLERANCE = 1e-4


def attach_sampling_records(
    records: StabilityRecords, data: Sequence[Datum], batch: list[PreparedDatum]
) -> list[PreparedDatum]:
    """The batch with `recorded_logprobs` and `sampled` added to each datum's inputs; raises
    `ValueError` naming the first bad datum, span or position."""
    for index, datum in enumerate(data):
        if datum.loss_fn_input_spans is None or datum.model_input_spans is None:
            raise ValueError(
                f"datum {index}: stable_reinforce needs provenance: build the datum with "
                "Datum.with_provenance(...) naming the sampled sequences (sampled with record_stability_info=True)"
            )
    wanted = {
        span.sequence_id
        for datum in data
        for spans in (datum.model_input_spans, datum.loss_fn_input_spans)
        for span in spans or ()
    }
    try:
        found = records.use(wanted)
    except UnknownSequenceError as error:
        holder = next(
            i
            for i, datum in enumerate(data)
            if any(
                span.sequence_id == error.sequence_id
                for span in (*(datum.model_input_spans or ()), *(datum.loss_fn_input_spans or ()))
            )
        )
        raise ValueError(f"datum {holder}: {error}") from None
    return [
        _resolve(index, datum, prepared, found)
        for index, (datum, prepared) in enumerate(zip(data, batch, strict=True))
    ]


def _resolve(
    index: int, datum: Datum, prepared: PreparedDatum, found: dict[str, StabilityRecord]
) -> PreparedDatum:
    where = f"datum {index}"
    n = prepared.length
    tokens = prepared.tokens_N.tolist()
    targets = prepared.inputs["target_tokens"].tolist()
    recorded_N = np.zeros(n, dtype=np.float32)
    sampled_N = np.zeros(n, dtype=np.float32)
    assert datum.model_input_spans is not None and datum.loss_fn_input_spans is not None
    for field, spans, values in (
        ("model_input_spans", datum.model_input_spans, tokens),
        ("loss_fn_input_spans", datum.loss_fn_input_spans, targets),
    ):
        covered = sum(span.length for span in spans)
        if covered != n:
            raise ValueError(
                f"{where}: {field} cover {covered} positions but the datum has {n}; the runs must tile it exactly"
            )
        position = 0
        for span in spans:
            record = found[span.sequence_id]
            _check_span(
                where, field, span, position, values, record, checks_prompt=field == "model_input_spans"
            )
            if field == "loss_fn_input_spans" and not isinstance(span, PromptProvenanceSpan):
                stop = position + span.length
                recorded_N[position:stop] = record.logprobs[span.offset : span.offset + span.length]
                sampled_N[position:stop] = 1.0
            position += span.length
    if not sampled_N.any():
        raise ValueError(
            f"{where}: loss_fn_input_spans name no sampled token: stable_reinforce trains sampled tokens only"
        )
    advantages_N = prepared.inputs["advantages"].numpy()
    off_sample = np.flatnonzero((advantages_N != 0) & (sampled_N == 0))
    if off_sample.size:
        bad = int(off_sample[0])
        raise ValueError(
            f"{where}: loss_fn_inputs['advantages'] is {advantages_N[bad]:g} at position {bad}, which is not a "
            "sampled token: stable_reinforce takes non-zero advantages on sampled tokens only"
        )
    if "logprobs" in prepared.inputs:
        given_N = prepared.inputs["logprobs"].numpy()
        differs = np.flatnonzero((sampled_N != 0) & (np.abs(given_N - recorded_N) > LOGPROB_TOLERANCE))
        if differs.size:
            bad = int(differs[0])
            raise ValueError(
                f"{where}: loss_fn_inputs['logprobs'] is {given_N[bad]:g} at position {bad}, but the sampler "
                f"recorded {recorded_N[bad]:g} for that token; stable_reinforce trains on the recorded value "
                "(leave 'logprobs' out, or pass what the sampler returned)"
            )
    inputs = {
        **prepared.inputs,
        "recorded_logprobs": torch.from_numpy(recorded_N),
        "sampled": torch.from_numpy(sampled_N),
    }
    return dataclasses.replace(prepared, inputs=inputs)


def _check_span(
    where: str,
    field: str,
    span: ProvenanceSpan,
    position: int,
    values: list[int],
    record: StabilityRecord,
    checks_prompt: bool,
) -> None:
    """The span fits its sequence, and the tokens it claims are the recorded ones (a prompt span's
    tokens are checked in the input only: a target at a prompt position carries no loss)."""
    prompt = isinstance(span, PromptProvenanceSpan)
    source = record.prompt_tokens if prompt else record.tokens
    kind = "prompt" if prompt else "sampled tokens"
    stop = span.offset + span.length
    if stop > len(source):
        raise ValueError(
            f"{where}: {field} names positions [{span.offset}, {stop}) of the {kind} of sequence "
            f"{span.sequence_id!r}, which has {len(source)}"
        )
    if prompt and not checks_prompt:
        return
    claimed = values[position : position + span.length]
    actual = list(source[span.offset : stop])
    if claimed != actual:
        offset = next(i for i, (a, b) in enumerate(zip(claimed, actual, strict=True)) if a != b)
        raise ValueError(
            f"{where}: {field} says position {position + offset} is token {actual[offset]} of the {kind} of "
            f"sequence {span.sequence_id!r}, but the datum has {claimed[offset]} there"
        )
