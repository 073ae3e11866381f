"""Tinker's inflight sampling clients over `workbench serve`, driven by the real `tinker` SDK: the
scenarios of `tests/tinker_api/test_inflight_sampling.py`, a generation held mid-decoding across an
inflight save, and a bad `kind` refused as the SDK refuses it."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable

import httpx
import pytest
import tinker

import workbench as wb
from tests.server.conftest import HeldDecoding
from tests.tinker_api.test_inflight_sampling import (
    GREEDY,
    PROMPT,
    check_a_sample_in_flight_across_an_inflight_save_completes,
    check_inflight_clients_follow_the_latest_inflight_save,
    greedy,
    train,
)
from workbench.server import TinkerServer


@pytest.fixture
def remote(client: tinker.ServiceClient) -> tinker.TrainingClient:
    return client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()


def test_inflight_clients_follow_the_latest_inflight_save(remote: tinker.TrainingClient) -> None:
    check_inflight_clients_follow_the_latest_inflight_save(remote)


def test_a_sample_in_flight_across_an_inflight_save_completes(remote: tinker.TrainingClient) -> None:
    check_a_sample_in_flight_across_an_inflight_save_completes(remote)


def test_a_generation_held_across_an_inflight_save_completes_on_the_weights_it_started_with(
    sess: wb.Session, remote: tinker.TrainingClient, hold_decoding: Callable[[int], HeldDecoding]
) -> None:
    inflight = remote.save_weights_and_get_sampling_client(kind="inflight").result()
    before = greedy(inflight)
    hold = hold_decoding(3)
    held = inflight.sample(tinker.ModelInput.from_ints(PROMPT), 1, GREEDY)
    moved: list[object] = []

    def train_and_publish() -> None:
        train(remote)
        moved.append(remote.save_weights_and_get_sampling_client(kind="inflight").result())

    publisher = threading.Thread(target=train_and_publish)
    publisher.start()
    time.sleep(0.5)  # the steps and the save reach the server behind the held generation (or, on a slow
    hold.let_go.set()  # machine, after it: the assertions hold either way)
    assert list(held.result().sequences[0].tokens) == before
    publisher.join(120)
    assert hold.waited is True and len(moved) == 1
    after = greedy(inflight)
    assert after != before and after == greedy(moved[0])
    versions = [row["weights_version"] for row in sess.history.rows if row["op"] == "sample"]
    assert versions == [0.0, 0.0, 4.0, 4.0]  # each sequence's weights, recorded where they were known


def test_a_bad_kind_is_refused_as_the_sdk_refuses_it(
    srv: TinkerServer, remote: tinker.TrainingClient
) -> None:
    with pytest.raises(ValueError, match="Input should be 'snapshot' or 'inflight'"):
        tinker.types.SaveWeightsForSamplerRequest(model_id=remote.model_id, kind="bogus")  # type: ignore[arg-type]
    body = {"model_id": remote.model_id, "seq_id": 99, "sampling_session_seq_id": 0, "kind": "bogus"}
    answer = httpx.post(
        f"{srv.url}/api/v1/save_weights_for_sampler", content=json.dumps(body).encode(), timeout=30
    )
    assert answer.status_code == 400 and "Input should be 'snapshot' or 'inflight'" in answer.text
