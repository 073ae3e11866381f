"""A session on a remote engine, `Session.connect`, through the unmodified `tinker` SDK, against two
servers from one module: `workbench serve` in a subprocess and SkyRL's own Tinker server
(`skyrl[tinker,jax]==0.4.0`, JAX on the CPU; marked `skyrl`, skipped without `make skyrl-env`).

The remote-session suite (train, sample, an RL loop, save/load, the run loop, close) runs against both
engines (`remote_url`); against `workbench serve`, the SFT and RL loops also give the same losses and
samples as a local session with the same seeds (CPU, fp32). What the remote engine cannot do is refused
before anything is sent; a server that dies or was never there fails the op's future clearly and
quickly, and the history keeps only the operations that completed.
"""

from __future__ import annotations

import inspect
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import workbench as wb
from tests.datums import ce_datum
from workbench.engine.interface import EngineInterface
from workbench.engine.remote.client_metrics import with_client_metrics
from workbench.engine.remote.engine import SDK_LOSSES
from workbench.engine.remote.sequence_id_relay import MADE_UP_ID_PREFIX, with_sequence_ids
from workbench.engine.remote.server_profiles import SKYRL, TINKER_PROTOCOL

ROOT = Path(__file__).resolve().parents[2]
LORA = wb.LoraConfig(rank=4, train_unembed=False)  # what SkyRL builds: attention and MLP, alpha 32
TOKENS = [[5, 17, 33, 48, 60, 71, 2], [9, 21, 40, 11, 3]]
PROMPT = [9, 21, 40]


class Server:
    """`workbench serve --base-model tiny` (or another model and sampler) in a subprocess, on a free port."""

    def __init__(self, folder: Path, base_model: str = "tiny", sampler: str = "hf"):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "WORKBENCH_RUNS": str(folder / "server-runs")}
        command = [sys.executable, "-m", "workbench.cli", "serve", "--base-model", base_model, "--port", "0"]
        command += ["--device", "cpu", "--sampler", sampler, "--no-wandb", "--quiet"]
        command += ["--model-dir", str(folder / "server")]
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


@dataclass(frozen=True)
class Served:
    """A running server: which one, its URL, and the base model as it names it."""

    engine: str  # "workbench" | "skyrl"
    url: str
    base_model: str


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    running = Server(tmp_path_factory.mktemp("serve"))
    yield running
    running.stop()


@pytest.fixture(scope="module", params=["workbench", pytest.param("skyrl", marks=pytest.mark.skyrl)])
def remote_url(request: pytest.FixtureRequest) -> Served:
    """Each server the remote-session suite runs against."""
    if request.param == "skyrl":
        skyrl = request.getfixturevalue("skyrl_server")
        return Served("skyrl", skyrl.url, skyrl.base_model)
    return Served("workbench", request.getfixturevalue("server").url, "tiny")


@pytest.fixture(autouse=True)
def _environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))


def connect(served: Served, **keywords: object) -> wb.Session:
    return wb.Session.connect(served.url, base_model=served.base_model, lora=LORA, wandb=False, **keywords)


def sft_step(sess: wb.Session, i: int) -> dict[str, float]:
    backward = sess.policy.forward_backward([ce_datum(t) for t in TOKENS], "cross_entropy")
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


# ---------------------------------------------------------------------------------------------- both engines


def test_train(remote_url: Served) -> None:
    """forward_backward and optim_step train the remote model; the history has `loss:sum` and
    `num_tokens:sum` (computed here when the server sends none) and `grad_norm` under our name."""
    with connect(remote_url) as sess:
        assert sess.base_info.vocab_size == len(sess.tokenizer) > 0
        losses = []
        for _ in range(3):
            out = sess.policy.forward_backward([ce_datum(t) for t in TOKENS], "cross_entropy").result()
            step = sess.policy.optim_step({"learning_rate": 5e-2}).result()
            logprobs = np.concatenate([o["logprobs"].array for o in out.loss_fn_outputs])
            assert out.metrics["loss:sum"] == pytest.approx(-logprobs.sum(), rel=1e-4)
            assert out.metrics["num_tokens:sum"] == 10
            assert step.metrics["grad_norm"] > 0 and not any(k.startswith("skyrl") for k in step.metrics)
            losses.append(out.metrics["loss:sum"])
        assert losses[2] < losses[0] - 0.1
        rows = [row for row in sess.history.rows if row["op"] == "forward_backward"]
        assert [row["loss:sum"] for row in rows] == pytest.approx(losses)
        assert sess.step == 3 and sess.plot("loss:sum").axes


