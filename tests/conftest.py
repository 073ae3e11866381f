"""Test configuration: offline, headless, deterministic.

Nothing downloads at test time (`HF_HUB_OFFLINE=1`); W&B is disabled unless a test turns it on; plots
use the Agg backend. `gpu` tests are skipped where there is no CUDA device, `vllm` tests where vllm
cannot be imported (the main environment; `make test-vllm` runs them in `.venv-vllm`, with PyPI's CPU
build of vLLM).

The `sampler` fixture runs a test once per sampling engine ("hf", "vllm"), on the model `sampled_model`
names; a module shares one session per engine where its tests allow (a vLLM engine takes most of a
minute to start on a CPU), and a test that trains makes a model of its own on that engine. vLLM's CPU attention kernels take head sizes from 32 up, and the tiny model's
heads have 16 dimensions, so the vLLM runs use `tiny_for_vllm`: the tiny model with the same tokenizer,
vocabulary and layers, and heads of 32 dimensions.

The built-in models are prepared into the tests' own cache, `.cache/workbench` in the working tree
(`WORKBENCH_CACHE`, inherited by every kernel, server and script a test starts), never the user's:
what another environment left in `~/.cache/workbench` cannot change a result. tiny builds in a second;
smollm2-135m is converted from its GGUF once per environment and clone (about 30 s), and kept.

The thread count is fixed (`OMP_NUM_THREADS`, torch's default count) for every session the tests make:
a parallel reduction's bits depend on it, and the tests that compare a run with itself bit for bit must
compare like with like whatever else the machine is running. `tests/engine/test_threads.py` lifts it to
test the adaptive count.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import signal
import sys
import time
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ["MPLBACKEND"] = "Agg"
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["WORKBENCH_CACHE"] = str(Path(__file__).resolve().parent.parent / ".cache" / "workbench")
if "WORKBENCH_RUNS" not in os.environ:  # session folders go to a scratch area, not the working tree
    import tempfile

    os.environ["WORKBENCH_RUNS"] = tempfile.mkdtemp(prefix="workbench-test-runs-")

from collections.abc import Iterator

import pytest
import torch

import workbench as wb

os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
# The Ctrl-C tests press it as a kernel does (SIGINT to the main thread), which raises KeyboardInterrupt
# through Python's default handler; a runner that starts the tests with SIGINT ignored (a background job
# of a non-interactive shell) would leave nothing to raise it.
signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    has_cuda = torch.cuda.is_available()
    has_vllm = importlib.util.find_spec("vllm") is not None
    for item in items:
        if item.get_closest_marker("gpu") and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if item.get_closest_marker("vllm") and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vllm (make test-vllm runs these)"))


@pytest.fixture(scope="session")
def tiny_for_vllm(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny model with heads of 32 dimensions (seeded weights), as a local HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.engine.model.builtin_models import tiny_base_model_dir

    tiny = tiny_base_model_dir()
    folder = tmp_path_factory.mktemp("tiny-for-vllm")
    config = LlamaConfig.from_pretrained(tiny)
    config.head_dim = 32
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tiny) / name, folder / name)
    return str(folder)


def build_tiny_twin(folder: Path, layers: int, seed: int, head_dim: int | None = None) -> str:
    """Another base model: the tiny model's architecture and tokenizer with `layers` layers and weights
    drawn from `seed`, as a local HF folder (a teacher, a grader, a reference of another size). It
    takes 4,096 positions, room for a grader's 2,048-token answers. `head_dim`: heads of that size
    (vLLM's CPU kernels take 32, not the tiny model's own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from workbench.engine.model.builtin_models import tiny_base_model_dir

    tiny = tiny_base_model_dir()
    config = LlamaConfig.from_pretrained(tiny)
    config.num_hidden_layers = layers
    config.max_position_embeddings = 4096
    if head_dim is not None:
        config.head_dim = head_dim
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(Path(tiny) / name, folder / name)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_teacher(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A second base model beside `tiny`: its twin with 3 layers, other weights."""
    return build_tiny_twin(tmp_path_factory.mktemp("tiny-teacher"), layers=3, seed=1)


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.vllm)])
def sampler(request: pytest.FixtureRequest) -> str:
    """The sampling engine a test runs against, each in turn. Module-scoped, so that a module can share
    one session per engine (a vLLM engine takes most of a minute to start) and pytest runs a module's
    tests engine by engine."""
    return request.param


@pytest.fixture(scope="module")
def sampled_model(sampler: str, request: pytest.FixtureRequest) -> str:
    """The base model the `sampler` runs: the tiny model, or its 32-dimension-head twin for vLLM."""
    return "tiny" if sampler == "hf" else request.getfixturevalue("tiny_for_vllm")


@pytest.fixture
def tiny() -> Iterator[wb.Session]:
    """A fresh session on the tiny model (rank 4, seed 0), closed after the test."""
    session = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0)
    yield session
    session.close()


@pytest.fixture
def tiny_no_wandb() -> Iterator[wb.Session]:
    """The same session with no W&B run at all (`wandb=False`), closed after the test."""
    session = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    yield session
    session.close()


@pytest.fixture
def no_wandb_credentials(tmp_path, monkeypatch: pytest.MonkeyPatch):
    """No W&B key or mode anywhere W&B looks (env, netrc, settings), so runs are offline; every W&B path
    under `tmp_path`, which the fixture yields. `WANDB_DIR` is unset: it would win over the folder
    workbench gives W&B (the model folder), which is what the tests check."""
    import wandb

    for name in (
        "WANDB_API_KEY",
        "WANDB_MODE",
        "WANDB_IDENTITY_TOKEN_FILE",
        "WANDB_BASE_URL",
        "WANDB_DIR",
        "WANDB_PROJECT",
        "NETRC",
    ):
        monkeypatch.delenv(name, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / ".config" / "wandb"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(home / ".cache" / "wandb"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(home / ".local" / "share" / "wandb"))
    wandb.teardown()  # W&B reads its environment once per process setup; start from this one
    yield tmp_path
    wandb.teardown()


@pytest.fixture(scope="session")
def skyrl_server(tmp_path_factory: pytest.TempPathFactory):
    """SkyRL's Tinker server on the tiny model, started once for the test run (`tests/skyrl_server.py`);
    skipped where `make skyrl-env` has not installed it."""
    from tests.skyrl_server import SkyRLServer, skyrl_installed
    from workbench.engine.model.builtin_models import tiny_base_model_dir

    if not skyrl_installed():
        pytest.skip("SkyRL's server is not installed: make skyrl-env")
    server = SkyRLServer(tmp_path_factory.mktemp("skyrl"), tiny_base_model_dir())
    yield server
    server.stop()


def _sdk_heartbeats(settle_s: float) -> set[str]:
    """The client sessions whose `tinker` SDK heartbeat still runs in this process, waiting up to
    `settle_s` for those a `close` has just been asked to stop.

    The SDK runs every client's heartbeat as an asyncio task on one background event loop (a daemon
    thread, `internal_client_holder`); `ServiceClient.close` cancels it. A client never closed keeps
    beating until the process ends, and logs "Session heartbeat failed" once its server has gone."""
    holder = sys.modules.get("tinker.lib.internal_client_holder")
    loop = None if holder is None else holder._internal_client_holder_thread_singleton._loop
    if loop is None or not loop.is_running():
        return set()

    async def beating() -> set[str]:
        return {
            str(task.get_coro().cr_frame.f_locals.get("session_id"))
            for task in asyncio.all_tasks()
            if task.get_coro().__qualname__ == "InternalClientHolder._session_heartbeat" and not task.done()
        }

    deadline = time.monotonic() + settle_s
    while (sessions := asyncio.run_coroutine_threadsafe(beating(), loop).result(timeout=10)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    return sessions


@pytest.fixture(scope="module", autouse=True)
def sdk_clients_closed(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every `tinker` SDK client a test module opens is closed by the module's end (its heartbeat
    stopped): one left open fails the module's last test, naming its client sessions."""
    before = _sdk_heartbeats(settle_s=0)
    yield
    left = _sdk_heartbeats(settle_s=5) - before
    if left:
        pytest.fail(
            f"{request.module.__name__} left tinker SDK clients open (client sessions {sorted(left)})"
        )
