"""The Tinker REST server, driven by the unmodified `tinker` SDK (0.38) over HTTP.

Each test serves a tiny session from this process (`Session.serve()`), runs an SDK operation against
it, and checks the values against the in-process API on the same data: a twin model made on the same
engine with the same LoRA settings and seed starts from the same weights, so losses, logprobs, samples
with the same seed and saved adapters must agree exactly.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import peft
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types
from tinker.lib.public_interfaces.training_client import fetch_training_info

import workbench as wb
from tests.datums import ce_datum, sdk_ce_datum
from tests.tinker_api.test_service_client import check_a_weights_only_load_starts_the_optimizer_afresh
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.server import ServerConfig, TinkerServer

API_KEY = "tml-test-key-0123"
TOKENS = [[5, 17, 33, 48, 60, 71, 2], [9, 21, 40, 11, 3], [44, 45, 46, 47, 48, 49, 50, 51]]


def twin(sess: wb.Session) -> wb.TrainingClient:
    """An in-process model made like the SDK's `create_lora_training_client("tiny", rank=4, seed=0)`."""
    model_id = sess.engine.create_model(wb.LoraConfig(rank=4, seed=0)).result()
    return wb.TrainingClient(sess.engine, model_id)


ADAM = {
    "learning_rate": 1e-2,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "grad_clip_norm": 1.0,
}


def post(srv: TinkerServer, path: str, body: dict | bytes, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.url}/api/v1/{path}", content=content, headers=headers, timeout=30)


def retrieve(srv: TinkerServer, request_id: str, accept: str = "application/json") -> httpx.Response:
    while True:
        response = post(srv, "retrieve_future", {"request_id": request_id}, accept=accept)
        if (
            response.headers["content-type"].startswith("application/json")
            and response.json().get("type") == "try_again"
        ):
            continue
        return response


# ---------------------------------------------------------------------------------------------- training


def test_training_through_the_server_matches_in_process(
    sess: wb.Session, client: tinker.ServiceClient
) -> None:
    remote = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    local = twin(sess)
    info = remote.get_info()
    assert info.model_id.startswith(client.holder.get_session_id()) and info.lora_rank == 4
    assert info.model_data.model_name == sess.base_info.path  # a tokenizer loads from it
    assert remote.get_tokenizer().encode("hello") == sess.tokenizer.encode("hello")
    for step in range(2):
        batch = TOKENS if step == 0 else TOKENS[::-1]
        # submitted back to back before waiting, as the cookbook does: the server keeps seq_id order
        futures = (
            remote.forward_backward([sdk_ce_datum(t) for t in batch], "cross_entropy"),
            remote.optim_step(types.AdamParams(**ADAM)),
        )
        theirs, their_step = (f.result() for f in futures)
        ours = local.forward_backward([ce_datum(t) for t in batch], "cross_entropy").result()
        our_step = local.optim_step(ADAM).result()
        assert theirs.metrics == ours.metrics
        for their_out, our_out in zip(theirs.loss_fn_outputs, ours.loss_fn_outputs, strict=True):
            np.testing.assert_array_equal(their_out["logprobs"].to_numpy(), our_out["logprobs"].to_numpy())
            np.testing.assert_array_equal(
                their_out["elementwise_loss"].to_numpy(), our_out["elementwise_loss"].to_numpy()
            )
        assert their_step.metrics == our_step.metrics
    held_out = remote.forward([sdk_ce_datum(TOKENS[0])], "cross_entropy").result()
    assert held_out.metrics == local.forward([ce_datum(TOKENS[0])], "cross_entropy").result().metrics
    # the history names the model each row was for, remote ones included
    adapters = {
        sess.engine.model_status(remote.model_id).adapter,
        sess.engine.model_status(local.model_id).adapter,
    }
    rows = [row for row in sess.history if row["op"] == "forward_backward"]
    assert {row["model"] for row in rows} == adapters and len(rows) == 4


