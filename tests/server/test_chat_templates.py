"""workbench/loops/chat.py (over HTTP): a conversation rendered by the model's own template, its end of turn,
and tools: rendered by a template that takes them (Hermes format), the model's calls parsed back, over
HTTP with the unmodified openai client on a tiny model taught to call a tool."""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

import workbench as wb
from tests.datums import sft_datum
from workbench.engine.model.base_model import resolve_model_path
from workbench.loops.chat import end_of_turn_ids, parse_reply, render_chat, template_takes_tools

HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
# Tools

You are provided with function signatures within <tools></tools> XML tags:
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags.<|im_end|>
{% endif %}
{%- for message in messages %}{% if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def test_end_of_turn_and_rendering() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    assert end_of_turn_ids(tokenizer) == {tokenizer.convert_tokens_to_ids("<|im_end|>")}
    messages = [
        {
            "role": "developer",
            "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        }
    ]
    messages.append({"role": "user", "content": "hi"})
    expected = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    assert render_chat(tokenizer, messages) == tokenizer.encode(expected, add_special_tokens=False)
    assert not template_takes_tools(tokenizer)
    with pytest.raises(ValueError, match="does not render tools"):
        render_chat(tokenizer, messages, [WEATHER])


def test_tools_render_through_a_hermes_template_and_calls_parse_back(hermes_tiny: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(hermes_tiny)
    assert template_takes_tools(tokenizer)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    text = tokenizer.decode(render_chat(tokenizer, history, [WEATHER]))
    assert (
        '"name": "get_weather"' in text and '{"city": "Paris"}' in text and "<tool_response>\nsunny" in text
    )
    reply = parse_reply(
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
        True,
    )
    assert reply.content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in reply.tool_calls] == [
        ("get_weather", {"city": "Oslo"})
    ]
    assert parse_reply("<tool_call>not json</tool_call>", True).tool_calls == []
    assert parse_reply("<tool_call>{}</tool_call>", False).content == "<tool_call>{}</tool_call>"


def test_a_model_taught_to_call_a_tool_returns_openai_tool_calls(hermes_tiny: str) -> None:
    sess = wb.Session(hermes_tiny, wb.LoraConfig(rank=4), seed=0, wandb=False)
    tool = {"type": "function", "function": {"name": "now", "parameters": {}}}  # short: few tokens to learn
    try:
        messages = [{"role": "user", "content": "Time?"}]
        prompt = sess.tokenizer.decode(render_chat(sess.tokenizer, messages, [tool]))
        call = '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>'
        datum = sft_datum(sess.tokenizer, prompt, call + "<|im_end|>")
        for _ in range(80):
            sess.policy.forward_backward([datum], "cross_entropy")
            sess.policy.optim_step({"learning_rate": 5e-3})
        api = sess.openai_client(max_retries=0)
        reply = api.chat.completions.create(
            model=sess.model_id, messages=messages, tools=[tool], max_tokens=80, temperature=0
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message
        assert choice.message.tool_calls[0].function.name == "now"
        assert json.loads(choice.message.tool_calls[0].function.arguments) == {"tz": "UTC"}
        with pytest.raises(openai.BadRequestError, match="tool_choice"):
            api.chat.completions.create(
                model=sess.model_id, messages=messages, tools=[tool], tool_choice="required", max_tokens=4
            )
        plain = api.chat.completions.create(
            model=sess.model_id, messages=messages, tools=[tool], tool_choice="none", max_tokens=4
        )
        assert plain.choices[0].message.tool_calls is None
    finally:
        sess.close()
