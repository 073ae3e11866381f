"""Tinker's inflight sampling clients (`kind="inflight"`) in-process, as the SDK's contract states them
(`tinker.types.SamplingClientKind`); `tests/server/test_inflight_sampling.py` runs the same scenarios
over `workbench serve` with the real SDK."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import tinker

import workbench as wb
from tests.datums import sdk_ce_datum

PROMPT = [5, 17, 42, 9]
TARGET = [*PROMPT, 101, 102, 103, 104, 105, 106]  # what training teaches the greedy continuation
GREEDY = tinker.SamplingParams(max_tokens=6, temperature=0.0)


def greedy(sampler: Any) -> list[int]:
    return list(sampler.sample(tinker.ModelInput.from_ints(PROMPT), 1, GREEDY).result().sequences[0].tokens)


def train(training_client: Any, steps: int = 4) -> None:
    """Steps that move the greedy continuation of PROMPT towards TARGET's."""
    for _ in range(steps):
        training_client.forward_backward([sdk_ce_datum(TARGET)], "cross_entropy")
        training_client.optim_step(tinker.AdamParams(learning_rate=5e-2)).result()


def check_inflight_clients_follow_the_latest_inflight_save(training_client: Any) -> None:
    inflight_before = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot_before = training_client.save_weights_and_get_sampling_client().result()
    before = greedy(inflight_before)
    train(training_client)
    assert greedy(inflight_before) == before  # no inflight save yet: the target has not moved
    inflight_after = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    snapshot_after = training_client.save_weights_and_get_sampling_client().result()
    after = greedy(snapshot_after)
    assert after != before, "training did not change the greedy continuation: the test shows nothing"
    assert greedy(inflight_before) == after  # the earlier client moved with the target
    assert greedy(inflight_after) == after
    assert greedy(snapshot_before) == before  # a snapshot keeps its weights


def check_a_sample_in_flight_across_an_inflight_save_completes(training_client: Any) -> None:
    inflight = training_client.save_weights_and_get_sampling_client(kind="inflight").result()
    long = tinker.SamplingParams(max_tokens=24, temperature=1.0, seed=3)
    in_flight = inflight.sample(tinker.ModelInput.from_ints(PROMPT), 2, long)
    train(training_client, steps=1)
    moved = training_client.save_weights_and_get_sampling_client(kind="inflight")
    response = in_flight.result()
    assert [len(s.tokens) for s in response.sequences] == [24, 24]
    moved.result()
    assert greedy(inflight) == greedy(training_client.save_weights_and_get_sampling_client().result())


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> wb.ServiceClient:
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    client = wb.ServiceClient()
    yield client
    client.close("success")


def test_inflight_clients_follow_the_latest_inflight_save(service: wb.ServiceClient) -> None:
    check_inflight_clients_follow_the_latest_inflight_save(
        service.create_lora_training_client("tiny", rank=4, seed=0).result()
    )


def test_a_sample_in_flight_across_an_inflight_save_completes(service: wb.ServiceClient) -> None:
    check_a_sample_in_flight_across_an_inflight_save_completes(
        service.create_lora_training_client("tiny", rank=4, seed=0).result()
    )


def test_each_response_names_the_version_that_sampled_it(service: wb.ServiceClient) -> None:
    client = service.create_lora_training_client("tiny", rank=4, seed=0).result()
    inflight = client.save_weights_and_get_sampling_client(kind="inflight").result()
    assert inflight.is_inflight and inflight.weights_version == 0
    assert inflight.sample(PROMPT, 1, GREEDY).result().weights_version == 0
    train(client, steps=2)
    assert inflight.sample(PROMPT, 1, GREEDY).result().weights_version == 0
    client.save_weights_and_get_sampling_client(kind="inflight").result()
    assert inflight.sample(PROMPT, 1, GREEDY).result().weights_version == 2
    rows = [row for row in client.engine.history.rows if row["op"] == "sample"]
    assert [row["weights_version"] for row in rows] == [0.0, 0.0, 2.0]
    # the target alone holds its version: version 0 went when the target moved on
    assert client.engine.model_status(client.model_id).live_versions == [2]


def test_a_sample_waits_for_the_inflight_save_queued_before_it(service: wb.ServiceClient) -> None:
    """A save completes once the target has moved: a request sent after it, from any thread, samples
    the new weights."""
    client = service.create_lora_training_client("tiny", rank=4, seed=0).result()
    inflight = client.save_weights_and_get_sampling_client(kind="inflight").result()
    train(client, steps=2)
    saved = threading.Event()
    versions: list[int | None] = []

    def sample_after_the_save() -> None:
        saved.wait(30)
        versions.append(inflight.sample(PROMPT, 1, GREEDY).result().weights_version)

    thread = threading.Thread(target=sample_after_the_save)
    thread.start()
    client.save_weights_and_get_sampling_client(kind="inflight").result()
    saved.set()
    thread.join(60)
    assert versions == [2]
