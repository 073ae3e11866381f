"""A session on a remote engine: `Session.connect` to `workbench serve` in a subprocess, through the
unmodified `tinker` SDK, against a local session with the same seeds.

The same SFT and RL loops give the same losses and samples on both (CPU, fp32); what the remote
engine cannot do is refused before anything is sent; a server that dies or was never there fails the
op's future clearly and quickly, and the history keeps only the operations that completed.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import workbench as wb
from workbench.engine.interface import EngineInterface
from workbench.engine.remote import SDK_LOSSES

ROOT = Path(__file__).resolve().parent.parent
LORA = wb.LoraConfig(rank=4)
TOKENS = [[5, 17, 33, 48, 60, 71, 2], [9, 21, 40, 11, 3]]
PROMPT = [9, 21, 40]


class Server:
    """`workbench serve --base-model tiny` (or another model and sampler) in a subprocess, on a free port."""

    def __init__(self, folder: Path, base_model: str = "tiny", sampler: str = "hf"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "WORKBENCH_RUNS": str(folder / "server-runs")}
        command = [sys.executable, "-m", "workbench.cli", "serve", "--base-model", base_model, "--port", "0"]
        command += ["--device", "cpu", "--sampler", sampler, "--no-wandb", "--quiet"]
        command += ["--run-dir", str(folder / "server")]
        self.process = subprocess.Popen(
            command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        assert self.process.stdout is not None
        lines = []
        for line in self.process.stdout:
            lines.append(line)
            if "serving the Tinker API at" in line:
                break
        else:
            raise AssertionError("".join(lines))
        self.url = lines[-1].split(" at ")[-1].strip()

    def stop(self, sig: int = signal.SIGINT) -> None:
        self.process.send_signal(sig)
        self.process.communicate(timeout=60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("serve"))
    yield running
    running.stop()


@pytest.fixture(autouse=True)
def _environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))


def datum(tokens: list[int]) -> wb.Datum:
    return wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def sft_step(sess: wb.Session, i: int) -> dict[str, float]:
    backward = sess.policy.forward_backward([datum(t) for t in TOKENS], "cross_entropy")
    sess.policy.optim_step(sess.current_run.adam_params).result()
    sample = sess.sampling_client().sample(PROMPT, 2, {"max_tokens": 4, "seed": 10 + i}).result()
    return {
        "loss": backward.result().metrics["loss:sum"],
        "first_token": float(sample.sequences[0].tokens[0]),
    }


def rl_loop(sess: wb.Session, steps: int) -> tuple[list[float], list[list[int]]]:
    """Sample a group, reward token 1 of the vocabulary's lower half, train with importance sampling."""
    losses, samples = [], []
    for i in range(steps):
        sampler = sess.sampling_client()
        response = sampler.sample(PROMPT, 4, {"max_tokens": 3, "seed": i}).result()
        assert response.weights_version == sess.step  # pinned after every step so far
        rewards = [sum(t < 400 for t in s.tokens) / 3 for s in response.sequences]
        mean = sum(rewards) / len(rewards)
        data = []
        for sequence, reward in zip(response.sequences, rewards, strict=True):
            tokens = PROMPT + sequence.tokens
            n, p = len(tokens) - 1, len(PROMPT) - 1
            data.append(
                wb.Datum(
                    model_input=wb.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tokens[1:],
                        "logprobs": [0.0] * p + sequence.logprobs,
                        "advantages": [0.0] * p + [reward - mean] * (n - p),
                    },
                )
            )
        backward = sess.policy.forward_backward(data, "importance_sampling")
        sess.policy.optim_step({"learning_rate": 5e-2}).result()
        losses.append(backward.result().metrics["loss:sum"])
        samples.append([token for s in response.sequences for token in s.tokens])
    return losses, samples


def op_rows(history: wb.MetricsHistory) -> list[tuple[str, str, int]]:
    return [(row["op"], row["model"], row["step"]) for row in history.rows]