def test_sampling_through_the_server_matches_in_process(
    sess: wb.Session, client: tinker.ServiceClient, sampler: str
) -> None:
    base_model = sess.engine.config.base_model
    remote = client.create_lora_training_client(base_model=base_model, rank=4, seed=0).result()
    local = twin(sess)
    remote.forward_backward([sdk_ce_datum(TOKENS[0])], "cross_entropy")
    remote.optim_step(types.AdamParams(**ADAM)).result()
    local.forward_backward([ce_datum(TOKENS[0])], "cross_entropy")
    local.optim_step(ADAM).result()
    prompt = TOKENS[1]
    params = {"max_tokens": 6, "seed": 123, "temperature": 1.0}
    sampler = remote.save_weights_and_get_sampling_client().result()
    theirs = sampler.sample(
        types.ModelInput.from_ints(prompt), 3, types.SamplingParams(**params), include_prompt_logprobs=True
    ).result()
    ours = local.save_weights_and_get_sampling_client().result()
    mine = ours.sample(prompt, 3, params, include_prompt_logprobs=True).result()
    assert [s.tokens for s in theirs.sequences] == [s.tokens for s in mine.sequences]
    for their_seq, our_seq in zip(theirs.sequences, mine.sequences, strict=True):
        np.testing.assert_allclose(their_seq.logprobs, our_seq.logprobs, rtol=0, atol=1e-6)
        assert their_seq.stop_reason == our_seq.stop_reason
    assert len({s.sequence_id for s in theirs.sequences}) == 3
    assert theirs.prompt_logprobs[0] is None
    np.testing.assert_allclose(theirs.prompt_logprobs[1:], mine.prompt_logprobs[1:], rtol=0, atol=1e-6)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    np.testing.assert_allclose(logprobs[1:], ours.compute_logprobs(prompt).result()[1:], rtol=0, atol=1e-5)
    # the base model costs nothing: a sampler of it needs no run
    base = client.create_sampling_client(base_model=base_model).result()
    base_result = base.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(**params)).result()
    in_process = sess.sampling_client(base=True).sample(prompt, 1, params).result()
    assert base_result.sequences[0].tokens == in_process.sequences[0].tokens


def test_several_models_share_the_base_up_to_the_limit(
    sess: wb.Session, client: tinker.ServiceClient
) -> None:
    clients = [client.create_lora_training_client(base_model="tiny", rank=4, seed=i) for i in range(5)]
    models = [c.result() for c in clients]
    assert len(set(sess.engine.model_ids())) == 6  # the session's own run and five remote ones
    with pytest.raises(tinker.RequestFailedError, match="max_models=6"):
        client.create_lora_training_client(base_model="tiny", rank=4).result()
    # a base-model sampler takes no slot
    client.create_sampling_client(base_model="tiny").result()
    assert all(
        m.forward([sdk_ce_datum(TOKENS[0])], "cross_entropy").result().metrics["loss:sum"] > 0 for m in models
    )
    client.close("success").result()  # the session's models are freed; their files stay
    assert sess.engine.model_ids() == [sess.model_id]


# ---------------------------------------------------------------------------------------------- checkpoints


