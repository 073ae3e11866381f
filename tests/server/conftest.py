"""The served session every server test drives, its server, and an SDK client of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker

import workbench as wb
from workbench.server import TinkerServer


@pytest.fixture
def sess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[wb.Session]:
    """A tiny session with no W&B run, and room for six models (a test fills them); its runs folder is
    the test's own, so listings show this test's models only."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    session = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, max_models=6)
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
