"""Anthropic's Messages API on the Tinker server: `/v1/messages` and `/v1/messages/count_tokens` under
`/anthropic/api`.

As hosted Tinker serves it, so the unmodified `anthropic` client and the agent frameworks built on it use
a policy while it trains: `anthropic.Anthropic(base_url=f"{srv.url}/anthropic/api", api_key=<key>)`. The
conversation is rendered with the model's chat template like an OpenAI chat (`loops.chat`), the `model`
names the weights (`served_weights`) and the request runs through the engine's ordered sample path
(`generation`).

Every field is supported, ignored or refused (`PARAMETERS`); a refusal comes in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, with status 400, 401, 404 or 413, before anything is
queued. The `anthropic` client (2.x) has no arguments for `temperature`, `top_p` and `top_k`; they go in
`extra_body={"temperature": 0}`, as the Messages API reads them. Streams (`stream: true`) send Anthropic's
events (message_start, content_block_start, ping, content_block_delta, content_block_stop, message_delta,
message_stop), the text deltas as the sampler (HF or vLLM) draws the tokens
(`generation.stream_generate`), each sent when the next token's text is in; with tools offered, once the reply is sampled (its calls are read from the whole reply). A failure
after the stream has started comes as an `error` event, which the `anthropic` client raises.

Tools, where the chat template takes them (`loops.chat`: the Qwen / Hermes `<tool_call>` format, the
OpenAI route's rule): each tool (`name`, `description`, `input_schema`) is rendered as the template's
function tool (`parameters` the input schema); an assistant's `tool_use` blocks are rendered as its tool
calls and a user's `tool_result` blocks as tool messages, in their order, before the user's text, so a
conversation renders to the tokens of the same conversation in OpenAI's shape. The model's calls come
back as `tool_use` blocks after the text, with `stop_reason: "tool_use"`; streamed, each is a
content_block_start (its `input` empty) and one `input_json_delta` with the input's JSON. The pairing
rules are Anthropic's: the `tool_use` blocks of an assistant message are answered by `tool_result`
blocks at the start of the next (user) message, one per id, and a request with either kind of block
defines `tools`. A result's `is_error` has no place in the Hermes format: its text is what the model
reads.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import AsyncIterator, Mapping
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Response
from fastapi.responses import JSONResponse

from workbench.loops.chat import parse_reply, render_chat, template_takes_tools
from workbench.server.compat_http import CompatRoutes, error_status, event_stream, started
from workbench.server.errors import RequestError, message_of
from workbench.server.generation import (
    ModelRoutes,
    SequenceDone,
    check_calls,
    generate,
    generation_call,
    stream_generate,
)
from workbench.server.sampling_fields import FieldError, flag, refuse_unless, sampling_fields
from workbench.server.served_weights import ServedWeights
from workbench.server.service import TinkerService
from workbench.types import MIN_TEMPERATURE

if TYPE_CHECKING:
    from workbench.server.generation import Completion, Generated, GenerationCall, TextDelta

PREFIX = "/anthropic/api"

PARAMETERS: dict[str, str] = {
    "model": "supported: a base model, a tinker:// checkpoint path, '<base>;<path>' or a model id",
    "messages": "supported: user / assistant messages, content a string or text blocks; tool_use blocks "
    "(assistant) and tool_result blocks (user) where tools are",
    "system": "supported: a string or text blocks",
    "max_tokens": "supported (required, >= 1)",
    "temperature": f"supported: 0 (greedy) or at least {MIN_TEMPERATURE:g} (SamplingParams' rule)",
    "top_p": "supported: in (0, 1]",
    "top_k": "supported: -1 (off) or >= 1",
    "stop_sequences": "supported: up to 16",
    "stream": "supported: token by token as the sampler draws them (tools offered: once the reply is sampled)",
    "metadata": "ignored",
    "service_tier": "ignored",
    "cache_control": "ignored",
    "diagnostics": "ignored",
    "inference_geo": "ignored",
    "speed": "ignored",
    "user_profile_id": "ignored",
    "workspace_id": "ignored",
    "output_config": "refused unless empty",
    "tools": "supported: custom tools {name, description, input_schema} where the chat template renders "
    "them in the Qwen / Hermes format, else refused; server tools, strict and defer_loading refused",
    "tool_choice": "supported: {'type': 'auto'} and {'type': 'none'} (disable_parallel_tool_use ignored); "
    "refused: 'any' or a named tool",
    "thinking": "refused unless disabled",
    "container": "refused",
    "mcp_servers": "refused",
}
"""Each request field, and what this server does with it; a field not listed here is ignored."""

_REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "thinking": (None, {"type": "disabled"}),
    "container": (None,),
    "mcp_servers": (None, []),
    "output_config": (None, {}),
}

SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k"}
"""The `SamplingParams` fields the Messages API sets, each by its own name (it has no seed)."""


TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,128}")
"""A tool's name, as the Messages API takes it."""