def test_checkpoints_through_the_server(sess: wb.Session, client: tinker.ServiceClient) -> None:
    remote = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    local = twin(sess)
    remote.forward_backward([sdk_ce_datum(t) for t in TOKENS], "cross_entropy")
    remote.optim_step(types.AdamParams(**ADAM))
    state = remote.save_state("s1").result()
    sampler_path = remote.save_weights_for_sampler("w1").result().path
    local.forward_backward([ce_datum(t) for t in TOKENS], "cross_entropy")
    local.optim_step(ADAM)
    ours = local.save_weights_for_sampler("w1").result()
    assert state.path == f"tinker://{remote.model_id}/weights/s1"
    assert sampler_path == f"tinker://{remote.model_id}/sampler_weights/w1"
    folder = sess.engine.checkpoint_folder(sampler_path, "sampler")
    their_tensors = load_file(folder / "adapter_model.safetensors")
    our_tensors = load_file(Path(ours.folder) / "adapter_model.safetensors")
    assert their_tensors.keys() == our_tensors.keys()
    assert all(torch.equal(their_tensors[k], our_tensors[k]) for k in our_tensors)
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(folder))  # peft reads it on its own
    with torch.no_grad():
        logits = loaded(input_ids=torch.tensor([TOKENS[0][:-1]])).logits[0]
    logprobs = torch.log_softmax(logits, -1)[torch.arange(len(TOKENS[0]) - 1), torch.tensor(TOKENS[0][1:])]
    after = local.forward([ce_datum(TOKENS[0])], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    torch.testing.assert_close(logprobs, after.to_torch(), atol=1e-5, rtol=0)

    # a sampler of the saved weights samples what the in-process one does
    params = types.SamplingParams(max_tokens=5, seed=7)
    from_path = client.create_sampling_client(model_path=sampler_path).result()
    assert from_path.get_base_model() == sess.base_info.path
    sample = from_path.sample(types.ModelInput.from_ints(TOKENS[1]), 2, params).result()
    in_process = (
        local.save_weights_and_get_sampling_client()
        .result()
        .sample(TOKENS[1], 2, params.model_dump())
        .result()
    )
    assert [s.tokens for s in sample.sequences] == [s.tokens for s in in_process.sequences]
    from_state = client.create_sampling_client(model_path=state.path).result()  # a state checkpoint's policy
    again = from_state.sample(types.ModelInput.from_ints(TOKENS[1]), 2, params).result()
    assert [s.tokens for s in again.sequences] == [s.tokens for s in in_process.sequences]

    # resumed models continue as the original does: with the optimizer, and weights only
    resumed = client.create_training_client_from_state_with_optimizer(state.path).result()
    weights_only = client.create_training_client_from_state(state.path).result()
    assert resumed.model_id != remote.model_id and resumed.get_info().lora_rank == 4
    step = [sdk_ce_datum(TOKENS[2])]
    original = [remote.forward_backward(step, "cross_entropy"), remote.optim_step(types.AdamParams(**ADAM))]
    again = [resumed.forward_backward(step, "cross_entropy"), resumed.optim_step(types.AdamParams(**ADAM))]
    fresh = [
        weights_only.forward_backward(step, "cross_entropy"),
        weights_only.optim_step(types.AdamParams(**ADAM)),
    ]
    assert original[0].result().metrics == again[0].result().metrics == fresh[0].result().metrics
    assert original[1].result().metrics == again[1].result().metrics
    fresh[1].result()
    assert sess.engine.model_status(weights_only.model_id).step == 1  # a fresh optimizer
    assert (
        sess.engine.model_status(resumed.model_id).step == sess.engine.model_status(remote.model_id).step == 2
    )
    check = [sdk_ce_datum(TOKENS[0])]
    assert (
        remote.forward(check, "cross_entropy").result().metrics
        == resumed.forward(check, "cross_entropy").result().metrics
    )
    # the deprecated load_state on a live model: back to the saved weights
    with pytest.warns(FutureWarning):
        remote.load_state_with_optimizer(state.path).result()
    back = remote.forward(check, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(back, after.to_numpy())


# ---------------------------------------------------------------------------------------------- protocol


def test_requests_run_in_seq_order_and_retries_get_the_same_future(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient
) -> None:
    remote = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    from tinker.proto import tinker_public_pb2 as pb

    def fwdbwd(seq_id: int) -> bytes:
        message = pb.ForwardBackwardRequest(model_id=remote.model_id, seq_id=seq_id, loss_fn="cross_entropy")
        datum = message.data.add()
        datum.model_input.add().encoded_text.tokens = np.array(TOKENS[0][:-1], dtype="<i4").tobytes()
        for name, values, dtype in (
            ("target_tokens", TOKENS[0][1:], pb.DTYPE_INT64),
            ("weights", [1.0] * 6, pb.DTYPE_FLOAT32),
        ):
            tensor = datum.loss_fn_inputs[name]
            tensor.dtype, tensor.dense = (
                dtype,
                np.array(values, dtype="<i8" if dtype == pb.DTYPE_INT64 else "<f4").tobytes(),
            )
            tensor.shape.append(6)
        return message.SerializeToString()

    optim = {"model_id": remote.model_id, "seq_id": 2, "adam_params": ADAM, "type": "optim_step"}
    late = post(srv, "optim_step", optim).json()  # seq 2 arrives first: it waits for seq 1
    time.sleep(0.3)
    assert sess.engine.model_status(remote.model_id).step == 0
    early = post(srv, "forward_backward", fwdbwd(1), **{"content-type": "application/x-protobuf"}).json()
    step = retrieve(srv, late["request_id"]).json()
    assert step["metrics"]["grad_norm"] > 0  # the gradient of seq 1 was there
    assert sess.engine.model_status(remote.model_id).step == 1
    assert (
        retrieve(srv, early["request_id"], "application/x-protobuf").headers["content-type"]
        == "application/x-protobuf"
    )
    # a retry gets the same future; the same seq_id with other content is refused and changes nothing
    assert post(srv, "optim_step", optim).json()["request_id"] == late["request_id"]
    digest = sess.engine.state_digest()
    conflict = post(srv, "optim_step", {**optim, "adam_params": {**ADAM, "learning_rate": 1.0}})
    assert conflict.status_code == 409 and "already used" in conflict.json()["error"]
    assert sess.engine.state_digest() == digest


def test_zstd_bodies_and_json_results_for_clients_that_ask(sess: wb.Session) -> None:
    server = TinkerServer(sess.engine, ServerConfig(compress_requests=True))
    try:
        with tinker.ServiceClient(base_url=server.url) as service_client:
            remote = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
            local = twin(sess)
            theirs = remote.forward_backward([sdk_ce_datum(t) for t in TOKENS], "cross_entropy").result()
            assert (
                theirs.metrics
                == local.forward_backward([ce_datum(t) for t in TOKENS], "cross_entropy").result().metrics
            )
    finally:
        server.stop()


def test_a_critic_through_the_server(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient
) -> None:
    """SkyRL's critic: `create_model` with `model_role: "critic"` becomes the critic of the session's run;
    `forward(data, "ppo_critic")` returns values."""
    policy = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    holder = client.holder
    seq = holder.get_training_client_id()
    body = {
        "session_id": holder.get_session_id(),
        "model_seq_id": seq,
        "base_model": "tiny",
        "lora_config": {"rank": 4, "seed": 3, "train_unembed": True, "train_mlp": True, "train_attn": True},
        "model_role": "critic",
        "type": "create_model",
    }
    created = post(srv, "create_model", body, **{"x-api-key": "tml-local"}).json()
    model_id = retrieve(srv, created["request_id"]).json()["model_id"]
    info = holder.run_coroutine_threadsafe(fetch_training_info(holder, model_id)).result()
    critic = tinker.TrainingClient(holder, seq, model_id, info=info)
    assert sess.engine.model_status(policy.model_id).critic_lora.rank == 4
    local = twin(sess)
    sess.engine.create_critic(local.model_id, wb.LoraConfig(rank=4, seed=3, train_unembed=False)).result()
    local_critic = wb.TrainingClient(sess.engine, local.model_id, wb.Role.CRITIC)

    def floats(value: float, n: int) -> types.TensorData:
        return types.TensorData(data=[value] * n, dtype="float32", shape=[n])

    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"values": floats(0.0, len(t) - 1), "returns": floats(1.0, len(t) - 1)},
        )
        for t in TOKENS
    ]
    ours_data = [
        wb.Datum(
            model_input=wb.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"values": [0.0] * (len(t) - 1), "returns": [1.0] * (len(t) - 1)},
        )
        for t in TOKENS
    ]
    theirs = critic.forward_backward(data, "ppo_critic").result()
    critic.optim_step(types.AdamParams(**ADAM)).result()
    ours = local_critic.forward_backward(ours_data, "ppo_critic").result()
    local_critic.optim_step(ADAM).result()
    assert theirs.metrics == ours.metrics
    values = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1]), loss_fn_inputs={}) for t in TOKENS]
    their_values = critic.forward(values, "ppo_critic").result().loss_fn_outputs
    our_values = (
        local_critic.forward(
            [wb.Datum(model_input=wb.ModelInput.from_ints(t[:-1])) for t in TOKENS], "ppo_critic"
        )
        .result()
        .loss_fn_outputs
    )
    for theirs_out, ours_out in zip(their_values, our_values, strict=True):
        np.testing.assert_array_equal(theirs_out["values"].to_numpy(), ours_out["values"].to_numpy())
    assert np.abs(their_values[0]["values"].to_numpy()).sum() > 0
    critic_rows = [
        row for row in sess.history if row["op"] == "forward_backward" and row["model"].startswith("critic")
    ]
    assert len(critic_rows) == 2