def test_sample(remote_url: Served) -> None:
    """The policy and the base model sample through SDK 0.38 against either protocol; sequence ids the
    server did not send are made up here and marked; logprobs agree with compute_logprobs."""
    with connect(remote_url) as sess:
        for sampler in (sess.sampling_client(), sess.sampling_client(base=True)):
            response = sampler.sample(PROMPT, 2, {"max_tokens": 4, "seed": 3, "temperature": 1.0}).result()
            assert len(response.sequences) == 2
            for sequence in response.sequences:
                assert 1 <= len(sequence.tokens) == len(sequence.logprobs) <= 4
                made_up = sequence.sequence_id.startswith(MADE_UP_ID_PREFIX)
                assert made_up is (remote_url.engine == "skyrl"), sequence.sequence_id
            assert len({s.sequence_id for s in response.sequences}) == 2
            sequence = response.sequences[0]
            scored = sampler.compute_logprobs(wb.ModelInput.from_ints(PROMPT + sequence.tokens)).result()
            assert scored[0] is None
            assert scored[len(PROMPT) :] == pytest.approx(sequence.logprobs, abs=1e-3)
        assert [row["op"] for row in sess.history.rows] == ["sample", "sample"]


def test_sdk_failures_name_the_engine_and_the_operation(remote_url: Served) -> None:
    """A check inside SDK 0.38 that fails on what an older server answered (SkyRL ignores
    `prompt_logprobs_last_n` and scores the whole prompt) becomes a RemoteProtocolError naming the
    server, the operation and what to do; the session goes on."""
    with connect(remote_url) as sess:
        sampler = sess.sampling_client(base=True)
        prompt = wb.ModelInput.from_ints([*PROMPT, 11, 3])
        if remote_url.engine == "skyrl":
            with pytest.raises(
                wb.RemoteProtocolError, match="compute_logprobs failed inside the tinker SDK"
            ) as error:
                sampler.compute_logprobs(prompt, prompt_logprobs_last_n=1).result()
            assert "SkyRL's Tinker server" in str(error.value) and "workbench serve" in str(error.value)
        else:
            scored = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=1).result()
            assert scored[:-1] == [None] * 4 and scored[-1] is not None
        assert len(sampler.compute_logprobs(prompt).result()) == 5


def test_rl_loop(remote_url: Served) -> None:
    """sample -> reward -> importance_sampling -> optim_step, 3 steps, with `loss:sum` in the history."""
    with connect(remote_url) as sess:
        losses, samples = rl_loop(sess, 3)
        assert len(losses) == 3 and all(np.isfinite(losses)) and len(samples[0]) >= 4
        backward = [row for row in sess.history.rows if row["op"] == "forward_backward"]
        assert [row["loss:sum"] for row in backward] == pytest.approx(losses)
        assert all(row["num_tokens:sum"] > 0 for row in backward)
        assert sess.step == 3 and sess.policy.weights_version == 3


