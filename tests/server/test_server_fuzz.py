"""The server under hostile requests: every endpoint, hostile bodies, then a seeded fuzz of mutated valid
requests.

What must hold for every request (the charter's promise for a server reachable by other clients):
nothing hangs (each answer, and each operation's result, comes within a deadline), nothing a refused
request sends changes the engine (`state_digest()`), every refusal is our error shape
(`{"error", "category"}`) with category "user" and no folder of this machine in it, and the server's
memory stays bounded.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from tinker.proto import tinker_public_pb2 as pb

import workbench as wb
from workbench.server import ServerConfig, TinkerServer

TOKENS = [5, 17, 33, 48, 60, 71, 2]
DEADLINE_S = 20.0
PROTO = {"content-type": "application/x-protobuf"}
ORDERED = {"forward_backward", "optim_step", "save_weights", "save_weights_for_sampler", "load_weights"}

HOSTILE_VALUES: list[Any] = [
    None,
    -1,
    0,
    2**40,
    2**63,
    10**300,
    1e308,
    -1e308,
    float("nan"),
    float("inf"),
    True,
    "",
    "x" * 100_000,
    "\ud800",
    "../../etc/passwd",
    "/etc/passwd",
    "~",
    "tinker://x/weights/../../a",
    [],
    [[[[[]]]]],
    {},
    {"a": {"b": {"c": {}}}},
    [1] * 10_000,
]


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class Harness:
    """A served tiny session with one raw client session, its model and its sampler; sends requests and
    checks every answer."""

    def __init__(self, sess: wb.Session, server: TinkerServer):
        self.sess, self.server, self.url = sess, server, server.url
        self.folders = [
            os.environ["WORKBENCH_RUNS"],
            str(sess.model_dir),
            sess.base_info.path,
            str(Path.home()),
        ]
        self.session_id = self.json("create_session", {"tags": []})["session_id"]
        created = self.json(
            "create_model",
            {
                "session_id": self.session_id,
                "model_seq_id": 0,
                "base_model": "tiny",
                "lora_config": {"rank": 4},
            },
        )
        self.model_id = self.result(created["request_id"])["model_id"]
        self.sampler_id = self.json(
            "create_sampling_session",
            {"session_id": self.session_id, "sampling_session_seq_id": 0, "base_model": "tiny"},
        )["sampling_session_id"]
        self.sample_seq = 0
        self.seq = 1  # the model's next seq_id, counted as the SDK counts: every request it sends
        self.outcomes = {"succeeded": 0, "refused": 0}
        self.run(self.templates()["forward_backward"]())  # pending gradients, a checkpoint to name
        self.run(self.templates()["save_weights"]())
        self.digest = sess.engine.state_digest()

    # -------------------------------------------------------------------------------------- requests

    def send(self, method: str, path: str, content: bytes = b"", **headers: str) -> httpx.Response:
        return httpx.request(
            method, f"{self.url}/api/v1/{path}", content=content, headers=headers, timeout=DEADLINE_S
        )

    def json(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self.send("POST", path, json.dumps(body).encode())
        assert response.status_code == 200, response.text
        return response.json()

    def result(self, request_id: str) -> dict[str, Any]:
        response = self.send("POST", "retrieve_future", json.dumps({"request_id": request_id}).encode())
        body = response.json()
        assert body.get("type") != "try_again", f"an operation did not finish within {DEADLINE_S} s"
        return body

    def counts(self, path: str, body: Any) -> bool:
        """Whether a request takes the model's next seq_id, as the SDK counts: it names the model and
        that seq_id (whatever else is wrong with it). Protobuf mutations keep the envelope whole."""
        if path == "forward_backward":
            return isinstance(body, bytes) and body.startswith(self.envelope())
        return (
            path in ORDERED
            and isinstance(body, dict)
            and body.get("model_id") == self.model_id
            and type(body.get("seq_id")) is int
            and body["seq_id"] == self.seq
        )

    def envelope(self) -> bytes:
        return pb.ForwardBackwardRequest(model_id=self.model_id, seq_id=self.seq).SerializeToString()

    def templates(self) -> dict[str, Callable[[], tuple[str, str, Any]]]:
        """Valid requests, one per endpoint: (method, path, JSON body or protobuf bytes)."""
        model, seq = self.model_id, self.seq
        state = f"tinker://{model}/weights/c"
        self.sample_seq += 1

        def fwdbwd() -> tuple[str, str, Any]:
            message = pb.ForwardBackwardRequest(model_id=model, seq_id=seq, loss_fn="cross_entropy")
            datum = message.data.add()
            datum.model_input.add().encoded_text.tokens = np.array(TOKENS[:-1], dtype="<i4").tobytes()
            for name, values, dtype, kind in (
                ("target_tokens", TOKENS[1:], "<i8", pb.DTYPE_INT64),
                ("weights", [1.0] * 6, "<f4", pb.DTYPE_FLOAT32),
            ):
                tensor = datum.loss_fn_inputs[name]
                tensor.dtype, tensor.dense = kind, np.array(values, dtype=dtype).tobytes()
                tensor.shape.append(len(values))
            return "POST", "forward_backward", message.SerializeToString()

        prompt = {"chunks": [{"type": "encoded_text", "tokens": TOKENS}]}
        return {
            "forward_backward": fwdbwd,
            "optim_step": lambda: (
                "POST",
                "optim_step",
                {"model_id": model, "seq_id": seq, "adam_params": {"learning_rate": 1e-3}},
            ),
            "save_weights": lambda: (
                "POST",
                "save_weights",
                {"model_id": model, "seq_id": seq, "path": "c", "overwrite": True},
            ),
            "save_weights_for_sampler": lambda: (
                "POST",
                "save_weights_for_sampler",
                {"model_id": model, "seq_id": seq, "sampling_session_seq_id": 100 + seq},
            ),
            "load_weights": lambda: (
                "POST",
                "load_weights",
                {"model_id": model, "seq_id": seq, "path": state, "optimizer": True},
            ),
            "create_from_state": lambda: (
                "POST",
                "load_weights",
                {
                    "session_id": self.session_id,
                    "model_seq_id": 1000 + seq,
                    "path": state,
                    "optimizer": False,
                },
            ),
            "create_model": lambda: (
                "POST",
                "create_model",
                {
                    "session_id": self.session_id,
                    "model_seq_id": 2000 + seq,
                    "base_model": "tiny",
                    "lora_config": {"rank": 4},
                },
            ),
            "asample": lambda: (
                "POST",
                "asample",
                {
                    "sampling_session_id": self.sampler_id,
                    "seq_id": self.sample_seq,
                    "num_samples": 1,
                    "prompt": prompt,
                    "sampling_params": {"max_tokens": 2, "seed": 1},
                },
            ),
            "create_sampling_session": lambda: (
                "POST",
                "create_sampling_session",
                {"session_id": self.session_id, "sampling_session_seq_id": 3000 + seq, "model_path": state},
            ),
            "get_info": lambda: ("POST", "get_info", {"model_id": model}),
            "weights_info": lambda: ("POST", "weights_info", {"tinker_path": state}),
            "session_heartbeat": lambda: ("POST", "session_heartbeat", {"session_id": self.session_id}),
            "create_session": lambda: (
                "POST",
                "create_session",
                {"tags": ["a"], "user_metadata": {"k": "v"}},
            ),
            "client_config": lambda: ("POST", "client/config", {"sdk_version": "0.38.0"}),
            "retrieve_future": lambda: ("POST", "retrieve_future", {"request_id": "nope"}),
            "telemetry": lambda: ("POST", "telemetry", {"events": []}),
            "training_runs": lambda: ("GET", "training_runs?limit=5&offset=0", None),
            "training_run": lambda: ("GET", f"training_runs/{model}", None),
            "run_checkpoints": lambda: ("GET", f"training_runs/{model}/checkpoints", None),
            "checkpoints": lambda: ("GET", "checkpoints?limit=5", None),
            "sampler": lambda: ("GET", f"samplers/{self.sampler_id}", None),
            "archive": lambda: ("GET", f"training_runs/{model}/checkpoints/weights/c/archive", None),
            "delete": lambda: ("DELETE", f"training_runs/{model}/checkpoints/weights/nothing", None),
        }

    # -------------------------------------------------------------------------------------- checks

    def check_refusal(self, body: Any, what: str) -> None:
        assert isinstance(body, dict) and set(body) == {"error", "category"}, (what, body)
        assert body["category"] == "user", (what, body)
        assert not [f for f in self.folders if f in body["error"]], (what, body)

    def run(self, request: tuple[str, str, Any], what: str = "") -> None:
        """Send one request; wait for its operation; check the answer; check the engine is unchanged
        unless the request (or its operation) succeeded."""
        method, path, body = request
        if self.counts(path, body):
            self.seq += 1
        if isinstance(body, bytes):
            response = self.send(method, path, body, **(PROTO if path == "forward_backward" else {}))
        else:
            response = self.send(method, path, b"" if body is None else json.dumps(body).encode())
        assert response.status_code < 500, (what, response.status_code, response.text)
        succeeded = response.status_code < 400
        if not succeeded:
            self.check_refusal(response.json(), what)
        elif (
            response.headers.get("content-type", "").startswith("application/json")
            and "request_id" in response.text
        ):
            answer = response.json()
            if "request_id" in answer and path != "retrieve_future":
                result = self.result(answer["request_id"])
                if "error" in result:
                    self.check_refusal(result, what)
                    succeeded = False
        digest = self.sess.engine.state_digest()
        self.outcomes["succeeded" if succeeded else "refused"] += 1
        if not succeeded:
            assert digest == self.digest, f"{what}: a refused request changed the engine"
        self.digest = digest


@pytest.fixture
def harness(monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    sess = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, max_models=4)
    server = TinkerServer(sess.engine, ServerConfig(long_poll_s=DEADLINE_S / 2, max_body_bytes=2**20))
    try:
        yield Harness(sess, server)
    finally:
        server.stop()
        sess.close()


def _mutate(body: Any, rng: random.Random, keep: int) -> Any:
    """One hostile change to a valid body: a field set to a hostile value, removed, or an unknown one
    added; a protobuf body cut short or with bytes flipped after its first `keep` bytes (the model and
    seq_id it names)."""
    if isinstance(body, bytes):
        data = bytearray(body)
        if rng.random() < 0.3:
            return bytes(data[: rng.randrange(keep, len(data))])
        for _ in range(rng.randint(1, 4)):
            data[rng.randrange(keep, len(data))] = rng.randrange(256)
        return bytes(data)
    if body is None:
        return body
    mutated = json.loads(json.dumps(body))
    target, key = mutated, None
    while True:  # walk into a nested field now and then
        key = rng.choice(list(target)) if target else "extra"
        if isinstance(target.get(key), dict) and target[key] and rng.random() < 0.5:
            target = target[key]
            continue
        break
    choice = rng.random()
    if choice < 0.75:
        target[key] = rng.choice(HOSTILE_VALUES)
    elif choice < 0.9:
        target.pop(key, None)
    else:
        target["unknown_field"] = 1
    return mutated


def test_every_endpoint_refuses_hostile_bodies(harness: Harness) -> None:
    deep = b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}"
    hostile_bodies = [
        b"",
        b"{not json",
        b"[]",
        b'"x"',
        b"\xff\xfe",
        deep,
        b'{"x": "\\ud800"}',
        b"{" * 10,
        b"0" * (2**20 + 1),
    ]
    for name, template in harness.templates().items():
        method, path, _ = template()
        if method != "POST":
            continue
        for body in hostile_bodies:
            harness.run((method, path, body), f"{name} <- {body[:20]!r}")
    for path in (
        "training_runs?limit=abc",
        "checkpoints?offset=-1",
        "training_runs?limit=" + "9" * 400,
        "samplers/" + "x" * 5000,
        "training_runs/%00",
    ):
        harness.run(("GET", path, None), path)


def test_mutated_requests_never_hang_fail_the_server_or_change_anything(harness: Harness) -> None:
    rng = random.Random(20261124)
    names = sorted(harness.templates())
    rss_before = rss_bytes()
    for index in range(300):
        name = rng.choice(names)
        method, path, body = harness.templates()[name]()
        harness.run((method, path, _mutate(body, rng, len(harness.envelope()))), f"#{index} {name}")
    # both paths were driven: requests that passed (and changed the model) and refusals
    assert harness.outcomes["succeeded"] >= 20 and harness.outcomes["refused"] >= 150, harness.outcomes
    growth = rss_bytes() - rss_before
    assert growth < 400 * 2**20, f"the server grew by {growth / 2**20:.0f} MiB over 300 requests"