def _template_tools(tools: Any) -> list[dict[str, Any]]:
    """Anthropic's custom tools checked, in the function-tool form chat templates read."""
    if not isinstance(tools, list):
        raise RequestError("tools must be a list of {'name', 'description', 'input_schema'} objects")
    functions: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping):
            raise RequestError(f"{where} must be an object {{'name', 'description', 'input_schema'}}")
        if tool.get("type") not in (None, "custom"):
            raise RequestError(
                f"{where}: Anthropic's server tools ({tool.get('type')!r}) are not run here; only custom "
                "tools {'name', 'description', 'input_schema'} are supported"
            )
        name = tool.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise RequestError(f"{where}.name must be 1 to 128 letters, digits, '_' or '-', got {name!r}")
        if any(function["name"] == name for function in functions):
            raise RequestError(f"{where}.name: the tool {name!r} is defined twice; tool names are unique")
        description = tool.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(f"{where}.description must be a string")
        schema = tool.get("input_schema")
        if not isinstance(schema, Mapping) or schema.get("type") != "object":
            raise RequestError(f"{where}.input_schema must be a JSON schema with 'type': 'object'")
        if tool.get("strict"):
            raise RequestError(f"{where}.strict: refused: this server cannot hold the input to the schema")
        if tool.get("defer_loading"):
            raise RequestError(f"{where}.defer_loading: refused: no tool search runs here to load the tool")
        function: dict[str, Any] = {"name": name}
        if description is not None:
            function["description"] = description
        function["parameters"] = dict(schema)
        functions.append(function)
    return [{"type": "function", "function": function} for function in functions]


