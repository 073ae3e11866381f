"""Tinker's inflight sampling clients on the vLLM sampler: the scenarios of
`tests/tinker_api/test_inflight_sampling.py`, and the target's old weights leaving vLLM when it moves.

Marked `vllm`: `make test-vllm` runs them in `.venv-vllm`; skipped where vllm is not installed.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import workbench as wb
from tests.tinker_api.test_inflight_sampling import (
    check_a_sample_in_flight_across_an_inflight_save_completes,
    check_inflight_clients_follow_the_latest_inflight_save,
    greedy,
    train,
)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def engine(tiny_for_vllm: str) -> Iterator[wb.Engine]:
    """One vLLM-sampling engine for the module (vLLM takes most of a minute to start on a CPU)."""
    shared = wb.Engine(tiny_for_vllm, sampler="vllm", seed=0)
    yield shared
    shared.close()


@pytest.fixture
def policy(engine: wb.Engine) -> Iterator[wb.TrainingClient]:
    """A model of the test's own on the module's engine (rank 4, seed 0, as a fresh session's policy),
    removed after the test: no test sees another's weights or versions."""
    model_id = engine.create_model(wb.LoraConfig(rank=4), seed=0).result()
    yield wb.TrainingClient(engine, model_id)
    engine.delete_model(model_id).result()


def test_inflight_clients_follow_the_latest_inflight_save_on_vllm(policy: wb.TrainingClient) -> None:
    check_inflight_clients_follow_the_latest_inflight_save(policy)


def test_a_sample_in_flight_across_an_inflight_save_completes_on_vllm(policy: wb.TrainingClient) -> None:
    check_a_sample_in_flight_across_an_inflight_save_completes(policy)


def test_the_targets_old_weights_leave_vllm_when_it_moves(
    engine: wb.Engine, policy: wb.TrainingClient
) -> None:
    """vLLM holds each version the target published as its own adapter; once the target has moved and
    no snapshot client holds the old version, the old adapter goes."""
    inflight = policy.save_weights_and_get_sampling_client(kind="inflight").result()
    greedy(inflight)
    vllm = engine._state.sampler.started

    def resident() -> list[tuple]:  # this model's adapters (the engine's earlier models' may be there too)
        return [key for key in vllm.resident if key[0] == policy.model_id]

    assert resident() == [(policy.model_id, 0, None)]
    train(policy, steps=2)
    policy.save_weights_and_get_sampling_client(kind="inflight").result()
    greedy(inflight)
    assert resident() == [(policy.model_id, 2, None)]
