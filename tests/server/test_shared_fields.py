"""workbench/server/sampling_fields.py: the sampling fields OpenAI's and Anthropic's APIs share are read
with one rule each, `SamplingParams`' own, and a chat request builds the one `SampleRequest` the engine
samples, which the engine checks against the model once (`check_sample`, then `sample` unchecked).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

import workbench as wb
from workbench.engine.interface import CheckedSample, asked
from workbench.engine.local import sample as local_sample
from workbench.engine.samplers.requests import PreparedRequest
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.server import TinkerServer

QUESTION = [{"role": "user", "content": "What is the secret word?"}]

BAD_FIELDS = [
    # (SamplingParams' field, or None for a field it has not, the bad value)
    ("temperature", -1),
    ("temperature", 1e-9),
    ("temperature", "hot"),
    ("temperature", True),
    ("top_p", 0),
    ("top_p", 1.5),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.5),
    ("max_tokens", 0),
    ("max_tokens", -1),
    ("max_tokens", "4"),
    ("stop", ["x"] * 100),
    ("stop", [""]),
    ("stop", 7),
]


def _refusal(http: httpx.Client, url: str, body: dict[str, Any]) -> str:
    response = http.post(url, json=body, headers={"x-api-key": "tml-local"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    return str(error["message"])


def test_a_bad_shared_field_is_refused_by_both_apis_with_sampling_params_rule(
    sess: wb.Session, srv: TinkerServer
) -> None:
    base = sess.config.base_model
    with httpx.Client(timeout=120) as http:
        for field, value in BAD_FIELDS:
            anthropic_field = "stop_sequences" if field == "stop" else field
            openai_message = _refusal(
                http,
                f"{srv.url}/oai/api/v1/chat/completions",
                {"model": base, "messages": QUESTION, "max_tokens": 4, field: value},
            )
            anthropic_message = _refusal(
                http,
                f"{srv.url}/anthropic/api/v1/messages",
                {"model": base, "messages": QUESTION, "max_tokens": 4, anthropic_field: value},
            )
            assert openai_message.replace("stop", "stop_sequences", 1) == anthropic_message, (field, value)
            assert openai_message.startswith(field), openai_message
            if field != "stop":
                with pytest.raises(ValueError) as refused:
                    wb.SamplingParams(**{field: value})
                assert str(refused.value) in openai_message, (field, value)


def test_what_sampling_params_takes_both_apis_take(sess: wb.Session, srv: TinkerServer) -> None:
    """A temperature below the APIs' old 1e-3 and above their old 100, and Anthropic's top_k -1 (off)."""
    base = sess.config.base_model
    with httpx.Client(timeout=120) as http:
        for fields in ({"temperature": 5e-4}, {"temperature": 200.0, "top_k": -1}):
            for url in (f"{srv.url}/oai/api/v1/chat/completions", f"{srv.url}/anthropic/api/v1/messages"):
                body = {"model": base, "messages": QUESTION, "max_tokens": 2, **fields}
                response = http.post(url, json=body, headers={"x-api-key": "tml-local"})
                assert response.status_code == 200, (url, fields, response.text)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_chat_request_builds_the_one_sample_request_the_engine_samples_and_checks_it_once(
    sess: wb.Session, srv: TinkerServer, monkeypatch: pytest.MonkeyPatch, stream: bool
) -> None:
    built: list[SampleRequest] = []
    sampled: list[SampleRequest] = []
    checked: list[SampleRequest] = []  # the engine's check against the model: max_tokens within the context
    check = SampleRequest.__post_init__
    sample = type(sess.engine).sample
    prepare = local_sample.prepare_request

    def counted(request: SampleRequest) -> None:
        check(request)
        built.append(request)

    def recorded(
        engine: Any, pin: Any, request: SampleRequest | CheckedSample, token_sink: Any = None
    ) -> Any:
        sampled.append(asked(request))
        return sample(engine, pin, request, token_sink)

    def prepared(request: SampleRequest, **against: Any) -> PreparedRequest:
        checked.append(request)
        return prepare(request, **against)

    monkeypatch.setattr(SampleRequest, "__post_init__", counted)
    monkeypatch.setattr(type(sess.engine), "sample", recorded)
    monkeypatch.setattr(local_sample, "prepare_request", prepared)
    body = {
        "model": sess.config.base_model,
        "messages": QUESTION,
        "max_tokens": 3,
        "n": 2,
        "seed": 5,
        "top_k": 9,
        "stream": stream,
    }
    with httpx.Client(timeout=120) as http:
        response = http.post(f"{srv.url}/oai/api/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.text.rstrip().endswith("data: [DONE]") if stream else response.json()["choices"]
    assert len(built) == 1 and sampled == built and checked == built
    request = built[0]
    assert request.num_samples == 2
    params = request.sampling_params
    assert (params.max_tokens, params.seed, params.top_k, params.temperature) == (3, 5, 9, 1.0)
    if not stream:
        assert request.prompt.to_ints() == response.json()["prompt_token_ids"]