def _tools(body: Mapping[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """The request's tools in the templates' form (checked even when not offered), and whether they are
    offered: rendered and the reply's calls parsed (not with `tool_choice: {"type": "none"}`)."""
    tools = [] if body.get("tools") is None else _template_tools(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        if not isinstance(choice, Mapping) or choice.get("type") not in ("auto", "none", "any", "tool"):
            raise RequestError(
                "tool_choice must be {'type': 'auto'}, {'type': 'none'}, {'type': 'any'} or "
                f"{{'type': 'tool', 'name': ...}}, got {choice!r}"
            )
        if choice["type"] in ("any", "tool"):
            raise RequestError(
                f"tool_choice {{'type': {choice['type']!r}}}: this server cannot force a tool call; use "
                "{'type': 'auto'} or {'type': 'none'}"
            )
        parallel = choice.get("disable_parallel_tool_use")
        if parallel is not None and not isinstance(parallel, bool):
            raise RequestError(
                f"tool_choice.disable_parallel_tool_use must be true or false, got {parallel!r}"
            )
    return tools, bool(tools) and (choice is None or choice["type"] == "auto")


def _block_type(block: Any) -> Any:
    return block.get("type") if isinstance(block, Mapping) else type(block).__name__


def _text(block: Mapping[str, Any], where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise RequestError(f"{where}.text must be a string")
    return str(block["text"])


def _tool_call(block: Mapping[str, Any], where: str) -> dict[str, Any]:
    """An assistant's tool_use block as an OpenAI tool call (its arguments the input object)."""
    if not isinstance(block.get("id"), str) or not block["id"]:
        raise RequestError(f"{where}.id must be a non-empty string")
    if not isinstance(block.get("name"), str) or not block["name"]:
        raise RequestError(f"{where}.name must be a non-empty string")
    if not isinstance(block.get("input"), Mapping):
        raise RequestError(f"{where}.input must be an object, got {block.get('input')!r}")
    return {
        "id": block["id"],
        "type": "function",
        "function": {"name": block["name"], "arguments": dict(block["input"])},
    }


def _tool_result(block: Mapping[str, Any], where: str) -> str:
    """A tool_result block's content as text: a string or text blocks."""
    if not isinstance(block.get("tool_use_id"), str):
        raise RequestError(f"{where}.tool_use_id must be a string")
    if block.get("is_error") is not None and not isinstance(block["is_error"], bool):
        raise RequestError(f"{where}.is_error must be true or false")
    content = block.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise RequestError(f"{where}.content must be a string or a list of text blocks")
    texts = []
    for index, part in enumerate(content):
        if _block_type(part) != "text":
            raise RequestError(
                f"{where}.content[{index}]: only text blocks are supported in a tool_result, got "
                f"{_block_type(part)!r}"
            )
        texts.append(_text(part, f"{where}.content[{index}]"))
    return "".join(texts)


def _conversation(messages: Any) -> tuple[list[dict[str, Any]], bool]:
    """Anthropic's messages as the OpenAI-shaped messages chat templates read (`loops.chat`), and
    whether any held a tool block. An assistant's text blocks are its content and its tool_use blocks
    its tool calls (the text first, where the templates write it); a user's tool_result blocks come
    first (Anthropic's rule), each answering one tool_use of the message before, and become tool
    messages in their order, the user's text then a user message."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {'role', 'content'} objects")
    converted: list[dict[str, Any]] = []
    awaited: list[str] = []  # the ids of the previous message's tool_use blocks
    tool_blocks = False
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
            raise RequestError(f"{where}.role must be 'user' or 'assistant'")
        role, content = message["role"], message.get("content")
        blocks = _Blocks(role, awaited)
        for number, block in enumerate(content if isinstance(content, list) else []):
            blocks.add(block, f"{where}.content[{number}]")
        missing = [call_id for call_id in awaited if call_id not in blocks.answered]
        if missing:
            raise RequestError(
                f"{where}: the tool_use ids {missing} of messages[{index - 1}] have no tool_result blocks "
                "here; each tool_use is answered by a tool_result at the start of the next message"
            )
        # a string (or a wrong type, which `render_chat` names) stays as it came
        text: Any = "".join(blocks.texts) if isinstance(content, list) else content
        converted.extend(blocks.results)
        if blocks.calls:
            converted.append({"role": "assistant", "content": text, "tool_calls": blocks.calls})
        elif blocks.texts or not blocks.results:
            converted.append({"role": role, "content": text})
        tool_blocks = tool_blocks or bool(blocks.calls or blocks.results)
        awaited = [call["id"] for call in blocks.calls]
    if awaited:
        raise RequestError(
            f"messages[{len(messages) - 1}]: the tool_use ids {awaited} have no tool_result blocks after "
            "them; each tool_use is answered by a tool_result at the start of the next message"
        )
    return converted, tool_blocks


class _Blocks:
    """One message's content blocks, read in order: its texts, its tool calls (an assistant's) and its
    tool results (a user's, answering `awaited`, the previous message's tool_use ids)."""

    def __init__(self, role: str, awaited: list[str]):
        self.role = role
        self.awaited = awaited
        self.texts: list[str] = []
        self.calls: list[dict[str, Any]] = []
        self.results: list[dict[str, Any]] = []

    @property
    def answered(self) -> list[str]:
        """The tool_use ids the tool messages answer."""
        return [result["tool_call_id"] for result in self.results]

    def add(self, block: Any, at: str) -> None:
        kind = _block_type(block)
        if kind == "text" and not self.calls:
            self.texts.append(_text(block, at))
        elif kind == "text":
            raise RequestError(f"{at}: text after a tool_use block; the text comes first")
        elif kind == "tool_use" and self.role == "assistant":
            self.calls.append(_tool_call(block, at))
            if self.calls[-1]["id"] in [call["id"] for call in self.calls[:-1]]:
                raise RequestError(f"{at}.id: the tool_use id {self.calls[-1]['id']!r} is used twice")
        elif kind == "tool_result" and self.role == "user":
            self._add_result(block, at)
        else:
            takes = "text and tool_use" if self.role == "assistant" else "text and tool_result"
            raise RequestError(f"{at}: {self.role} messages take {takes} blocks here, got {kind!r}")

    def _add_result(self, block: Mapping[str, Any], at: str) -> None:
        if self.texts:
            raise RequestError(f"{at}: tool_result blocks come first in a message, before any text")
        result = _tool_result(block, at)
        if block["tool_use_id"] not in self.awaited:
            raise RequestError(
                f"{at}: tool_use_id {block['tool_use_id']!r} answers no tool_use of the previous "
                f"message (its tool_use ids: {self.awaited})"
            )
        if block["tool_use_id"] in self.answered:
            raise RequestError(f"{at}: tool_use_id {block['tool_use_id']!r} is answered twice")
        self.results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})


def _error_type(status: int) -> str:
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
    }.get(status, "invalid_request_error" if status < 500 else "api_error")


def _error_body(service: TinkerService, error: BaseException) -> dict[str, Any]:
    """A failure in Anthropic's shape: a response's body, or a stream's error event."""
    message = service.client_message(message_of(error))
    return {"type": "error", "error": {"type": _error_type(error_status(error)), "message": message}}


def _block_start(index: int, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_start", {"type": "content_block_start", "index": index, "content_block": block}


def _block_delta(index: int, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


class AnthropicRoutes(ModelRoutes):
    """The routes' work for one base model (`generation.ModelRoutes`)."""

    def prompt(self, body: Mapping[str, Any]) -> tuple[list[int], bool]:
        """The conversation's prompt tokens: the system prompt (and the tools, when offered), then the
        messages, the assistant's turn opened; and whether tools are offered."""
        refuse_unless(body, _REFUSED_UNLESS, PARAMETERS)
        tools, offered = _tools(body)
        messages, tool_blocks = _conversation(body.get("messages"))
        if tool_blocks and not tools:
            raise RequestError("messages: a request with tool_use or tool_result blocks must define tools")
        if tool_blocks and not template_takes_tools(self.tokenizer):
            raise RequestError(
                "messages: this model's chat template does not render tool calls in a format whose calls "
                "can be read back (the Qwen / Hermes <tool_call> format); send the conversation without "
                "tool_use and tool_result blocks"
            )
        system = body.get("system")
        conversation: list[Any] = [{"role": "system", "content": system}] if system else []
        try:
            prompt = render_chat(self.tokenizer, [*conversation, *messages], tools if offered else None)
        except ValueError as error:
            raise RequestError(str(error)) from None
        return prompt, offered

    def call(self, body: Mapping[str, Any]) -> tuple[GenerationCall, bool]:
        """The request as one generation call, and whether tools are offered."""
        prompt, offered = self.prompt(body)
        if body.get("max_tokens") is None:
            raise FieldError("max_tokens: an integer >= 1 is required", param="max_tokens")
        fields = sampling_fields(
            body,
            SAMPLING_FIELDS,
            max_tokens=("max_tokens", body["max_tokens"]),
            stop_field="stop_sequences",
            ending=self.ending,
        )
        return generation_call(prompt, fields), offered

    @staticmethod
    def stop_reason(completion: Completion, stops: tuple[str, ...], called: bool) -> tuple[str, str | None]:
        if called:
            return "tool_use", None
        if completion.stop_string is not None and completion.stop_string in stops:
            return "stop_sequence", completion.stop_string
        return ("max_tokens" if completion.finish == "length" else "end_turn"), None

    @staticmethod
    def content(completion: Completion, offered: bool) -> list[dict[str, Any]]:
        """The reply's content blocks: its text, then a tool_use block per call the model made (with no
        text before the calls, no text block)."""
        reply = parse_reply(completion.text, offered, object_arguments=True)
        if not reply.tool_calls:
            return [{"type": "text", "text": reply.content}]
        text = [{"type": "text", "text": reply.content}] if reply.content else []
        return [
            *text,
            *(
                {
                    "type": "tool_use",
                    "id": f"toolu_{secrets.token_hex(12)}",
                    "name": call.name,
                    "input": json.loads(call.arguments),
                }
                for call in reply.tool_calls
            ),
        ]

    async def messages(self, body: Mapping[str, Any]) -> Response:
        stream = flag(body, "stream")
        call, offered = self.call(body)
        call = check_calls(self.engine, [call])[0]
        stops = call.stop_strings
        message_id = f"msg_{secrets.token_hex(12)}"
        weights = await self.weights.resolve(body.get("model"))
        if stream:
            try:
                events = await started(stream_generate(weights.engine, weights.pin, [call]))
            finally:
                weights.done()  # queued after the sample, which it leaves its weights
            return event_stream(
                self._events(events, message_id, str(body["model"]), call, offered, stops), done_marker=False
            )
        try:
            result = (await generate(weights.engine, weights.pin, [call]))[0]
        finally:
            weights.done()
        return JSONResponse(self.message(message_id, str(body["model"]), result, offered, stops))

    def message(
        self, message_id: str, model: str, result: Generated, offered: bool, stops: tuple[str, ...]
    ) -> dict[str, Any]:
        """The reply as a message."""
        completion = result.completions[0]
        content = self.content(completion, offered)
        reason, sequence = self.stop_reason(completion, stops, content[-1]["type"] == "tool_use")
        return {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": len(result.prompt_ids), "output_tokens": len(completion.token_ids)},
        }

    async def _events(
        self,
        events: AsyncIterator[TextDelta | SequenceDone],
        message_id: str,
        model: str,
        call: GenerationCall,
        offered: bool,
        stops: tuple[str, ...],
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """The stream's events: the message's start, its text block's deltas as the reply is sampled
        (with tools offered, its blocks once it is: the calls are parsed from the whole reply), then
        its end."""
        start = {
            "id": message_id,
            "type": "message",
            "role": "assistant",
            "model": model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": len(call.prompt_ids), "output_tokens": 0},
        }
        yield "message_start", {"type": "message_start", "message": start}
        texts: list[str] = []  # with tools offered, the text's deltas, held until the reply is parsed
        message: dict[str, Any] | None = None
        try:
            if not offered:
                yield _block_start(0, {"type": "text", "text": ""})
                yield "ping", {"type": "ping"}
            async for event in events:
                if isinstance(event, SequenceDone):
                    message = self.message(message_id, model, event.generated, offered, stops)
                elif offered:
                    texts.append(event.text)
                else:
                    yield _block_delta(0, {"type": "text_delta", "text": event.text})
            assert message is not None  # a stream ends with its sample's end
            if not offered:
                yield "content_block_stop", {"type": "content_block_stop", "index": 0}
            called = message["stop_reason"] == "tool_use"
            for index, block in enumerate(message["content"] if offered else []):
                if block["type"] == "text":
                    opened: dict[str, Any] = {"type": "text", "text": ""}
                    # the sampled text in pieces, or with calls parsed out of it, the text before them whole
                    pieces = [block["text"]] if called else texts
                    deltas = [{"type": "text_delta", "text": piece} for piece in pieces]
                else:
                    opened = {**block, "input": {}}
                    deltas = [{"type": "input_json_delta", "partial_json": json.dumps(block["input"])}]
                yield _block_start(index, opened)
                if index == 0:
                    yield "ping", {"type": "ping"}
                for delta in deltas:
                    yield _block_delta(index, delta)
                yield "content_block_stop", {"type": "content_block_stop", "index": index}
        except Exception as error:  # the stream has started: the failure is its last event
            yield "error", _error_body(self.service, error)
            return
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
                "usage": {"output_tokens": message["usage"]["output_tokens"]},
            },
        )
        yield "message_stop", {"type": "message_stop"}

    async def count_tokens(self, body: Mapping[str, Any]) -> Response:
        return JSONResponse({"input_tokens": len(self.prompt(body)[0])})


def anthropic_router(service: TinkerService, weights: ServedWeights) -> APIRouter:
    """The routes under `PREFIX`; the app mounts them with `include_router(..., prefix=PREFIX)`."""
    api = CompatRoutes(service, weights, AnthropicRoutes, _error_body)
    router = APIRouter()

    api.post(router, "/v1/messages", AnthropicRoutes.messages)
    api.post(router, "/v1/messages/count_tokens", AnthropicRoutes.count_tokens)
    api.refuse_other_paths(router, PREFIX, "/v1/messages and /v1/messages/count_tokens are served")
    return router