def test_sessions_that_stop_heartbeating_expire_and_free_their_models(sess: wb.Session) -> None:
    server = TinkerServer(sess.engine, ServerConfig(session_timeout_s=1.0))
    try:
        session_id = post(server, "create_session", {"tags": [], "sdk_version": "test"}).json()["session_id"]
        body = {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}
        request_id = post(server, "create_model", body).json()["request_id"]
        model_id = retrieve(server, request_id).json()["model_id"]
        assert model_id in sess.engine.model_ids()
        deadline = time.monotonic() + 20
        while model_id in sess.engine.model_ids() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sess.engine.model_ids() == [sess.model_id]
        gone = post(server, "session_heartbeat", {"session_id": session_id})
        assert gone.status_code == 410 and "expired" in gone.json()["error"]
        # the client's close() at the end still succeeds: there is nothing left to free
        assert (
            post(server, f"sessions/{session_id}/finish", {"reason": {"type": "success"}}).status_code == 200
        )
    finally:
        server.stop()


def test_an_api_key_is_checked_and_required_off_loopback(
    sess: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="give an api_key"):
        sess.serve(host="0.0.0.0")
    with pytest.raises(ValueError, match="must start with 'tml-'"):
        sess.serve(api_key="secret")
    server = sess.serve(api_key=API_KEY)
    monkeypatch.setenv("TINKER_API_KEY", "tml-wrong-key-000")
    with (
        pytest.raises(tinker.AuthenticationError, match="missing or wrong API key"),
        tinker.ServiceClient(base_url=server.url) as refused,
    ):
        refused.create_lora_training_client(base_model="tiny", rank=4).result()
    assert httpx.get(f"{server.url}/api/v1/healthz").status_code == 401
    with tinker.ServiceClient(base_url=server.url, api_key=API_KEY) as service_client:
        assert (
            service_client.create_lora_training_client(base_model="tiny", rank=4)
            .result()
            .get_info()
            .lora_rank
            == 4
        )