def test_save_and_load_state(remote_url: Served) -> None:
    """save_state, list_checkpoints, and load_state by tinker:// path: the run continues on a new model
    holding the saved weights (the load is that model's first request), and the history says so."""
    with connect(remote_url) as sess:
        sess.policy.forward_backward([ce_datum(TOKENS[0])], "cross_entropy").result()
        sess.policy.optim_step({"learning_rate": 1e-2}).result()
        saved = sess.policy.save_state("one").result()
        assert saved.path.startswith("tinker://")
        listed = sess.list_checkpoints()
        assert [(c.name, c.kind, c.step, c.tinker_path) for c in listed] == [("one", "state", 1, saved.path)]
        before = sess.policy.forward([ce_datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
        remote_before = sess.engine.remote_model_id(sess.model_id)
        for _ in range(2):
            sess.policy.forward_backward([ce_datum(TOKENS[1])], "cross_entropy").result()
            sess.policy.optim_step({"learning_rate": 1e-1}).result()
        moved = sess.policy.forward([ce_datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
        assert abs(moved - before) > 1e-3
        sess.load_state(saved.path)
        after = sess.policy.forward([ce_datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
        assert after == pytest.approx(before, rel=1e-5)
        assert sess.step == 1 and sess.policy.weights_version == 4
        remote_after = sess.engine.remote_model_id(sess.model_id)
        assert remote_after != remote_before
        loads = [row for row in sess.history.rows if row["op"] == "load_state"]
        assert [(r["step"], r["new_server_model"], r["optimizer_restored"]) for r in loads] == [(1, 1.0, 1.0)]
        assert [c.tinker_path for c in sess.list_checkpoints()] == [saved.path]  # the earlier model's too
        # the run goes on training on the loaded model
        sess.policy.forward_backward([ce_datum(TOKENS[0])], "cross_entropy").result()
        sess.policy.optim_step({"learning_rate": 1e-2}).result()
        assert sess.step == 2
        with pytest.raises(RuntimeError, match="load_state"):
            sess.load_state(saved.path.replace("one", "missing"))
        assert sess.engine.remote_model_id(sess.model_id) == remote_after  # a failed load changes nothing
        sess.delete_checkpoint("one")  # on the model that saved it
        assert sess.list_checkpoints() == []


def step_then_forward(sess: wb.Session) -> tuple[float, float]:
    """One SFT step's loss, then a forward's loss after it."""
    loss = sess.policy.forward_backward([ce_datum(TOKENS[1])], "cross_entropy").result().metrics["loss:sum"]
    sess.policy.optim_step({"learning_rate": 1e-1}).result()
    return loss, sess.policy.forward([ce_datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]


def test_a_weights_only_load_starts_the_optimizer_afresh(remote_url: Served) -> None:
    """SDK 0.38's `load_state` ("weights only, optimizer resets") through a remote session: a run that
    trained on, with a gradient pending, loads a checkpoint and steps exactly as a new session that loads
    the same checkpoint (equal weights before the step, so kept Adam moments or a kept pending gradient
    would show)."""
    with connect(remote_url) as sess:
        sess.policy.forward_backward([ce_datum(TOKENS[0])], "cross_entropy").result()
        sess.policy.optim_step({"learning_rate": 1e-2}).result()
        path = sess.policy.save_state("one").result().path
        for _ in range(2):
            sess.policy.forward_backward([ce_datum(TOKENS[1])], "cross_entropy").result()
            sess.policy.optim_step({"learning_rate": 1e-1}).result()
        sess.policy.forward_backward([ce_datum(TOKENS[1])], "cross_entropy").result()  # pending
        sess.policy.load_state(path).result()
        loaded = step_then_forward(sess)
    with connect(remote_url) as fresh:
        fresh.policy.load_state(path).result()
        expected = step_then_forward(fresh)
    assert loaded == pytest.approx(expected, rel=1e-5), (loaded, expected)


def test_run_loop_and_panel(remote_url: Served) -> None:
    """The background run loop steps with live settings; the panel's status names the engine's URL."""
    with connect(remote_url) as sess:
        run = sess.run(sft_step, 3, adam_params={"learning_rate": 1e-2}, paused=True)
        run.step()
        run.wait()
        run.set(learning_rate=2e-2)
        run.resume()
        assert run.wait(300) is wb.RunState.FINISHED, run.traceback
        steps = [row for row in sess.history.rows if row["op"] == "run_step"]
        assert len(steps) == 3 and all(np.isfinite(row["loss"]) for row in steps)
        panel = sess.panel()
        try:
            panel.status.refresh()
            status = panel.status.widget.value
            assert f'data-field="engine"><b>engine</b> {remote_url.url}' in status
            assert 'data-field="memory"' not in status
        finally:
            panel.close()
        sample = sess.sampling_client().sample(PROMPT, 1, {"max_tokens": 3, "seed": 0}).result()
        assert wb.render_sample(sess.tokenizer, sample.sequences[0], wb.ModelInput.from_ints(PROMPT))
        assert remote_url.url in repr(sess)


def test_close_frees_the_servers_models(remote_url: Served) -> None:
    """Sessions opened and closed one after another never run out of server room: closing frees the
    models (SkyRL holds 4 adapters here and keeps them until told to unload them)."""
    for _ in range(5):
        with connect(remote_url) as sess:
            sess.policy.forward_backward([ce_datum(TOKENS[0])], "cross_entropy").result()
            sess.policy.optim_step({"learning_rate": 1e-2}).result()
            sess.load_state(sess.policy.save_state("s").result().path)  # a replaced model is freed too
        assert sess.closed


def test_a_session_that_names_no_adapter_gets_the_one_the_server_builds(remote_url: Served) -> None:
    """A newcomer's first call, `Session.connect(url, base_model=...)`, works on every server: with no
    `lora`, the session takes `LoraConfig()` in the layout the server builds, and says which."""
    expected = SKYRL.default_lora() if remote_url.engine == "skyrl" else wb.LoraConfig()
    assert expected.rank == wb.LoraConfig().rank
    with wb.Session.connect(remote_url.url, base_model=remote_url.base_model, wandb=False) as sess:
        assert sess.config.lora == expected
        layers = "attn+mlp" if remote_url.engine == "skyrl" else "attn+mlp+unembed"
        assert f"rank=32, alpha=32, {layers}, {remote_url.url}" in repr(sess)
        loss = (
            sess.policy.forward_backward([ce_datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
        )
        assert np.isfinite(loss)
    if remote_url.engine == "skyrl":  # an explicit adapter the server would not honour is still refused
        with pytest.raises(wb.RemoteUnsupportedError, match="train_unembed=True"):
            wb.Session.connect(
                remote_url.url, base_model=remote_url.base_model, lora=wb.LoraConfig(rank=4), wandb=False
            )


@pytest.mark.skyrl
def test_load_state_on_a_full_server_takes_the_replaced_models_slot(skyrl_server) -> None:
    """SkyRL holds at most `max_lora_adapters` models: with every slot taken, a new session is refused with
    a message that says so, and a `load_state` frees the model it replaces before creating the new one
    (where it used to fail with "Maximum number of LoRA adapters (4) reached"); a wrong path still changes
    nothing."""
    served = Served("skyrl", skyrl_server.url, skyrl_server.base_model)
    with connect(served) as sess:
        sess.policy.forward_backward([ce_datum(TOKENS[0])], "cross_entropy").result()
        sess.policy.optim_step({"learning_rate": 1e-2}).result()
        saved = sess.policy.save_state("one").result().path
        before = sess.policy.forward([ce_datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
        others: list[wb.Session] = []
        try:
            while True:  # fill the server (its slots: max_lora_adapters, less any it keeps for itself)
                assert len(others) < 4
                try:
                    others.append(connect(served))
                except RuntimeError as error:
                    assert "has no free adapter slot" in str(
                        error
                    ) and "Maximum number of LoRA adapters" in str(error)
                    break
            remote_before = sess.engine.remote_model_id(sess.model_id)
            with pytest.raises(RuntimeError, match="load_state"):
                sess.load_state(saved.replace("one", "missing"))
            assert (
                sess.engine.remote_model_id(sess.model_id) == remote_before
            )  # a failed load changes nothing
            sess.policy.forward_backward([ce_datum(TOKENS[1])], "cross_entropy").result()  # queued on the old
            sess.policy.load_state(saved).result()
            assert sess.engine.remote_model_id(sess.model_id) != remote_before
            after = sess.policy.forward([ce_datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
            assert after == pytest.approx(before, rel=1e-5)
        finally:
            for other in others:
                other.close()


def test_what_the_remote_engine_cannot_do_is_refused_before_sending(remote_url: Served) -> None:
    with connect(remote_url) as sess:
        local_only = sorted(set(wb.LOSSES) - set(sess.engine.losses))
        assert local_only  # the local engine has losses this server cannot run
        if remote_url.engine == "skyrl":  # from what the server is known to be: its capabilities list none
            assert sess.engine.losses == ("cross_entropy", "importance_sampling", "ppo", "cispo")
        else:
            assert set(sess.engine.losses) == set(SDK_LOSSES) & set(wb.LOSSES)  # as the server lists them
        cases = [
            (lambda: sess.policy.forward_backward([ce_datum(TOKENS[0])], local_only[0]), "accepts"),
            (lambda: sess.create_critic(), "no critic"),
            (lambda: sess.state_digest(), "state_digest"),
            (lambda: sess.load_state(str(sess.model_dir)), "tinker://"),
            (lambda: sess.export_merged(sess.model_dir / "merged"), "live on the engine"),
            (lambda: sess.serve(), "in this process"),
        ]
        for call, message in cases:
            with pytest.raises(ValueError, match=message):
                call()
        assert sess.history.rows == [] and sess.step == 0 and sess.critic is None
        # nothing half-sent: the session goes on
        sess.policy.forward_backward([ce_datum(TOKENS[0])], "cross_entropy").result()
        assert op_rows(sess.history) == [("forward_backward", "policy", 0)]
    with pytest.raises(wb.RemoteUnsupportedError, match="serves \\["):
        wb.Session.connect(remote_url.url, base_model="smollm2-135m", wandb=False)
    default_lora = wb.LoraConfig(rank=4)  # trains the unembedding, which SkyRL never adapts
    if remote_url.engine == "skyrl":
        with pytest.raises(wb.RemoteUnsupportedError, match="train_unembed=True"):
            wb.Session.connect(
                remote_url.url, base_model=remote_url.base_model, lora=default_lora, wandb=False
            )
    else:
        wb.Session.connect(
            remote_url.url, base_model=remote_url.base_model, lora=default_lora, wandb=False
        ).close()


# ---------------------------------------------------------------------------------------------- workbench serve


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
            rows = (sess.model_dir / "history.jsonl").read_text().splitlines()
            assert len(rows) == len(sess.history.rows)  # the JSONL file is written here for both
    local, remote = results["local"], results["remote"]
    assert [r["loss"] for r in remote[0]] == pytest.approx([r["loss"] for r in local[0]], rel=1e-5)
    assert [r["first_token"] for r in remote[0]] == [r["first_token"] for r in local[0]]
    assert remote[1][0] == pytest.approx(local[1][0], rel=1e-4)
    assert remote[1][1] == local[1][1]
    assert remote[2] == local[2]  # the same operations, in the same order, at the same steps
    assert remote[3:] == local[3:] == (5, 5)


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
            s.policy.forward_backward([ce_datum(TOKENS[0])], "cross_entropy").result()
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
            sess.policy.forward([ce_datum(TOKENS[0])], "cross_entropy").result(timeout=30)
        assert time.monotonic() - started < 10
        assert sess.plot("loss:sum").axes and len(sess.history.rows) == 4
        panel = sess.panel()  # usable with the engine gone, and says so where it needs the engine
        try:
            assert "stopped answering" in panel.checkpoints.feedback.text
            assert f'data-field="engine"><b>engine</b> {doomed.url}' in panel.status.widget.value
        finally:
            panel.close()
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
            out = sess.policy.forward_backward_custom(
                [ce_datum(t) for t in TOKENS], negative_logprob
            ).result()
            sess.policy.optim_step({"learning_rate": 1e-2}).result()
            after = sess.policy.forward([ce_datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"]
            results.append((out.metrics["custom"], out.metrics["loss:sum"], after))
    assert results[1] == pytest.approx(results[0], rel=1e-5)


def test_sampling_fields_and_soft_targets_match_a_local_session(server: Server) -> None:
    """The SDK's top-K, target-id and prompt-draw sampling fields, and (N, K) soft-target cross-entropy,
    through the remote engine give what the local engine gives."""
    import torch

    prompt = [5, 17, 42, 99, 100, 7, 8]
    ids = torch.full((len(prompt) - 1, 2), -1)
    ids[0, 0], ids[3, 1] = 3, 10
    soft = wb.Datum(
        model_input=wb.ModelInput.from_ints(prompt),
        loss_fn_inputs={"target_tokens": torch.arange(14).reshape(7, 2), "weights": torch.full((7, 2), 0.5)},
    )
    results = []
    for sess in (
        wb.Session("tiny", LORA, seed=0, sampler="hf", wandb=False),
        wb.Session.connect(server.url, base_model="tiny", lora=LORA, seed=0, wandb=False),
    ):
        with sess:
            response = (
                sess.sampling_client()
                .sample(
                    prompt,
                    2,
                    wb.SamplingParams(max_tokens=3, temperature=0.5, seed=4),
                    True,
                    topk_prompt_logprobs=4,
                    topk_sample_logprobs=2,
                    target_prompt_logprobs=ids,
                    prompt_alt_tokens_k=3,
                )
                .result()
            )
            out = sess.policy.forward([soft], "cross_entropy").result()
            results.append((response, out))
    (local, local_out), (remote, remote_out) = results
    for ours, theirs in zip(local.topk_prompt_logprobs[1:], remote.topk_prompt_logprobs[1:], strict=True):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [v for _, v in ours] == pytest.approx([v for _, v in theirs], abs=1e-5)
    assert remote.target_prompt_logprobs.to_numpy() == pytest.approx(
        local.target_prompt_logprobs.to_numpy(), abs=1e-5
    )
    assert remote.prompt_alt_tokens.tokens == local.prompt_alt_tokens.tokens
    for ours, theirs in zip(local.sequences, remote.sequences, strict=True):
        assert ours.tokens == theirs.tokens
        assert ours.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
        assert [[t for t, _ in row] for row in ours.topk_logprobs] == [
            [t for t, _ in row] for row in theirs.topk_logprobs
        ]
    assert remote_out.loss_fn_outputs[0]["logprobs"].shape == [7, 2]
    assert remote_out.metrics["loss:sum"] == pytest.approx(local_out.metrics["loss:sum"], rel=1e-5)


# ---------------------------------------------------------------------------------------------- the adapters


def test_relay_adds_marked_sequence_ids_only_where_the_server_sent_none() -> None:
    request = json.dumps({"num_samples": 3, "seq_id": 1}).encode()
    older = json.loads(
        with_sequence_ids(request, json.dumps({"request_id": "7", "status": "pending"}).encode())
    )
    ids = older["sample_sequence_ids"]
    assert len(ids) == len(set(ids)) == 3 and all(i.startswith(MADE_UP_ID_PREFIX) for i in ids)
    assert older["request_id"] == "7"
    issued = json.dumps({"request_id": "8", "sample_sequence_ids": ["s1", "s2", "s3"]}).encode()
    assert with_sequence_ids(request, issued) == issued


def test_client_metrics_from_elementwise_loss_and_weights() -> None:
    """loss:sum = Σ elementwise_loss; num_tokens:sum counts non-zero weights (else advantages)."""
    data = [
        ce_datum(TOKENS[0]),
        wb.Datum(
            model_input=wb.ModelInput.from_ints([1, 2, 3]),
            loss_fn_inputs={
                "target_tokens": [2, 3, 4],
                "logprobs": [0.0] * 3,
                "advantages": [0.0, 0.5, -0.5],
            },
        ),
    ]
    outputs = [
        {"elementwise_loss": wb.TensorData.from_numpy(np.array([0.5] * 6, dtype=np.float32))},
        {"elementwise_loss": wb.TensorData.from_numpy(np.array([0.0, 1.25, -0.25], dtype=np.float32))},
    ]
    assert with_client_metrics({}, outputs, data) == {"loss:sum": 4.0, "num_tokens:sum": 8.0}
    sent = {"loss:sum": 9.0, "num_tokens:sum": 1.0, "ratio:mean": 1.0}
    assert with_client_metrics(sent, outputs, data) == sent  # what the server sent is kept


def test_skyrl_profile() -> None:
    assert SKYRL.rename_metrics({"skyrl.ai/grad_norm": 2.0, "skyrl.ai/learning_rate": 0.1}) == {
        "grad_norm": 2.0
    }
    assert SKYRL.aligned_prompt_logprobs([-1.0, -2.0], 3) == [None, -1.0, -2.0]
    assert TINKER_PROTOCOL.aligned_prompt_logprobs([None, -1.0, -2.0], 3) == [None, -1.0, -2.0]
    assert SKYRL.adapter_layout is not None
    assert SKYRL.adapter_layout.differences(LORA) == []
    assert SKYRL.adapter_layout.differences(wb.LoraConfig(rank=4, alpha=16.0)) == [
        "alpha=16.0 (it builds 32.0)",
        "train_unembed=True (it builds False)",
    ]
