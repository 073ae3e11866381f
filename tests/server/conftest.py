"""The served session every server test drives, its server, and an SDK client of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker

import workbench as wb
from workbench.server import TinkerServer


@pytest.fixture
def sess(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[wb.Session]:
    """The served session: the tiny model with HF sampling, or, for a test that takes the `sampler`
    fixture, the model and sampler it names; no W&B run, room for six models (a test fills them), and a
    runs folder of its own, so listings show this test's models only."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    model, sampler = "tiny", "hf"
    if "sampler" in request.fixturenames:
        model, sampler = request.getfixturevalue("sampled_model"), request.getfixturevalue("sampler")
    session = wb.Session(model, wb.LoraConfig(rank=4), seed=0, wandb=False, max_models=6, sampler=sampler)
    yield session
    session.close()


@pytest.fixture
def srv(sess: wb.Session) -> TinkerServer:
    return sess.serve()


@pytest.fixture
def client(srv: TinkerServer) -> Iterator[tinker.ServiceClient]:
    service_client = tinker.ServiceClient(base_url=srv.url)
    yield service_client
    if srv.running:
        service_client.close("success").result()