def test_the_server_runs_beside_a_busy_kernel_thread(sess: wb.Session, client: tinker.ServiceClient) -> None:
    """The server has its own loop: a client blocking the calling thread (as `.result()` blocks a kernel)
    is answered, and the session's own operations interleave with the remote ones."""
    remote = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    results: list[float] = []
    worker = threading.Thread(
        target=lambda: results.extend(
            remote.forward([sdk_ce_datum(t)], "cross_entropy").result().metrics["loss:sum"] for t in TOKENS
        )
    )
    worker.start()
    for t in TOKENS:
        sess.policy.forward([ce_datum(t)], "cross_entropy").result()
    worker.join(60)
    assert len(results) == 3


def test_a_sampling_session_ids_come_with_the_future(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient, sampler: str
) -> None:
    sampling_client = client.create_sampling_client(base_model=sess.engine.config.base_model).result()
    holder = client.holder
    body = {
        "sampling_session_id": sampling_client._sampling_session_id,
        "seq_id": 0,
        "num_samples": 2,
        "prompt": {"chunks": [{"tokens": TOKENS[0], "type": "encoded_text"}]},
        "sampling_params": {"max_tokens": 3, "seed": 1},
    }
    first = post(srv, "asample", body).json()
    assert len(first["sample_sequence_ids"]) == 2
    assert post(srv, "asample", body).json() == first  # a retry: the same future, the same ids
    response = retrieve(srv, first["request_id"]).json()
    assert len(response["sequences"]) == 2 and response["sequences"][0]["stop_reason"] == "length"
    assert holder.get_session_id()


def test_the_panel_shows_remote_models_and_their_operations_live(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient
) -> None:
    panel = sess.panel(metrics=("loss:sum",))
    panel.refresh()
    status = panel.status.widget.value
    assert '"models"><b>models</b> policy</span>' in status and srv.url in status
    remote = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    remote.forward_backward([sdk_ce_datum(TOKENS[0])], "cross_entropy")
    remote.optim_step(types.AdamParams(**ADAM)).result()
    panel.refresh()
    status = panel.status.widget.value
    assert "policy (this session) + policy_2 (step 1)" in status and remote.model_id in status
    figure = sess.plot("loss:sum")
    assert "policy_2/forward_backward" in [line.get_label() for line in figure.axes[0].get_lines()]
    client.close("success").result()
    panel.refresh()
    assert '"models"><b>models</b> policy</span>' in panel.status.widget.value
    srv.stop()
    panel.refresh()
    assert '"server"><b>serving</b> off' in panel.status.widget.value


def test_stopping_the_server_frees_the_clients_models(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient
) -> None:
    client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    assert len(sess.engine.model_ids()) == 2
    start = time.monotonic()
    srv.stop()
    assert time.monotonic() - start < 10 and not srv.running
    sess.engine.state_digest()  # after everything queued: the removal has run
    assert sess.engine.model_ids() == [sess.model_id]


