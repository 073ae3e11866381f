"""Chat templates: a conversation to prompt tokens with the tokenizer's own template, a reply back to a
message, and a conversation as a supervised datum.

Every place that renders a chat renders it here, the same way: the compatible APIs (OpenAI's chat
completions, Anthropic's messages), the panel's chat box and Sample tab, and the SFT datums of
`chat_datum`. The model's chat template (`apply_chat_template` with `add_generation_prompt=True`) gives
the tokens the model was tuned on, and the same a Tinker client gets by rendering the conversation
itself. A reply ends at the template's end of turn: the token the template puts right after an
assistant message (`<|im_end|>` for ChatML, `<|eot_id|>` for Llama 3), and the tokenizer's
end-of-sequence token.

`chat_prompt` is the rendered prompt as a `ModelInput`; `chat_datum` turns a whole conversation into a
Tinker SFT datum whose prompt part is exactly that prompt (weight 0: context, not a target) and whose
weights train only on the assistant's final message.

Tools are rendered by the template when it takes them (`tools` appears in it), and the model's calls are
parsed back where the family's format is known: Qwen / Hermes, whose template asks for
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. A request with tools for any other template
is refused, since the model could neither see the tools as it was trained to nor call them in a form
this side can read.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from workbench.types import Datum, ModelInput

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The roles a message may have; `developer` (OpenAI's newer name for system) is rendered as `system`."""

HERMES_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """A function call the model made: its id (made here), the function's name and its JSON arguments."""

    call_id: str
    name: str
    arguments: str  # JSON text, as both APIs carry it


@dataclass(frozen=True)
class Reply:
    """The assistant's reply: its text (without the tool calls) and the calls it made."""

    content: str
    tool_calls: list[ToolCall]


def end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """The tokens that end an assistant's turn: the end-of-sequence token, and the special token the
    chat template writes right after an assistant message's text, found by rendering one."""
    ids = set() if tokenizer.eos_token_id is None else {int(tokenizer.eos_token_id)}
    if tokenizer.chat_template is None:
        return frozenset(ids)
    marker = "\u2063workbench-end-of-turn\u2063"
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}, {"role": "assistant", "content": marker}], tokenize=False
        )
    except TemplateError:
        return frozenset(ids)
    assert isinstance(text, str)
    after = text.split(marker, 1)[1] if marker in text else ""
    following = tokenizer.encode(after, add_special_tokens=False)[:1]
    if following and following[0] in set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder):
        ids.add(int(following[0]))
    return frozenset(ids)


def template_takes_tools(tokenizer: PreTrainedTokenizerBase) -> bool:
    """Whether the chat template renders tools, and the model's calls can be parsed (Hermes format)."""
    template = tokenizer.chat_template or ""
    return "tools" in template and "<tool_call>" in template


