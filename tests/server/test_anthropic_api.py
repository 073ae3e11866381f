"""workbench/server/anthropic_api.py: Anthropic's Messages API on the served session, driven by the
unmodified `anthropic` client (2.x: sampling fields go in `extra_body`, as the API reads them).

Every test that takes `sampler` runs on HF generate and, marked `vllm`, on vLLM (`make test-vllm`).
Tools run on the tiny model with a chat template in the Qwen / Hermes tool format (`test_chat_templates`'s),
taught to call one as the OpenAI route's tool test teaches it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest

import workbench as wb
from tests.datums import sft_datum
from tests.server.conftest import HeldDecoding
from workbench.loops.chat import render_chat
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


def test_a_streamed_reply_with_a_stop_sequence_is_the_unstreamed_reply(
    sess: wb.Session, srv: TinkerServer
) -> None:
    """A greedy reply cut at a stop sequence the free text contains: the streamed text joins to the
    unstreamed text (nothing of the stop sequence is sent), with the same stop reason and sequence."""
    client = claude(srv)
    request = {"model": sess.config.base_model, "max_tokens": 30, "messages": QUESTION, "extra_body": GREEDY}
    free = client.messages.create(**request).content[0].text
    stop = free[4:6]
    assert stop.strip(), free
    whole = client.messages.create(**request, stop_sequences=[stop])
    with client.messages.stream(**request, stop_sequences=[stop]) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == free[: free.index(stop)]
    assert final.stop_reason == whole.stop_reason == "stop_sequence"
    assert final.stop_sequence == stop
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_text_reaches_the_client_while_the_reply_is_drawn(
    sess: wb.Session, srv: TinkerServer, hold_decoding: Callable[[int], HeldDecoding]
) -> None:
    """A streamed reply's first text delta arrives before the reply ends. Deterministic on any
    machine: the sampler's decoding loop is held after its 63rd of 64 tokens until the client has read
    the first text delta, so that delta can only have come from a reply still being drawn (were the
    events sent at the end, the hold would run out and `waited` be False). A client that then leaves
    the stream leaves the server answering the next request as usual."""
    client = claude(srv)
    request = {"model": sess.config.base_model, "max_tokens": 64, "messages": QUESTION, "extra_body": GREEDY}
    whole = client.messages.create(**request)
    assert whole.stop_reason == "max_tokens"
    hold = hold_decoding(63)
    with client.messages.stream(**request) as stream:
        pieces = []
        for piece in stream.text_stream:
            if not hold.let_go.is_set():
                assert hold.waited is None  # the sampler is held, at token 63: the reply has not ended
                hold.let_go.set()
            pieces.append(piece)
        final = stream.get_final_message()
    assert hold.waited is True
    assert "".join(pieces) == whole.content[0].text
    assert final.stop_reason == "max_tokens"
    hold = hold_decoding(8)
    with client.messages.stream(**request) as stream:
        next(iter(stream.text_stream))
    hold.let_go.set()
    again = claude(srv).with_options(timeout=60).messages.create(**{**request, "max_tokens": 5})
    assert hold.waited is True
    assert again.usage.output_tokens == 5


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
    (
        {
            "tools": [{"name": "f", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "none"},
            "messages": [
                {"role": "user", "content": "Go."},
                {
                    "role": "assistant",
                    "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}],
                },
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "ok"}]},
            ],
        },
        anthropic.BadRequestError,
        "does not render tool calls",
    ),
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


# ---------------------------------------------------------------------------------------------- tools

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_FUNCTION = {  # the same tool as the OpenAI API and the chat templates take it
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": WEATHER["input_schema"],
    },
}
ASKED = {"role": "user", "content": "Weather in Paris and Oslo?"}
CALLED = {
    "role": "assistant",
    "content": [
        {"type": "text", "text": "Let me look."},
        {"type": "tool_use", "id": "toolu_01", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "toolu_02", "name": "get_weather", "input": {"city": "Oslo"}},
    ],
}


def tool_result(tool_use_id: str, content: Any = "sunny", **fields: Any) -> dict[str, Any]:
    return {"type": "tool_result", "tool_use_id": tool_use_id, "content": content, **fields}


ANSWERED = {
    "role": "user",
    "content": [
        tool_result("toolu_01"),
        tool_result(
            "toolu_02", [{"type": "text", "text": "rain"}, {"type": "text", "text": ", 4 C"}], is_error=False
        ),
        {"type": "text", "text": "And tomorrow?"},
    ],
}


def openai_turns(arguments: type[str] | type[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation ASKED, CALLED, ANSWERED in OpenAI's shape: the calls' arguments as JSON text (the
    openai client's) or as objects (what chat templates read)."""
    calls = [
        {
            "id": f"toolu_0{n}",
            "type": "function",
            "function": {
                "name": "get_weather",
                "arguments": json.dumps({"city": city}) if arguments is str else {"city": city},
            },
        }
        for n, city in ((1, "Paris"), (2, "Oslo"))
    ]
    return [
        ASKED,
        {"role": "assistant", "content": "Let me look.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "toolu_01", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_02", "content": "rain, 4 C"},
        {"role": "user", "content": "And tomorrow?"},
    ]


