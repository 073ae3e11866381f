"""workbench/server/openai_api.py driven by the unmodified inspect-ai: its OpenAI-compatible provider
(`openai-api/<service>/<model>`) evaluates the served session's live policy, through the Python API
and the `inspect eval` command, and every sample's completion is the reply the openai client gets for
the same messages: inspect-ai scores exactly what the server samples.

inspect-ai's own files (logs, traces, sample buffers) go under the test's tmp_path, and no telemetry or
other hook is taken from the environment.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import inspect_ai
import openai
import pytest
from inspect_ai import Task
from inspect_ai.dataset import Sample
from inspect_ai.log import EvalLog, list_eval_logs, read_eval_log
from inspect_ai.scorer import includes
from inspect_ai.solver import generate

import workbench as wb
from tests.datums import sft_datum
from workbench.server import TinkerServer

# raised inside inspect-ai (its retry policy calls tenacity's deprecated `initial`); nothing to change here
pytestmark = pytest.mark.filterwarnings("ignore:The 'initial' parameter is deprecated:DeprecationWarning")

KEY = "tml-local"
MAX_TOKENS = 8
TASK_FILE = Path(__file__).resolve().parents[1] / "assets" / "inspect_task.py"


@pytest.fixture
def inspect_logs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """inspect-ai's folders under tmp_path (platformdirs' XDG folders hold its traces and sample
    buffers; INSPECT_LOG_DIR its logs, the folder yielded) and tmp_path as the working folder; none of
    its hooks from the environment; and what an in-process eval sets for the whole process (the root
    logger's level and handler, `sys.excepthook`) put back afterwards."""
    for name in (
        "INSPECT_TELEMETRY",
        "INSPECT_API_KEY_OVERRIDE",
        "INSPECT_REQUIRED_HOOKS",
        "INSPECT_EVAL_MODEL",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg-data"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("INSPECT_LOG_DIR", str(tmp_path / "inspect-logs"))
    monkeypatch.chdir(tmp_path)  # inspect-ai loads a .env file from where it runs and the folders above
    root = logging.getLogger()
    level, handlers, excepthook = root.level, list(root.handlers), sys.excepthook
    yield tmp_path / "inspect-logs"
    root.setLevel(level)
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    sys.excepthook = excepthook


def oai(srv: TinkerServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/oai/api/v1", api_key=KEY, max_retries=0)


def assert_samples_are_the_servers_replies(log: EvalLog, srv: TinkerServer, model: str) -> None:
    """The eval succeeded, and each sample's completion is the greedy chat reply the openai client gets
    for its messages; its `includes()` score agrees with that reply."""
    assert log.status == "success", log.error
    assert log.samples
    api = oai(srv)
    for sample in log.samples:
        reply = api.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": sample.input}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        text = reply.choices[0].message.content
        assert sample.output.completion == text
        assert sample.scores["includes"].value == ("C" if str(sample.target).lower() in text.lower() else "I")


def test_inspect_eval_scores_the_live_policys_own_replies(
    sess: wb.Session, srv: TinkerServer, inspect_logs: Path
) -> None:
    """`inspect_ai.eval` with the `openai-api` provider on the live policy (trained to answer the
    first question): the request it sends is greedy with its max_tokens, its completions are the
    server's replies, and the trained answer is scored correct."""
    question = [{"role": "user", "content": "What is the secret word?"}]
    prompt = sess.tokenizer.apply_chat_template(question, add_generation_prompt=True, tokenize=False)
    datum = sft_datum(sess.tokenizer, prompt, " pineapple" + sess.tokenizer.eos_token)
    for _ in range(40):  # the reply is " pineapple" from about step 25
        sess.policy.forward_backward([datum], "cross_entropy")
        sess.policy.optim_step({"learning_rate": 3e-3})
    task = Task(
        dataset=[
            Sample(id=1, input=question[0]["content"], target="pineapple"),
            Sample(id=2, input="Name a fruit.", target="banana"),
            Sample(id=3, input="Say hello.", target="hello"),
        ],
        solver=generate(),
        scorer=includes(),
    )
    [log] = inspect_ai.eval(
        task,
        model=f"openai-api/workbench/{sess.model_id}",
        model_base_url=f"{srv.url}/oai/api/v1",
        model_args={"api_key": KEY},
        temperature=0,
        max_tokens=MAX_TOKENS,
        display="none",
    )
    assert Path(log.location).parent == inspect_logs and Path(log.location).exists()
    assert_samples_are_the_servers_replies(log, srv, sess.model_id)
    samples = {sample.id: sample for sample in log.samples}
    assert samples[1].output.completion == " pineapple"
    assert samples[1].scores["includes"].value == "C"
    [request] = [event.call.request for event in samples[1].events if event.event == "model"]
    assert request["model"] == sess.model_id
    assert request["temperature"] == 0 and request["max_tokens"] == MAX_TOKENS
    assert request["messages"] == question


def test_the_inspect_eval_command_on_a_task_file(
    sess: wb.Session, srv: TinkerServer, inspect_logs: Path
) -> None:
    """`inspect eval <task file> --model openai-api/workbench/<model>` as the docs show it, with
    WORKBENCH_BASE_URL and WORKBENCH_API_KEY naming the server and its key."""
    env = {
        **os.environ,
        "WORKBENCH_BASE_URL": f"{srv.url}/oai/api/v1",
        "WORKBENCH_API_KEY": KEY,
    }
    # inspect-ai 0.3.285 on Python < 3.13 takes a task file by a path relative to where it runs (it globs
    # the path from there; an absolute path raises NotImplementedError), so it runs in the task's folder
    shutil.copy(TASK_FILE, inspect_logs.parent / TASK_FILE.name)
    evaluated = subprocess.run(
        [
            str(Path(sys.executable).parent / "inspect"),
            "eval",
            TASK_FILE.name,
            "--model",
            f"openai-api/workbench/{sess.config.base_model}",
            "--temperature",
            "0",
            "--max-tokens",
            str(MAX_TOKENS),
            "--display",
            "plain",
        ],
        cwd=inspect_logs.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert evaluated.returncode == 0, evaluated.stdout[-3000:] + evaluated.stderr[-3000:]
    [info] = list_eval_logs(str(inspect_logs))
    log = read_eval_log(info)
    assert log.eval.task == "colours" and len(log.samples) == 3
    assert_samples_are_the_servers_replies(log, srv, sess.config.base_model)
