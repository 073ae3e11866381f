"""Bad input to every endpoint: the client sees our message, and nothing changes.

"Nothing changes" is checked as the house rule has it: `engine.state_digest()` (every model's weights,
gradients, optimizer state and counters, and the sampling generator) is byte-identical afterwards, the
engine holds the same models, and no file appeared under the runs root. And a model whose request
failed keeps working: the failed request consumed its seq_id, so the next one runs.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

import workbench as wb
from tests.datums import sdk_ce_datum
from workbench.server import ServerConfig, TinkerServer
from workbench.server.sessions import ENDED_SESSIONS_KEPT_S

TOKENS = [5, 17, 33, 48, 60, 71, 2]


@pytest.fixture
def remote(client: tinker.ServiceClient) -> tinker.TrainingClient:
    model = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    model.forward_backward(
        [sdk_ce_datum(TOKENS)], "cross_entropy"
    ).result()  # gradients pending: they must survive
    return model


def files_under(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


class Unchanged:
    """Snapshots what bad input must not change; `check()` compares."""

    def __init__(self, sess: wb.Session):
        self.sess = sess
        self.root = Path(os.environ["WORKBENCH_RUNS"])
        self.before = (sess.engine.state_digest(), sess.engine.model_ids(), files_under(self.root))

    def check(self) -> None:
        after = (self.sess.engine.state_digest(), self.sess.engine.model_ids(), files_under(self.root))
        assert after == self.before


def post(srv: TinkerServer, path: str, body: dict | bytes, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{srv.url}/api/v1/{path}", content=content, headers=headers, timeout=30)


def fwdbwd_proto(model_id: str, seq_id: int, tokens_bytes: bytes) -> bytes:
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    message.data.add().model_input.add().encoded_text.tokens = tokens_bytes
    return message.SerializeToString()


# ---------------------------------------------------------------------------------------------- through the SDK


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda m: m.forward_backward([sdk_ce_datum([5, 6, 10_000, 7])], "cross_entropy"),
            "outside the vocabulary",
        ),
        (lambda m: m.forward_backward([sdk_ce_datum(TOKENS)], "nope"), "unknown loss 'nope'"),
        (
            lambda m: m.forward_backward([sdk_ce_datum(TOKENS, advantages=[1.0] * 6)], "cross_entropy"),
            "advantages",
        ),
        (
            lambda m: m.forward(
                [
                    types.Datum(
                        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                        loss_fn_inputs={"target_tokens": TOKENS[1:3]},
                    )
                ],
                "cross_entropy",
            ),
            "target_tokens",
        ),
        (lambda m: m.forward_backward([sdk_ce_datum(TOKENS)], "ppo", {"clip_low_threshold": "x"}), "text"),
        (lambda m: m.optim_step(types.AdamParams(learning_rate=-1.0)), "learning_rate must be >= 0"),
        (lambda m: m.optim_step(types.AdamParams(beta1=1.5)), r"beta1 must be in \[0, 1\)"),
        (lambda m: m.save_state("../escape"), "invalid checkpoint name"),
        (lambda m: m.save_weights_for_sampler("a b"), "invalid checkpoint name"),
        (lambda m: m.save_state("x", ttl_seconds=-5), "ttl_seconds must be a positive integer"),
    ],
)
def test_bad_operations_fail_with_our_message_and_change_nothing(
    sess: wb.Session, remote: tinker.TrainingClient, call, message: str
) -> None:
    unchanged = Unchanged(sess)
    with pytest.raises(tinker.RequestFailedError, match=message) as failure:
        call(remote).result()
    assert failure.value.category == types.RequestErrorCategory.User
    unchanged.check()
    # the failed request used its seq_id: the model's next request runs
    assert remote.optim_step(types.AdamParams(learning_rate=1e-3)).result().metrics["grad_norm"] > 0
    assert sess.engine.model_status(remote.model_id).step == 1


def test_bad_models_and_loads_are_refused(
    sess: wb.Session, client: tinker.ServiceClient, remote: tinker.TrainingClient
) -> None:
    unchanged = Unchanged(sess)
    with pytest.raises(tinker.BadRequestError, match="this server serves 'tiny'"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="rank must be a positive integer"):
        client.create_lora_training_client(base_model="tiny", rank=0).result()
    with pytest.raises(tinker.RequestFailedError, match="Can't find a valid checkpoint"):
        client.create_training_client_from_state("tinker://nobody/weights/none").result()
    with pytest.raises(tinker.RequestFailedError, match="not a checkpoint path"):
        client.create_training_client_from_state("tinker://nobody/weights/a/b").result()
    with (
        pytest.raises(tinker.RequestFailedError, match="Can't find a valid checkpoint"),
        pytest.warns(FutureWarning),
    ):
        remote.load_state(f"tinker://{remote.model_id}/weights/none").result()
    with pytest.raises(tinker.BadRequestError, match=r"create_sampling_session: .*not a checkpoint path"):
        client.create_sampling_client(model_path="tinker://x/sampler_weights/../../etc").result()
    with pytest.raises(tinker.BadRequestError, match="Can't find a valid checkpoint"):
        client.create_sampling_client(model_path=f"tinker://{remote.model_id}/sampler_weights/none").result()
    unchanged.check()


def test_bad_sampling_fails_with_our_message_and_changes_nothing(
    sess: wb.Session, client: tinker.ServiceClient
) -> None:
    sampler = client.create_sampling_client(base_model="tiny").result()
    unchanged = Unchanged(sess)
    bad = [
        (
            lambda: sampler.sample(
                types.ModelInput.from_ints([5, 10_000]), 1, types.SamplingParams(max_tokens=2)
            ),
            "outside the vocabulary",
        ),
        (
            lambda: sampler.sample(
                types.ModelInput.from_ints(TOKENS), 1, types.SamplingParams(max_tokens=10**6)
            ),
            "exceeds the model's context",
        ),
        (
            lambda: sampler.sample(
                types.ModelInput.from_ints(TOKENS), 1000, types.SamplingParams(max_tokens=2)
            ),
            "num_samples must be",
        ),
        (
            lambda: sampler.sample(
                types.ModelInput.from_ints(TOKENS),
                1,
                types.SamplingParams(max_tokens=2),
                topk_prompt_logprobs=10**6,
            ),
            r"topk_prompt_logprobs must be an integer in \[0, 934\]",
        ),
        (
            lambda: sampler.sample(
                types.ModelInput.from_ints(TOKENS),
                1,
                types.SamplingParams(max_tokens=2),
                target_prompt_logprobs=types.TensorData.from_torch(torch.full((len(TOKENS) - 1, 2), -1)),
            ),
            "names no token id",
        ),
        (
            lambda: sampler.sample(
                types.ModelInput.from_ints(TOKENS),
                1,
                types.SamplingParams(max_tokens=2),
                target_prompt_logprobs=types.TensorData.from_torch(torch.zeros((2, 2), dtype=torch.long)),
            ),
            r"must have shape \[len\(prompt\) - 1, K\]",
        ),
        (
            lambda: sampler.sample(
                types.ModelInput.from_ints(TOKENS), 1, types.SamplingParams(max_tokens=2, top_p=0.0)
            ),
            "top_p must be in",
        ),
    ]
    for call, message in bad:
        with pytest.raises(tinker.RequestFailedError, match=message):
            call().result()
    unchanged.check()


# ---------------------------------------------------------------------------------------------- raw HTTP


def test_malformed_bodies_are_refused_with_a_clear_error(
    sess: wb.Session, srv: TinkerServer, remote: tinker.TrainingClient
) -> None:
    unchanged = Unchanged(sess)
    proto = {"content-type": "application/x-protobuf"}
    cases = [
        (
            post(srv, "forward_backward", b"\xff\xff\xff not protobuf", **proto),
            400,
            "not a valid ForwardBackwardRequest",
        ),
        (post(srv, "forward_backward", b"{}", **{"content-type": "application/json"}), 415, "protobuf"),
        (
            post(
                srv,
                "forward_backward",
                zstandard.ZstdCompressor().compress(b"\0" * (80 * 2**20)),
                **proto,
                **{"content-encoding": "zstd"},
            ),
            413,
            "limit",
        ),
        (
            post(srv, "forward_backward", b"x", **proto, **{"content-encoding": "gzip"}),
            415,
            "Content-Encoding",
        ),
        (post(srv, "optim_step", b"{not json"), 400, "not valid JSON"),
        (
            post(srv, "optim_step", {"model_id": remote.model_id, "seq_id": 99, "adam_params": {"lr": 1}}),
            400,
            "adam_params.lr: unknown field",
        ),
        (
            post(srv, "optim_step", {"model_id": remote.model_id, "seq_id": 99, "model_role": "critic"}),
            400,
            "model_role: unknown field",
        ),
        (
            post(srv, "optim_step", {"model_id": remote.model_id, "seq_id": 0}),
            400,
            "seq_id must be an integer >= 1",
        ),
        (
            post(
                srv,
                "create_model",
                {"session_id": "s", "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": "4"}},
            ),
            400,
            "lora_config.rank: Input should be a valid integer",
        ),
        (
            post(srv, "create_model", {"session_id": "nobody", "model_seq_id": 0, "base_model": "tiny"}),
            404,
            "no session 'nobody'",
        ),
        (post(srv, "retrieve_future", {"request_id": "nope"}), 404, "no request 'nope'"),
        (post(srv, "session_heartbeat", {"session_id": "nobody"}), 404, "no session"),
        (post(srv, "get_info", {"model_id": "nobody"}), 404, "no model 'nobody'"),
        (post(srv, "weights_info", {"tinker_path": "/etc/passwd"}), 404, "is not a tinker:// path"),
        (
            httpx.get(
                f"{srv.url}/api/v1/training_runs/{remote.model_id}/checkpoints/weights/.hidden/archive"
            ),
            400,
            "invalid checkpoint name",
        ),
        (
            httpx.get(
                f"{srv.url}/api/v1/training_runs/{remote.model_id}/checkpoints/weights/..%2F..%2Fx/archive"
            ),
            404,
            "Not Found",
        ),
        (
            httpx.delete(f"{srv.url}/api/v1/training_runs/{remote.model_id}/checkpoints/elsewhere/x"),
            400,
            "not a checkpoint path",
        ),
        (httpx.get(f"{srv.url}/api/v1/no_such_endpoint"), 404, "Not Found"),
    ]
    for response, status, message in cases:
        assert response.status_code == status, response.text
        body = response.json()
        assert message in body["error"] and body["category"] == "user", body
    unchanged.check()
    # an image prompt: the request holds a seq_id, so it is taken, and its future fails
    image = {"chunks": [{"type": "image", "data": "", "format": "png"}]}
    sampler = post(
        srv,
        "create_sampling_session",
        {"session_id": remote.holder.get_session_id(), "sampling_session_seq_id": 50, "base_model": "tiny"},
    ).json()
    sample = {
        "sampling_session_id": sampler["sampling_session_id"],
        "prompt": image,
        "sampling_params": {},
        "seq_id": 0,
    }
    failed = post(
        srv, "retrieve_future", {"request_id": post(srv, "asample", sample).json()["request_id"]}
    ).json()
    assert "prompt.chunks[0] is a 'image' chunk; this server reads text chunks only" in failed["error"]
    unchanged.check()
    # data that fails after its envelope was read fails its operation, which frees its seq_id
    seq = 2  # the fixture's forward_backward was seq 1
    taken = post(srv, "forward_backward", fwdbwd_proto(remote.model_id, seq, b"\x01\x02\x03"), **proto).json()
    failed = post(srv, "retrieve_future", {"request_id": taken["request_id"]}).json()
    assert "not a whole number of int32 values" in failed["error"] and failed["category"] == "user"
    unchanged.check()


def test_request_bodies_are_size_limited(sess: wb.Session) -> None:
    server = TinkerServer(sess.engine, ServerConfig(max_body_bytes=1000))
    try:
        unchanged = Unchanged(sess)
        response = post(server, "create_session", {"tags": ["x" * 2000]})
        assert response.status_code == 413 and "exceeds the limit of 1000" in response.json()["error"]
        unchanged.check()
    finally:
        server.stop()


def test_a_request_reusing_a_seq_id_with_other_content_is_a_conflict(
    sess: wb.Session, srv: TinkerServer, remote: tinker.TrainingClient
) -> None:
    tokens = np.array(TOKENS[:-1], dtype="<i4").tobytes()
    first = post(
        srv,
        "forward_backward",
        fwdbwd_proto(remote.model_id, 2, tokens),
        **{"content-type": "application/x-protobuf"},
    )
    assert first.status_code == 200
    unchanged = Unchanged(sess)
    other = post(
        srv,
        "forward_backward",
        fwdbwd_proto(remote.model_id, 2, tokens[:-4]),
        **{"content-type": "application/x-protobuf"},
    )
    assert other.status_code == 409 and "already used by a different request" in other.json()["error"]
    unchanged.check()


# ---------------------------------------------------------------------------------------------- ordering after a refusal


def test_a_refused_request_consumes_its_seq_id(
    sess: wb.Session, srv: TinkerServer, remote: tinker.TrainingClient
) -> None:
    path = remote.save_state("a").result().path
    with pytest.raises(tinker.BadRequestError, match="weights_access_token"), pytest.warns(FutureWarning):
        remote.load_state(path, weights_access_token="tok").result()
    # the SDK counted the refused request: the server must not wait for it
    assert remote.forward_backward([sdk_ce_datum(TOKENS)], "cross_entropy").result(timeout=60).metrics
    # raw refusals that name a model and a seq_id: schema errors, bad protobuf data, a body too large
    seq = 5  # fixture's forward_backward 1, save_state 2, load_state 3, forward_backward 4
    proto = {"content-type": "application/x-protobuf"}
    bad_schema = post(
        srv, "optim_step", {"model_id": remote.model_id, "seq_id": seq, "adam_params": {"lr": 1}}
    )
    assert bad_schema.status_code == 400 and "adam_params.lr" in bad_schema.json()["error"]
    wrong_type = post(
        srv,
        "forward_backward",
        fwdbwd_proto(remote.model_id, seq + 1, b""),
        **{"content-type": "application/json"},
    )
    assert wrong_type.status_code == 415
    big = fwdbwd_proto(remote.model_id, seq + 2, b"") + b"\0" * (65 * 2**20)  # over 64 MiB unpacked
    zstd = {"content-encoding": "zstd", **proto}
    too_large = post(srv, "forward_backward", zstandard.ZstdCompressor().compress(big), **zstd)
    assert too_large.status_code == 413 and "limit" in too_large.json()["error"]
    ok = post(
        srv,
        "forward_backward",
        fwdbwd_proto(remote.model_id, seq + 3, np.array(TOKENS[:-1], dtype="<i4").tobytes()),
        **proto,
    )
    assert ok.status_code == 200
    done = httpx.post(
        f"{srv.url}/api/v1/retrieve_future", json={"request_id": ok.json()["request_id"]}, timeout=60
    ).json()
    assert done.get("type") != "try_again" and "target_tokens" in done["error"], done


def test_an_op_on_a_model_whose_session_expired_is_refused(sess: wb.Session) -> None:
    server = TinkerServer(sess.engine, ServerConfig(session_timeout_s=1.0))
    try:
        session_id = post(server, "create_session", {"tags": []}).json()["session_id"]
        body = {"session_id": session_id, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}
        request_id = post(server, "create_model", body).json()["request_id"]
        model_id = post(server, "retrieve_future", {"request_id": request_id}).json()["model_id"]
        step = {"model_id": model_id, "adam_params": {"learning_rate": 1e-3}}
        deadline = time.monotonic() + 20
        while model_id in sess.engine.model_ids() and time.monotonic() < deadline:
            time.sleep(0.2)
        unchanged = Unchanged(sess)
        late = post(server, "optim_step", {**step, "seq_id": 2})  # after seq_id 1 (not waited for)
        assert late.status_code == 404 and "no model" in late.json()["error"], late.text
        assert late.json()["category"] == "user"
        unchanged.check()
    finally:
        server.stop()


def raw_sampler(srv: TinkerServer) -> str:
    """A sampling session of the base model, made over raw HTTP."""
    session_id = post(srv, "create_session", {"tags": []}).json()["session_id"]
    body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny"}
    return post(srv, "create_sampling_session", body).json()["sampling_session_id"]


@pytest.mark.parametrize("num_samples", [3_000_000, 10**9, -5])
def test_a_sample_count_is_checked_before_anything_is_sized_by_it(
    sess: wb.Session, srv: TinkerServer, num_samples: int
) -> None:
    sampler_id = raw_sampler(srv)
    unchanged = Unchanged(sess)
    body = {
        "sampling_session_id": sampler_id,
        "seq_id": 0,
        "num_samples": num_samples,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]},
        "sampling_params": {"max_tokens": 2},
    }
    started = time.monotonic()
    taken = post(srv, "asample", body)
    assert time.monotonic() - started < 5 and len(taken.content) < 1000, len(taken.content)
    failed = post(srv, "retrieve_future", {"request_id": taken.json()["request_id"]}).json()
    assert "num_samples must be an integer in [1, 128]" in failed["error"] and failed["category"] == "user"
    unchanged.check()


@pytest.mark.parametrize("kind", ["state", "sampler"])
def test_a_sampling_client_of_an_altered_checkpoint_is_refused(
    sess: wb.Session, client: tinker.ServiceClient, remote: tinker.TrainingClient, kind: str
) -> None:
    saved = remote.save_state("s") if kind == "state" else remote.save_weights_for_sampler("s")
    path = saved.result().path
    folder = sess.engine.checkpoint_folder(path, kind)
    weights = folder / ("policy" if kind == "state" else "") / "adapter_model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(wb.CorruptCheckpointError, match=r"adapter_model\.safetensors"):
        sess.engine.pin_sampler_checkpoint(path).result()
    with pytest.raises(tinker.BadRequestError, match=r"adapter_model\.safetensors"):
        client.create_sampling_client(model_path=path).result()


def test_over_http_checkpoints_are_named_by_tinker_path_only(
    sess: wb.Session,
    srv: TinkerServer,
    client: tinker.ServiceClient,
    remote: tinker.TrainingClient,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    state = remote.save_state("s").result().path  # seq_id 2
    sampler = remote.save_weights_for_sampler("w").result().path  # seq_id 3
    folders = [
        str(sess.engine.checkpoint_folder(state, "state")),
        str(sess.engine.checkpoint_folder(sampler, "sampler")),
        "~/s",
    ]
    monkeypatch.setenv("HOME", str(sess.engine.checkpoint_folder(state, "state").parent))
    unchanged = Unchanged(sess)
    session_id = client.holder.get_session_id()
    for seq, folder in enumerate(folders, start=4):
        loads = [
            (
                "load_weights",
                {"model_id": remote.model_id, "seq_id": seq, "path": folder, "optimizer": False},
            ),
            (
                "load_weights",
                {"session_id": session_id, "model_seq_id": 90 + seq, "path": folder, "optimizer": False},
            ),
            (
                "create_sampling_session",
                {"session_id": session_id, "sampling_session_seq_id": 90 + seq, "model_path": folder},
            ),
        ]
        for route, body in loads:
            refused = post(srv, route, body)
            assert refused.status_code == 400, (route, refused.text)
            assert "tinker://" in refused.json()["error"] and folder not in refused.json()["error"]
    unchanged.check()


def test_error_messages_name_what_the_client_sent_not_server_folders(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient, remote: tinker.TrainingClient
) -> None:
    corrupt = remote.save_state("corrupt").result().path  # seq_id 2
    (sess.engine.checkpoint_folder(corrupt, "state") / "policy" / "adapter_model.safetensors").write_bytes(
        b"x"
    )
    missing = f"tinker://{remote.model_id}/weights/none"
    missing_sampler = f"tinker://{remote.model_id}/sampler_weights/none"
    session_id = client.holder.get_session_id()
    run = f"{srv.url}/api/v1/training_runs/{remote.model_id}"
    answers = [
        post(srv, "create_model", {"session_id": session_id, "model_seq_id": 50, "base_model": "other"}),
        post(
            srv,
            "load_weights",
            {"session_id": session_id, "model_seq_id": 51, "path": missing, "optimizer": False},
        ),
        post(
            srv,
            "load_weights",
            {"session_id": session_id, "model_seq_id": 52, "path": corrupt, "optimizer": True},
        ),
        post(
            srv,
            "load_weights",
            {"model_id": remote.model_id, "seq_id": 3, "path": missing, "optimizer": False},
        ),
        post(
            srv,
            "load_weights",
            {"model_id": remote.model_id, "seq_id": 4, "path": corrupt, "optimizer": False},
        ),
        post(
            srv,
            "create_sampling_session",
            {"session_id": session_id, "sampling_session_seq_id": 50, "model_path": missing_sampler},
        ),
        post(
            srv,
            "create_sampling_session",
            {"session_id": session_id, "sampling_session_seq_id": 51, "model_path": corrupt},
        ),
        post(
            srv,
            "create_sampling_session",
            {"session_id": session_id, "sampling_session_seq_id": 52, "base_model": "other"},
        ),
        post(srv, "weights_info", {"tinker_path": missing}),
        post(srv, "weights_info", {"tinker_path": missing_sampler}),
        httpx.get(f"{run}/checkpoints/weights/none/archive"),
        httpx.delete(f"{run}/checkpoints/sampler_weights/none"),
    ]
    messages = []
    for answer in answers:
        body = answer.json()
        if "request_id" in body:
            body = post(srv, "retrieve_future", {"request_id": body["request_id"]}).json()
        assert body.get("category") == "user", body
        messages.append(body["error"])
    server_folders = [
        os.environ["WORKBENCH_RUNS"],
        str(sess.model_dir),
        sess.base_info.path,
        str(Path.home()),
    ]
    for message in messages:
        assert not [folder for folder in server_folders if folder in message], message
    assert all("none" in m or "corrupt" in m or "other" in m for m in messages), messages


def sparse_fwdbwd_proto(model_id: str, seq_id: int, shape: list[int]) -> bytes:
    message = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    item = message.data.add()
    item.model_input.add().encoded_text.tokens = np.array(TOKENS[:-1], dtype="<i4").tobytes()
    tensor = item.loss_fn_inputs["weights"]
    tensor.dtype = pb.DTYPE_FLOAT32
    tensor.shape.extend(shape)
    tensor.sparse_csr.crow_indices = np.zeros(shape[0] + 1, dtype="<i8").tobytes()
    return message.SerializeToString()


def test_client_mistakes_are_the_users_in_our_error_shape(
    sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient, remote: tinker.TrainingClient
) -> None:
    unchanged = Unchanged(sess)
    session_id = client.holder.get_session_id()
    deep = b'{"tags": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    deep_op = (
        b'{"model_id": "'
        + remote.model_id.encode()
        + b'", "seq_id": 9, "x": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}"
    )
    model = {"session_id": session_id, "base_model": "tiny"}
    answers = [
        post(srv, "create_session", deep),
        post(srv, "optim_step", deep_op),
        post(srv, "create_model", {**model, "model_seq_id": 60, "lora_config": {"rank": 2**40}}),
        post(srv, "create_model", {**model, "model_seq_id": 10**300}),
        post(srv, "create_model", {**model, "model_seq_id": 61, "lora_config": {"rank": 4, "seed": 10**300}}),
        post(srv, "optim_step", {"model_id": remote.model_id, "seq_id": 10**300}),
        post(
            srv,
            "forward_backward",
            sparse_fwdbwd_proto(remote.model_id, 2, [6, 2**42]),
            **{"content-type": "application/x-protobuf"},
        ),
        post(
            srv,
            "forward_backward",
            sparse_fwdbwd_proto(remote.model_id, 3, [6, -2]),
            **{"content-type": "application/x-protobuf"},
        ),
        httpx.get(f"{srv.url}/api/v1/training_runs?limit=abc"),
        httpx.get(f"{srv.url}/api/v1/checkpoints?offset=1e400"),
        httpx.get(f"{srv.url}/api/v1/archives/a/weights/b?expires=soon&signature=x"),
    ]
    for answer in answers:
        body = answer.json()
        if "request_id" in body:
            body = post(srv, "retrieve_future", {"request_id": body["request_id"]}).json()
        assert set(body) == {"error", "category"} and body["category"] == "user", body
    unchanged.check()
    # the refused forward_backwards used seq_ids 2 and 3: the model's next request runs
    tokens = np.array(TOKENS[:-1], dtype="<i4").tobytes()
    proto = {"content-type": "application/x-protobuf"}
    taken = post(srv, "forward_backward", fwdbwd_proto(remote.model_id, 4, tokens), **proto).json()
    done = post(srv, "retrieve_future", {"request_id": taken["request_id"]}).json()
    assert done.get("type") != "try_again" and "target_tokens" in done["error"], done


def test_query_parameters_are_read_after_the_key_check(sess: wb.Session) -> None:
    server = sess.serve(api_key="tml-test-key-0123")
    keyless = httpx.get(f"{server.url}/api/v1/training_runs?limit=abc")
    assert keyless.status_code == 401 and keyless.json()["category"] == "user"
    keyed = httpx.get(
        f"{server.url}/api/v1/training_runs?limit=abc", headers={"X-API-Key": "tml-test-key-0123"}
    )
    assert keyed.status_code == 400 and "limit" in keyed.json()["error"]


def test_the_session_table_forgets_ended_sessions(sess: wb.Session, srv: TinkerServer) -> None:
    service = srv.service
    before = len(service.sessions)
    for _ in range(30):
        session_id = post(srv, "create_session", {"tags": []}).json()["session_id"]
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": "tiny"}
        assert post(srv, "create_sampling_session", body).status_code == 200
        assert post(srv, f"sessions/{session_id}/finish", {"reason": {"type": "success"}}).status_code == 200
    assert len(service.sessions) == before + 30  # ended, kept a while: a late heartbeat gets 410
    later = post(srv, "session_heartbeat", {"session_id": session_id})
    assert later.status_code == 410
    service.sessions.forget_ended(now=time.monotonic() + ENDED_SESSIONS_KEPT_S + 1)
    assert len(service.sessions) == before
    assert len(service.released_samplers) <= 30


def test_a_sampler_remembers_a_bounded_number_of_seq_ids() -> None:
    from workbench.server.future_table import PendingResult
    from workbench.server.ordering import RETRY_WINDOW, Sequencer

    sequencer = Sequencer()
    made: list[str] = []

    def entry() -> PendingResult:
        made.append(f"r{len(made)}")
        return PendingResult(request_id=made[-1], op="sample", model_id=None)

    seq_ids = list(range(10**9, 10**9 - 2 * RETRY_WINDOW, -1))  # counting down: none is ever older
    for seq_id in seq_ids:
        sequencer.take("sampler", seq_id, b"a", entry, lambda _: None, ordered=False)
    # the first one was forgotten: sent again with other content it is new, not a 409 conflict
    assert sequencer.take("sampler", seq_ids[0], b"b", entry, lambda _: None, ordered=False) == made[-1]