def test_both_engines_satisfy_the_interface() -> None:
    """Every member the surfaces call exists on both engines, with the interface's parameters."""
    members = [name for name in dir(EngineInterface) if not name.startswith("_")]
    assert {"forward_backward", "pin_sampler", "record", "endpoint", "history"} <= set(members)
    for engine_class in (wb.Engine, wb.RemoteEngine):
        for name in members:
            ours, theirs = getattr(EngineInterface, name), getattr(engine_class, name)
            if isinstance(ours, property):
                assert isinstance(theirs, property), (engine_class.__name__, name)
            else:
                want = list(inspect.signature(ours).parameters.values())
                got = list(inspect.signature(theirs).parameters.values())
                assert [(p.name, p.kind, p.default) for p in got] == [
                    (p.name, p.kind, p.default) for p in want
                ], (engine_class.__name__, name)


def test_sft_and_rl_loops_match_a_local_session(
    sampler: str, sampled_model: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """The run loop (SFT with live settings) and a hand-written RL loop give the same losses, samples
    and history rows on a remote session as on a local one with the same seeds, with the same sampler."""
    if sampler == "hf":
        server = request.getfixturevalue("server")
    else:
        server = Server(tmp_path, sampled_model, sampler)
        request.addfinalizer(server.stop)
    results = {}
    for where in ("local", "remote"):
        sess = (
            wb.Session(sampled_model, LORA, seed=0, sampler=sampler, wandb=False)
            if where == "local"
            else wb.Session.connect(server.url, base_model=sampled_model, lora=LORA, seed=0, wandb=False)
        )
        with sess:
            run = sess.run(sft_step, 3, adam_params={"learning_rate": 1e-2}, paused=True)
            run.step()
            run.wait()
            run.set(learning_rate=2e-2)
            run.resume()
            assert run.wait(120) is wb.RunState.FINISHED, run.traceback
            sft = [row for row in sess.history.rows if row["op"] == "run_step"]
            rl = rl_loop(sess, 2)
            results[where] = (sft, rl, op_rows(sess.history), sess.step, sess.policy.weights_version)
            rows = (sess.run_dir / "history.jsonl").read_text().splitlines()
            assert len(rows) == len(sess.history.rows)  # the JSONL file is written here for both
    local, remote = results["local"], results["remote"]
    assert [r["loss"] for r in remote[0]] == pytest.approx([r["loss"] for r in local[0]], rel=1e-5)
    assert [r["first_token"] for r in remote[0]] == [r["first_token"] for r in local[0]]
    assert remote[1][0] == pytest.approx(local[1][0], rel=1e-4)
    assert remote[1][1] == local[1][1]
    assert remote[2] == local[2]  # the same operations, in the same order, at the same steps
    assert remote[3:] == local[3:] == (5, 5)


def test_remote_session_views_and_checkpoints(server: Server) -> None:
    """Panel status names the engine's URL (no local memory); plots, token views, checkpoint listing
    and save/load by tinker:// path work."""
    with wb.Session.connect(server.url, base_model="tiny", lora=LORA, wandb=False) as sess:
        sess.policy.forward_backward([datum(TOKENS[0])], "cross_entropy").result()
        sess.policy.optim_step({"learning_rate": 1e-2}).result()
        saved = sess.policy.save_state("one").result()
        assert saved.path.startswith("tinker://")
        listed = sess.list_checkpoints()
        assert [(c.name, c.kind, c.step, c.tinker_path) for c in listed] == [("one", "state", 1, saved.path)]
        before = sess.policy.forward([datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
        sess.policy.optim_step({"learning_rate": 1e-1}).result()  # no gradient: weights stay, version moves
        sess.policy.forward_backward([datum(TOKENS[1])], "cross_entropy").result()
        sess.policy.optim_step({"learning_rate": 1e-1}).result()
        sess.load_state(saved.path)
        after = sess.policy.forward([datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
        assert after == pytest.approx(before, rel=1e-6)
        assert sess.step == 1 and sess.policy.weights_version == 4

        panel = sess.panel()
        try:
            panel.status.refresh()
            status = panel.status.widget.value
            assert f'data-field="engine"><b>engine</b> {server.url}' in status
            assert 'data-field="memory"' not in status
        finally:
            panel.close()
        assert sess.plot("loss:sum").axes
        sample = sess.sampling_client().sample(PROMPT, 1, {"max_tokens": 3, "seed": 0}).result()
        assert wb.render_sample(sess.tokenizer, sample.sequences[0], wb.ModelInput.from_ints(PROMPT))
        assert f"{server.url}" in repr(sess)


def test_what_the_remote_engine_cannot_do_is_refused_before_sending(server: Server) -> None:
    with wb.Session.connect(server.url, base_model="tiny", lora=LORA, wandb=False) as sess:
        local_only = sorted(set(wb.LOSSES) - set(SDK_LOSSES))
        assert local_only  # the local engine has losses the protocol cannot name
        assert set(sess.engine.losses) == set(SDK_LOSSES) & set(wb.LOSSES)  # as the server lists them
        cases = [
            (lambda: sess.policy.forward_backward([datum(TOKENS[0])], local_only[0]), "accepts"),
            (lambda: sess.create_critic(), "no critic"),
            (lambda: sess.state_digest(), "state_digest"),
            (lambda: sess.load_state(str(sess.run_dir)), "tinker://"),
            (lambda: sess.export_merged(sess.run_dir / "merged"), "live on the engine"),
            (lambda: sess.serve(), "in this process"),
        ]
        for call, message in cases:
            with pytest.raises(ValueError, match=message):
                call()
        assert sess.history.rows == [] and sess.step == 0 and sess.critic is None
        # nothing half-sent: the session goes on
        sess.policy.forward_backward([datum(TOKENS[0])], "cross_entropy").result()
        assert op_rows(sess.history) == [("forward_backward", "policy", 0)]
    with pytest.raises(wb.RemoteUnsupportedError, match="serves \\['tiny'\\]"):
        wb.Session.connect(server.url, base_model="smollm2-135m", wandb=False)


def test_unreachable_url_fails_at_once() -> None:
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(
        wb.EngineUnreachableError, match=f"no Tinker service answers at http://127.0.0.1:{port}"
    ):
        wb.Session.connect(f"http://127.0.0.1:{port}", base_model="tiny", wandb=False)
    assert time.monotonic() - started < 10


def test_server_killed_mid_run(tmp_path: Path) -> None:
    """The op waiting when the server dies fails with a clear error within seconds; the run ends
    failed; the history holds only the operations that completed; the session stays usable."""
    doomed = Server(tmp_path)
    sess = wb.Session.connect(doomed.url, base_model="tiny", lora=LORA, wandb=False, probe_interval_s=0.5)
    try:
        completed: list[int] = []

        def step(s: wb.Session, i: int) -> None:
            if i == 2:
                doomed.process.kill()
                doomed.process.wait()
            s.policy.forward_backward([datum(TOKENS[0])], "cross_entropy").result()
            s.policy.optim_step({"learning_rate": 1e-2}).result()
            completed.append(i)

        started = time.monotonic()
        run = sess.run(step, 10)
        assert run.wait(60) is wb.RunState.FAILED
        assert time.monotonic() - started < 30
        assert isinstance(run.error, wb.EngineUnreachableError)
        assert "stopped answering" in str(run.error)
        assert completed == [0, 1] and sess.step == 2
        assert op_rows(sess.history) == [
            ("forward_backward", "policy", 0),
            ("optim_step", "policy", 1),
            ("forward_backward", "policy", 1),
            ("optim_step", "policy", 2),
        ]
        started = time.monotonic()
        with pytest.raises(wb.EngineUnreachableError):
            sess.policy.forward([datum(TOKENS[0])], "cross_entropy").result(timeout=30)
        assert time.monotonic() - started < 10
        assert sess.plot("loss:sum").axes and len(sess.history.rows) == 4
    finally:
        started = time.monotonic()
        sess.close()
        assert time.monotonic() - started < 15


def test_custom_loss_matches_a_local_session(server: Server) -> None:
    """`forward_backward_custom` (the SDK's forward, local loss, weighted backward) trains the remote
    model as the local engine trains its own."""

    def negative_logprob(data: list, logprobs_list: list) -> tuple:
        total = -sum(logprobs.sum() for logprobs in logprobs_list)
        return total, {"custom": total.item()}

    results = []
    for sess in (
        wb.Session("tiny", LORA, seed=0, sampler="hf", wandb=False),
        wb.Session.connect(server.url, base_model="tiny", lora=LORA, seed=0, wandb=False),
    ):
        with sess:
            out = sess.policy.forward_backward_custom([datum(t) for t in TOKENS], negative_logprob).result()
            sess.policy.optim_step({"learning_rate": 1e-2}).result()
            after = sess.policy.forward([datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
            results.append((out.metrics["custom"], out.metrics["loss:sum"], after))
    assert results[1] == pytest.approx(results[0], rel=1e-5)