@pytest.fixture
def hermes(hermes_tiny: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[wb.Session]:
    """A session on the Hermes-template tiny model, with a runs folder of its own."""
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    session = wb.Session(hermes_tiny, wb.LoraConfig(rank=4), seed=0, wandb=False)
    yield session
    session.close()


def test_tools_and_tool_turns_render_as_the_same_conversation_in_openais_shape(hermes: wb.Session) -> None:
    """Tools, tool_use and tool_result blocks are rendered to the tokens of the same conversation in
    OpenAI's shape: the template's own rendering, and the OpenAI route's prompt."""
    srv = hermes.serve()
    client, base = claude(srv), hermes.config.base_model
    conversation = [ASKED, CALLED, ANSWERED]
    text = hermes.tokenizer.apply_chat_template(
        openai_turns(dict), tools=[WEATHER_FUNCTION], add_generation_prompt=True, tokenize=False
    )
    expected = hermes.tokenizer.encode(text, add_special_tokens=False)
    assert '"name": "get_weather", "arguments": {"city": "Oslo"}' in text and "rain, 4 C" in text
    chat = openai.OpenAI(base_url=f"{srv.url}/oai/api/v1", api_key="tml-local", max_retries=0)
    answer = chat.chat.completions.create(
        model=base, messages=openai_turns(str), tools=[WEATHER_FUNCTION], max_tokens=8, temperature=0
    )
    assert answer.model_extra["prompt_token_ids"] == expected
    counted = client.messages.count_tokens(model=base, messages=conversation, tools=[WEATHER])
    assert counted.input_tokens == len(expected)
    message = client.messages.create(
        model=base, max_tokens=8, messages=conversation, tools=[WEATHER], extra_body=GREEDY
    )
    assert message.usage.input_tokens == len(expected)
    # the same prompt: the same greedy reply as the OpenAI route's (a reply of the random model)
    assert message.content[0].text == answer.choices[0].message.content
    # without tools offered the tools are not rendered; the tool turns still are
    bare = hermes.tokenizer.apply_chat_template(
        openai_turns(dict), add_generation_prompt=True, tokenize=False
    )
    unoffered = client.messages.count_tokens(
        model=base, messages=conversation, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert unoffered.input_tokens == len(hermes.tokenizer.encode(bare, add_special_tokens=False))
    auto = client.messages.count_tokens(
        model=base, messages=conversation, tools=[WEATHER], tool_choice={"type": "auto"}
    )
    assert auto.input_tokens == len(expected)


def test_a_model_taught_to_call_a_tool_answers_with_tool_use_blocks(hermes: wb.Session) -> None:
    """The model's text and call come back as a text block and a tool_use block with stop_reason
    tool_use, unstreamed and through the client's stream helper (text_delta, then input_json_delta),
    and the conversation goes on with the call's result."""
    tool = {"name": "now", "input_schema": {"type": "object"}}  # short: few tokens to learn
    function = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
    asked = [{"role": "user", "content": "Time?"}]
    prompt = hermes.tokenizer.decode(render_chat(hermes.tokenizer, asked, [function]))
    call = 'OK.\n<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>'
    datum = sft_datum(hermes.tokenizer, prompt, call + "<|im_end|>")
    for _ in range(80):
        hermes.policy.forward_backward([datum], "cross_entropy")
        hermes.policy.optim_step({"learning_rate": 5e-3})
    client = claude(hermes.serve())
    request = {
        "model": hermes.model_id,
        "max_tokens": 80,
        "messages": asked,
        "tools": [tool],
        "extra_body": GREEDY,
    }
    message = client.messages.create(**request)
    assert message.stop_reason == "tool_use", message.content
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "OK."
    used = message.content[1]
    assert (used.name, used.input) == ("now", {"tz": "UTC"})
    assert used.id.startswith("toolu_") and len(used.id) > len("toolu_")
    counted = client.messages.count_tokens(model=hermes.model_id, messages=asked, tools=[tool])
    assert counted.input_tokens == message.usage.input_tokens == len(hermes.tokenizer.encode(prompt))

    with client.messages.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[0].text == "OK."
    assert [(b.type, b.name, b.input) for b in final.content[1:]] == [("tool_use", "now", {"tz": "UTC"})]
    started = [e.content_block for e in events if e.type == "content_block_start"]
    assert started[0].type == "text" and (started[1].type, started[1].input) == ("tool_use", {})
    assert "".join(e.text for e in events if e.type == "text") == "OK."
    assert json.loads("".join(e.partial_json for e in events if e.type == "input_json")) == {"tz": "UTC"}
    kinds = [(e.type, getattr(e, "index", None)) for e in events if e.type not in ("text", "input_json")]
    assert kinds == [
        ("message_start", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("message_delta", None),
        ("message_stop", None),
    ]

    # the call answered: the conversation goes on with the tool_use block as the client got it
    answered = [
        *asked,
        {"role": "assistant", "content": [used.model_dump(include={"type", "id", "name", "input"})]},
        {"role": "user", "content": [tool_result(used.id, "12:00")]},
    ]
    follow_up = client.messages.create(**{**request, "messages": answered, "max_tokens": 4})
    assert follow_up.usage.input_tokens > message.usage.input_tokens
    assert follow_up.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # tool_choice none: the tools are not rendered and nothing is parsed
    plain = client.messages.create(**{**request, "tool_choice": {"type": "none"}, "max_tokens": 30})
    assert [block.type for block in plain.content] == ["text"]
    assert plain.stop_reason != "tool_use"
    assert plain.usage.input_tokens < message.usage.input_tokens


def _result(content: Any = "sunny") -> dict[str, Any]:
    return {"role": "user", "content": [tool_result("toolu_01", content), tool_result("toolu_02")]}


TOOL_REFUSALS = [
    # (request fields, words of the message)
    ({"tools": {"name": "f"}}, "tools must be a list"),
    ({"tools": [{"name": "f"}]}, "input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "input_schema"),
    ({"tools": [{**WEATHER, "name": "get weather"}]}, "name must be"),
    ({"tools": [WEATHER, WEATHER]}, "defined twice"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tools"),
    ({"tools": [{**WEATHER, "strict": True}]}, "strict"),
    ({"tools": [{**WEATHER, "defer_loading": True}]}, "defer_loading"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"}}, "cannot force a tool call"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"}}, "cannot force"),
    ({"tools": [WEATHER], "tool_choice": "auto"}, "tool_choice must be"),
    ({"tools": None, "messages": [ASKED, CALLED, _result()]}, "must define tools"),
    ({"messages": [ASKED, CALLED]}, "no tool_result blocks after"),
    ({"messages": [ASKED, CALLED, {"role": "user", "content": "hi"}]}, "no tool_result blocks here"),
    (
        {"messages": [ASKED, CALLED, {"role": "user", "content": [tool_result("toolu_01")]}]},
        r"\['toolu_02'\] of messages\[1\] have no tool_result",
    ),
    (
        {"messages": [ASKED, CALLED, {"role": "user", "content": [tool_result("toolu_99")]}]},
        "answers no tool_use",
    ),
    (
        {
            "messages": [
                ASKED,
                CALLED,
                {"role": "user", "content": [*_result()["content"], tool_result("toolu_01")]},
            ]
        },
        "answered twice",
    ),
    (
        {
            "messages": [
                ASKED,
                CALLED,
                {"role": "user", "content": [{"type": "text", "text": "here:"}, *_result()["content"]]},
            ]
        },
        "come first",
    ),
    (
        {
            "messages": [
                ASKED,
                {"role": "assistant", "content": [*CALLED["content"][1:], CALLED["content"][0]]},
                _result(),
            ]
        },
        "text after a tool_use",
    ),
    (
        {
            "messages": [
                ASKED,
                {"role": "assistant", "content": [CALLED["content"][1], CALLED["content"][1]]},
                _result(),
            ]
        },
        "used twice",
    ),
    (
        {"messages": [{"role": "user", "content": [CALLED["content"][1]]}]},
        "user messages take text and tool_result",
    ),
    ({"messages": [ASKED, {"role": "assistant", "content": [tool_result("x")]}]}, "assistant messages take"),
    (
        {
            "messages": [
                ASKED,
                {"role": "assistant", "content": [{**CALLED["content"][1], "input": "Paris"}]},
                {"role": "user", "content": [tool_result("toolu_01")]},
            ]
        },
        "input must be an object",
    ),
    ({"messages": [ASKED, CALLED, _result([{"type": "image", "source": {}}])]}, "only text blocks"),
    ({"messages": [ASKED, CALLED, _result(7)]}, "string or a list of text blocks"),
]


def test_every_tool_refusal_is_the_clients_own_error_at_once_and_changes_nothing(hermes: wb.Session) -> None:
    """Malformed tools, a forced tool_choice, tool blocks out of Anthropic's pairing or of the wrong
    type: a 400 in Anthropic's shape from both endpoints, at once, and no operation runs."""
    client = claude(hermes.serve())
    digest, rows = hermes.state_digest(), len(hermes.history)
    for fields, words in TOOL_REFUSALS:
        request = {"model": hermes.config.base_model, "messages": [ASKED], "tools": [WEATHER], **fields}
        for send in (client.messages.count_tokens, partial(client.messages.create, max_tokens=4)):
            start = time.perf_counter()
            with pytest.raises(anthropic.BadRequestError, match=words) as raised:
                send(**request)
            assert time.perf_counter() - start < 1.0, fields
            assert raised.value.body["error"]["type"] == "invalid_request_error"
    assert hermes.state_digest() == digest
    assert len(hermes.history) == rows
