"""workbench/server/anthropic_api.py: Anthropic's Messages API on the served session, driven by the
unmodified `anthropic` client (2.x: sampling fields go in `extra_body`, as the API reads them).

Every test that takes `sampler` runs on HF generate and, marked `vllm`, on vLLM (`make test-vllm`).
"""

from __future__ import annotations

import time

import anthropic
import httpx
import pytest

import workbench as wb
from workbench.server import TinkerServer

GREEDY = {"temperature": 0}
QUESTION = [{"role": "user", "content": "What is the secret word?"}]


def claude(srv: TinkerServer, key: str = "tml-local") -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=f"{srv.url}/anthropic/api", api_key=key, max_retries=0, timeout=600
    )  # vLLM starts on first use


def test_greedy_message_is_the_samplers_greedy_sample(
    sampler: str, sess: wb.Session, srv: TinkerServer
) -> None:
    system = "Answer in one word."
    message = claude(srv).messages.create(
        model=sess.config.base_model, max_tokens=10, system=system, messages=QUESTION, extra_body=GREEDY
    )
    conversation = [{"role": "system", "content": system}, *QUESTION]
    text = sess.tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    prompt = sess.tokenizer.encode(text, add_special_tokens=False)
    sampled = (
        sess.sampling_client(base=True)
        .sample(wb.ModelInput.from_ints(prompt), 1, wb.SamplingParams(max_tokens=10, temperature=0))
        .result()
        .sequences[0]
    )
    tokens = sampled.tokens
    ended = sampled.stop_reason == "stop"
    assert message.content[0].text == sess.tokenizer.decode(
        tokens[:-1] if ended else tokens, skip_special_tokens=True
    )
    assert message.stop_reason == ("end_turn" if ended else "max_tokens")
    assert message.usage.input_tokens == len(prompt)
    assert message.usage.output_tokens == len(tokens)
    counted = claude(srv).messages.count_tokens(
        model=sess.config.base_model, system=system, messages=QUESTION
    )
    assert counted.input_tokens == len(prompt)


def test_streamed_text_is_the_unstreamed_text(sampler: str, sess: wb.Session, srv: TinkerServer) -> None:
    client = claude(srv)
    request = {
        "model": sess.config.base_model,
        "max_tokens": 20,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]}],
        "extra_body": GREEDY,
    }
    whole = client.messages.create(**request)
    with client.messages.stream(**request) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text
    assert final.content[0].text == whole.content[0].text
    assert final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_stop_sequences_and_seeded_sampling(sampler: str, sess: wb.Session, srv: TinkerServer) -> None:
    client = claude(srv)
    base = sess.config.base_model
    free = (
        client.messages.create(model=base, max_tokens=30, messages=QUESTION, extra_body=GREEDY)
        .content[0]
        .text
    )
    stop = free[4:6]
    assert stop.strip(), free
    cut = client.messages.create(
        model=base, max_tokens=30, messages=QUESTION, stop_sequences=[stop], extra_body=GREEDY
    )
    assert cut.content[0].text == free[: free.index(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    hot = {"temperature": 1.0, "top_p": 0.9, "top_k": 50}
    draws = {
        client.messages.create(model=base, max_tokens=10, messages=QUESTION, extra_body=hot).content[0].text
        for _ in range(4)
    }
    assert len(draws) > 1  # sampling, not greedy


REFUSALS = [
    ({"model": "no-such-model"}, anthropic.NotFoundError, "not served here"),
    ({"max_tokens": 0}, anthropic.BadRequestError, "max_tokens"),
    ({"max_tokens": 10**9}, anthropic.BadRequestError, "context"),
    ({"messages": [{"role": "system", "content": "x"}]}, anthropic.BadRequestError, "role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        anthropic.BadRequestError,
        "text",
    ),
    ({"stop_sequences": ["x"] * 100}, anthropic.BadRequestError, "stop_sequences"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}}]}, anthropic.BadRequestError, "tools"),
    ({"extra_body": {"temperature": -1}}, anthropic.BadRequestError, "temperature"),
    ({"extra_body": {"top_k": 0}}, anthropic.BadRequestError, "top_k"),
]


def test_every_refusal_is_the_clients_own_error_at_once_and_changes_nothing(
    sess: wb.Session, srv: TinkerServer
) -> None:
    client = claude(srv)
    digest, rows = sess.state_digest(), len(sess.history)
    for keywords, error_class, words in REFUSALS:
        request = {"model": sess.config.base_model, "max_tokens": 4, "messages": QUESTION, **keywords}
        start = time.perf_counter()
        with pytest.raises(error_class, match=words) as raised:
            client.messages.create(**request)
        assert time.perf_counter() - start < 1.0, keywords
        assert raised.value.body["type"] == "error"  # Anthropic's error shape
    malformed = httpx.post(f"{srv.url}/anthropic/api/v1/messages", content=b"[1, 2", timeout=30)
    assert malformed.status_code == 400
    assert malformed.json()["error"]["type"] == "invalid_request_error"
    assert sess.state_digest() == digest
    assert len(sess.history) == rows


def test_the_tinker_key_is_the_key(sess: wb.Session) -> None:
    srv = sess.serve(api_key="tml-secret-key")
    with pytest.raises(anthropic.AuthenticationError, match="API key"):
        claude(srv, key="tml-wrong-key-1").messages.create(model="tiny", max_tokens=2, messages=QUESTION)
    message = claude(srv, key="tml-secret-key").messages.create(model="tiny", max_tokens=2, messages=QUESTION)
    assert message.usage.output_tokens >= 1