def _text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of text parts (OpenAI's `{"type": "text",
    "text": ...}` and Anthropic's text blocks)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for index, part in enumerate(content):
        if (
            not isinstance(part, Mapping)
            or part.get("type") != "text"
            or not isinstance(part.get("text"), str)
        ):
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(
                f"{where}[{index}]: only text parts are supported (type 'text' with a string 'text'), got {kind!r}"
            )
        texts.append(part["text"])
    return "".join(texts)


def _template_tool_call(call: Any, where: str) -> dict[str, Any]:
    """An OpenAI tool call as chat templates read it: the arguments as a mapping (the templates dump
    them with `tojson`)."""
    if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    function = call["function"]
    arguments = function.get("arguments", "{}")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError as error:
            raise ValueError(f"{where}.function.arguments is not JSON: {error}") from None
    return {
        "id": call.get("id"),
        "type": "function",
        "function": {"name": str(function.get("name", "")), "arguments": arguments},
    }


def template_messages(messages: Sequence[Any]) -> list[dict[str, Any]]:
    """OpenAI-shaped messages checked and put in the form chat templates read."""
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    rendered = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping):
            raise ValueError(f"{where} must be an object with 'role' and 'content'")
        role = message.get("role")
        if role not in ROLES:
            raise ValueError(f"{where}.role must be one of {list(ROLES)}, got {role!r}")
        entry: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text_of(message.get("content"), f"{where}.content"),
        }
        if role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, list):
                raise ValueError(f"{where}.tool_calls must be a list")
            entry["tool_calls"] = [
                _template_tool_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(calls)
            ]
        if role == "tool":
            entry["tool_call_id"] = message.get("tool_call_id")
        rendered.append(entry)
    return rendered


def render_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Any],
    tools: Sequence[Any] | None = None,
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The prompt tokens of a conversation: the chat template's text with the assistant's turn opened
    (`add_generation_prompt=True`; False: the conversation as it stands, for a datum), tokenized without
    adding special tokens again (the template wrote them)."""
    if tokenizer.chat_template is None:
        raise ValueError(
            "this tokenizer has no chat template: build the prompt tokens yourself (or use the completions endpoint)"
        )
    checked = template_messages(messages)
    if tools:
        if not template_takes_tools(tokenizer):
            raise ValueError(
                "tools: this model's chat template does not render tools in a format whose calls can be "
                "read back (the Qwen / Hermes <tool_call> format); send the conversation without tools"
            )
        for index, tool in enumerate(tools):
            if not isinstance(tool, Mapping) or tool.get("type") != "function":
                raise ValueError(f"tools[{index}] must be {{'type': 'function', 'function': {{...}}}}")
    try:
        text = tokenizer.apply_chat_template(
            checked,
            tools=list(tools) if tools else None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
    except TemplateError as error:
        raise ValueError(f"messages: the chat template refused the conversation: {error}") from None
    assert isinstance(text, str)
    return list(tokenizer.encode(text, add_special_tokens=False))


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Any]) -> ModelInput:
    """The prompt for the model's next (assistant) turn after `messages` (`render_chat`)."""
    return ModelInput.from_ints(render_chat(tokenizer, messages))


def chat_datum(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]]) -> Datum:
    """An SFT datum from a conversation ending with the assistant's answer: its prompt part is
    `render_chat` of the messages before the answer, weight 0; weight 1 on the answer's tokens (its
    end-of-turn token included)."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("a chat datum's last message must be the assistant's answer")
    prompt = render_chat(tokenizer, messages[:-1])
    full = render_chat(tokenizer, messages, add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template renders the conversation's start differently from its prompt")
    eos = tokenizer.eos_token_id
    if eos is not None and eos in full[len(prompt) :]:
        # end at the answer's end-of-turn token: what a template adds after it is not the model's to say
        full = full[: len(full) - full[::-1].index(eos)]
    weights = [0.0] * len(prompt) + [1.0] * (len(full) - len(prompt))
    return Datum(
        model_input=ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights[1:]},
    )


def parse_reply(text: str, tools_offered: bool, *, object_arguments: bool = False) -> Reply:
    """The reply's text and tool calls: with tools offered, each Hermes `<tool_call>` block holding a
    JSON object with a `name` becomes a call (its `arguments` as JSON text) and leaves the text; a block
    that is not such JSON stays in the text. With `object_arguments` (Anthropic's `tool_use` input is an
    object), a call's arguments must be a JSON object or JSON text of one, else its block stays too."""
    if not tools_offered:
        return Reply(text, [])
    calls: list[ToolCall] = []

    def take(found: re.Match[str]) -> str:
        try:
            call = json.loads(found[1])
        except json.JSONDecodeError:
            return found[0]
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return found[0]
        arguments = call.get("arguments", {})
        if object_arguments:
            try:
                arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError:
                return found[0]
            if not isinstance(arguments, dict):
                return found[0]
        calls.append(
            ToolCall(
                call_id=f"call_{secrets.token_hex(12)}",
                name=call["name"],
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            )
        )
        return ""

    content = HERMES_TOOL_CALL.sub(take, text)
    return Reply(content.strip() if calls else content, calls)
