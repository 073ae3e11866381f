"""The served session every server test drives, its server, and an SDK client of it."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tinker
from torch import Tensor

import workbench as wb
from tests.server.test_chat_templates import HERMES_TEMPLATE
from workbench.engine.model.base_model import resolve_model_path
from workbench.engine.samplers import hf
from workbench.server import TinkerServer


@pytest.fixture(scope="module")
def sampled_sess(
    sampler: str, sampled_model: str, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[wb.Session]:
    """The served session of a module's tests that take the `sampler` fixture: one per sampling engine
    for the module (a vLLM engine takes most of a minute to start on a CPU), on the model `sampled_model`
    names, with a runs folder of the module's own. Those tests sample the base model or train models of
    their own on its engine, so each finds the weights a fresh session would have."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("WORKBENCH_RUNS", str(tmp_path_factory.mktemp("runs")))
        session = wb.Session(
            sampled_model, wb.LoraConfig(rank=4), seed=0, wandb=False, max_models=6, sampler=sampler
        )
    yield session
    session.close()


@pytest.fixture
def sess(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[wb.Session]:
    """The served session: the tiny model with HF sampling, fresh for the test, no W&B run, room for six
    models (a test fills them), and a runs folder of its own, so listings show this test's models only.
    For a test that takes the `sampler` fixture: the module's `sampled_sess`, on the model and sampler
    it names, with its runs folder."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    if "sampler" in request.fixturenames:
        shared = request.getfixturevalue("sampled_sess")
        monkeypatch.setenv("WORKBENCH_RUNS", str(shared.model_dir.parent))
        yield shared
        return
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    session = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, max_models=6, sampler="hf")
    yield session
    session.close()


@pytest.fixture
def srv(sess: wb.Session) -> TinkerServer:
    """A server of `sess`; the shared session's one server for all its tests."""
    running = [server for server in sess.servers if server.running]
    return running[0] if running else sess.serve()


@pytest.fixture
def client(srv: TinkerServer) -> Iterator[tinker.ServiceClient]:
    service_client = tinker.ServiceClient(base_url=srv.url)
    yield service_client
    if srv.running:
        service_client.close("success").result()
    elif service_client._session_holder is not None:
        # The test stopped the server: no finish call can reach it (the SDK's close would retry it), so
        # only the client's own loops stop, its heartbeat first; left running it would warn "Session
        # heartbeat failed" until the process ends.
        service_client._session_holder.close()


HOLD_LIMIT_S = 60.0
"""How long a held decoding loop waits for the test to let it go: reached only when a test fails."""


@dataclass
class HeldDecoding:
    """The HF sampler's decoding loop, held after it has drawn `at_step` tokens of the next generation
    (and told them to the request's token sink) until the test sets `let_go`. `waited` says how the
    hold ended: True let go by the test, False run out (`HOLD_LIMIT_S`), None not reached yet."""

    at_step: int
    let_go: threading.Event = field(default_factory=threading.Event)
    waited: bool | None = None


@pytest.fixture
def hold_decoding(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], HeldDecoding]:
    """`hold_decoding(step)` holds the next generation's decoding loop at `step`: what a client receives
    while it is held was sent before the sample ended, whatever the machine's speed."""

    def arm(step: int) -> HeldDecoding:
        hold = HeldDecoding(step)
        decoding_step = hf._RowStops.__call__

        def held_step(
            stops: hf._RowStops, input_ids: Tensor, scores: Tensor | None, **kwargs: object
        ) -> Tensor:
            done = decoding_step(stops, input_ids, scores, **kwargs)
            if len(stops.chooser.tokens) == hold.at_step and hold.waited is None:
                hold.waited = hold.let_go.wait(HOLD_LIMIT_S)
            return done

        monkeypatch.setattr(hf._RowStops, "__call__", held_step)
        return hold

    return arm


@pytest.fixture(scope="module")
def hermes_tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with a chat template in the Qwen / Hermes tool format."""
    folder = tmp_path_factory.mktemp("tiny-hermes") / "tiny-hermes"
    shutil.copytree(resolve_model_path("tiny"), folder)
    (folder / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return str(folder)
