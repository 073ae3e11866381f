"""Tinker's inflight sampling clients on the vLLM sampler: the scenarios of
`tests/tinker_api/test_inflight_sampling.py`, and the target's old weights leaving vLLM when it moves.

Marked `vllm`: `make test-vllm` runs them in `.venv-vllm`; skipped where vllm is not installed.
"""

from __future__ import annotations

import pytest

import workbench as wb
from tests.tinker_api.test_inflight_sampling import (
    check_a_sample_in_flight_across_an_inflight_save_completes,
    check_inflight_clients_follow_the_latest_inflight_save,
    greedy,
    train,
)

pytestmark = pytest.mark.vllm


def test_inflight_clients_follow_the_latest_inflight_save_on_vllm(tiny_for_vllm: str) -> None:
    with wb.Session(tiny_for_vllm, wb.LoraConfig(rank=4), seed=0, sampler="vllm") as sess:
        check_inflight_clients_follow_the_latest_inflight_save(sess.policy)


def test_a_sample_in_flight_across_an_inflight_save_completes_on_vllm(tiny_for_vllm: str) -> None:
    with wb.Session(tiny_for_vllm, wb.LoraConfig(rank=4), seed=0, sampler="vllm") as sess:
        check_a_sample_in_flight_across_an_inflight_save_completes(sess.policy)


def test_the_targets_old_weights_leave_vllm_when_it_moves(tiny_for_vllm: str) -> None:
    """vLLM holds each version the target published as its own adapter; once the target has moved and
    no snapshot client holds the old version, the old adapter goes."""
    with wb.Session(tiny_for_vllm, wb.LoraConfig(rank=4), seed=0, sampler="vllm") as sess:
        inflight = sess.policy.save_weights_and_get_sampling_client(kind="inflight").result()
        greedy(inflight)
        vllm = sess.engine._state.sampler.started
        assert vllm.resident == [(sess.model_id, 0, None)]
        train(sess.policy, steps=2)
        sess.policy.save_weights_and_get_sampling_client(kind="inflight").result()
        greedy(inflight)
        assert vllm.resident == [(sess.model_id, 2, None)]
