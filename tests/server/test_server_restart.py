"""`workbench serve` restarted on the same models root: what a client saved before the restart loads and
samples after it, and a client of the server that went away gets an error, not a wait."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import tinker

ROOT = Path(__file__).resolve().parents[2]
TOKENS = [5, 17, 33, 48, 60, 71, 2]
CUT_OFF_BOUND_S = 60.0
"""How long a call of a client whose server restarted may take to fail: measured 0.7 s on 2 busy cores
(the new server answers 404 "no model ... on this server (its session may have ended)"; the SDK does
not retry a 404)."""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextmanager
def serving(models_root: Path, port: int) -> Iterator[str]:
    """`workbench serve --base-model tiny` on `port` with `models_root` as its models root, stopped with
    SIGINT (a clean exit) when the block ends; yields its URL."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WORKBENCH_RUNS": str(models_root)}
    command = [sys.executable, "-m", "workbench.cli", "serve", "--base-model", "tiny"]
    command += ["--port", str(port), "--no-wandb"]
    server = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        assert server.stdout is not None
        for line in server.stdout:
            lines.append(line)
            if "serving the Tinker API at" in line:
                break
        assert server.poll() is None, "".join(lines)
        yield lines[-1].split(" at ")[-1].strip()
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
        assert server.stdout is not None
        output = server.stdout.read()
    assert server.returncode == 0, output


def _datum(tokens: list[int]) -> tinker.Datum:
    return tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def _loss(model: tinker.TrainingClient) -> float:
    return model.forward([_datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"]


def test_a_restarted_server_loads_the_states_saved_before_and_cuts_off_old_clients(tmp_path: Path) -> None:
    port = _free_port()
    params = tinker.SamplingParams(max_tokens=4, seed=5)
    prompt = tinker.ModelInput.from_ints(TOKENS[:4])
    before: tinker.ServiceClient | None = None
    try:
        with serving(tmp_path / "runs", port) as url:
            before = tinker.ServiceClient(base_url=url, api_key="tml-local")
            model = before.create_lora_training_client(base_model="tiny", rank=4).result()
            model.forward_backward([_datum(TOKENS)], "cross_entropy").result()
            model.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
            saved_loss = _loss(model)
            model.save_state("saved").result()
            sampler_path = model.save_weights_for_sampler("sampler").result().path
            sampler = before.create_sampling_client(model_path=sampler_path).result()
            saved_sample = sampler.sample(prompt, 1, params).result()
            model_id = model.model_id

        # `before` stays open across the restart, as a notebook's client does when its server goes away
        with serving(tmp_path / "runs", port) as url:
            started = time.monotonic()
            try:
                _loss(model)
            except tinker.TinkerError as cut_off:
                error = str(cut_off)
            else:
                raise AssertionError("a model of the server before the restart answered")
            assert time.monotonic() - started < CUT_OFF_BOUND_S
            assert "no session" in error or "no model" in error, error

            after = tinker.ServiceClient(base_url=url, api_key="tml-local")
            try:
                listed = after.create_rest_client().list_checkpoints(model_id).result().checkpoints
                state_path = next(c.tinker_path for c in listed if c.checkpoint_type == "training")
                assert state_path == f"tinker://{model_id}/weights/saved"
                resumed = after.create_training_client_from_state_with_optimizer(state_path).result()
                assert _loss(resumed) == saved_loss
                sampler = after.create_sampling_client(model_path=sampler_path).result()
                assert sampler.sample(prompt, 1, params).result().sequences[0].tokens == (
                    saved_sample.sequences[0].tokens
                )
            finally:
                after.close("success").result(timeout=60)
    finally:
        if before is not None and before._session_holder is not None:
            before._session_holder.close()  # its server is gone: only its own loops stop