def test_long_polls_answer_try_again_and_the_sdk_polls_on(
    sess: wb.Session, caplog: pytest.LogCaptureFixture
) -> None:
    server = TinkerServer(sess.engine, ServerConfig(long_poll_s=0.01))
    try:
        assert httpx.get(f"{server.url}/api/v1/healthz").json() == {"status": "ok"}
        with tinker.ServiceClient(base_url=server.url) as service_client:
            remote = service_client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
            local = twin(sess)
            batch = [TOKENS[i % 3] * 30 for i in range(96)]

            def polled() -> bool:
                return any("try_again" in record.getMessage() for record in caplog.records)

            # the worker is held until a poll has been answered "try again", so that answer never depends on
            # how fast the forward runs (0.07 s, against 10 ms polls, on a busy machine it outran one)
            held = threading.Event()
            sess.engine._state.submit(lambda: held.wait(60))

            def release_once_polled() -> None:
                deadline = time.monotonic() + 60
                while not polled() and time.monotonic() < deadline:
                    time.sleep(0.01)
                held.set()

            with caplog.at_level("WARNING", logger="tinker"):
                threading.Thread(target=release_once_polled, daemon=True).start()
                theirs = remote.forward([sdk_ce_datum(t) for t in batch], "cross_entropy").result()
            assert polled()
            assert (
                theirs.metrics
                == local.forward([ce_datum(t) for t in batch], "cross_entropy").result().metrics
            )
    finally:
        server.stop()


def test_the_engine_samples_under_the_ids_its_caller_names(sess: wb.Session) -> None:
    """The server promises a sample's sequence ids with the request, before the sequences exist; the
    engine gives its sequences (and its stability records) exactly those ids."""
    pin = sess.engine.pin_sampler(sess.model_id)
    params = {"max_tokens": 3, "seed": 1}
    named = sess.engine.sample(pin, SampleRequest(TOKENS[0], 2, params, sequence_ids=["r:0", "r:1"])).result()
    assert [s.sequence_id for s in named.sequences] == ["r:0", "r:1"]
    unnamed = sess.engine.sample(pin, SampleRequest(TOKENS[0], 2, params)).result()
    assert len({s.sequence_id for s in unnamed.sequences} | {"r:0", "r:1"}) == 4
    digest = sess.engine.state_digest()
    for bad in (["r:2"], ["r:2", "r:2"], ["r:2", ""]):
        with pytest.raises(ValueError, match="sequence_ids must be 2 distinct non-empty strings"):
            sess.engine.sample(pin, SampleRequest(TOKENS[0], 2, params, sequence_ids=bad))
    assert sess.engine.state_digest() == digest
    sess.engine.release_sampler(pin)


def test_results_are_dropped_once_fetched_or_stale() -> None:
    """A long run does not pile up results: a fetched one goes after a minute (time for a client that
    lost the response to fetch it again), an unfetched one after an hour."""
    import asyncio

    from workbench.server.future_table import KEEP_FINISHED_S, KEEP_RETRIEVED_S, FutureTable

    async def scenario() -> None:
        table = FutureTable(asyncio.get_running_loop())
        fetched, unfetched, pending = (table.add("forward_backward", "m") for _ in range(3))
        for entry in (fetched, unfetched):
            entry.finish(result={"ok": True})
        fetched.retrieved_at = fetched.finished_at
        start = fetched.finished_at
        table.sweep(now=start + KEEP_RETRIEVED_S / 2)
        assert len(table) == 3
        table.sweep(now=start + KEEP_RETRIEVED_S + 1)
        assert table.get(fetched.request_id) is None and table.get(unfetched.request_id) is unfetched
        table.sweep(now=start + KEEP_FINISHED_S + 1)
        assert table.get(unfetched.request_id) is None and table.get(pending.request_id) is pending

    asyncio.run(scenario())


def test_non_finite_metrics_reach_the_sdk_as_floats() -> None:
    """A step skipped for a non-finite gradient reports a NaN gradient norm; JSON has no NaN, but the
    SDK's parser (Python's json) reads the `NaN` token, so the server writes it rather than failing."""
    from workbench.server.app import TinkerJSONResponse

    body = TinkerJSONResponse({"metrics": {"grad_norm": float("nan"), "x": float("inf")}}).body
    parsed = json.loads(body)
    assert np.isnan(parsed["metrics"]["grad_norm"]) and parsed["metrics"]["x"] == float("inf")
    assert types.OptimStepResponse.model_validate(parsed).metrics["x"] == float("inf")


def test_a_weights_only_load_over_http_starts_the_optimizer_afresh(client: tinker.ServiceClient) -> None:
    check_a_weights_only_load_starts_the_optimizer_afresh(client)
