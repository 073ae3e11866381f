"""Bad input to every endpoint: the client sees our message, and nothing changes.

"Nothing changes" is checked as the house rule has it: `engine.state_digest()` (every model's weights,
gradients, optimizer state and counters, and the sampling generator) is byte-identical afterwards, the
engine holds the same models, and no file appeared under the runs root. And a model whose request
failed keeps working: the failed request consumed its seq_id, so the next one runs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

import workbench as wb
from workbench.server import ServerConfig, TinkerServer

TOKENS = [5, 17, 33, 48, 60, 71, 2]


@pytest.fixture
def sess(monkeypatch: pytest.MonkeyPatch) -> Iterator[wb.Session]:
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    session = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    yield session
    session.close()


@pytest.fixture
def srv(sess: wb.Session) -> TinkerServer:
    return sess.serve()


@pytest.fixture
def client(srv: TinkerServer) -> Iterator[tinker.ServiceClient]:
    service_client = tinker.ServiceClient(base_url=srv.url)
    yield service_client
    service_client.close("success").result()


@pytest.fixture
def remote(client: tinker.ServiceClient) -> tinker.TrainingClient:
    model = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    model.forward_backward([datum(TOKENS)], "cross_entropy").result()  # gradients pending: they must survive
    return model


def datum(tokens: list[int], **inputs: object) -> types.Datum:
    n = len(tokens) - 1
    loss_fn_inputs = {"target_tokens": tokens[1:], "weights": [1.0] * n, **inputs}
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=loss_fn_inputs)


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
        (lambda m: m.forward_backward([datum([5, 6, 10_000, 7])], "cross_entropy"), "outside the vocabulary"),
        (lambda m: m.forward_backward([datum(TOKENS)], "nope"), "unknown loss 'nope'"),
        (
            lambda m: m.forward_backward([datum(TOKENS, advantages=[1.0] * 6)], "cross_entropy"),
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
        (lambda m: m.forward_backward([datum(TOKENS)], "ppo", {"clip_low_threshold": "x"}), "text"),
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
                topk_prompt_logprobs=3,
            ),
            "does not compute topk_prompt_logprobs",
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
