"""Anthropic's Messages API on the Tinker server: `/v1/messages` and `/v1/messages/count_tokens` under
`/anthropic/api`.

As hosted Tinker serves it, so the unmodified `anthropic` client and the agent frameworks built on it use
a policy while it trains: `anthropic.Anthropic(base_url=f"{srv.url}/anthropic/api", api_key=<key>)`. The
conversation is rendered with the model's chat template like an OpenAI chat (`chat_format`), the `model`
names the weights (`served_weights`) and the request runs through the engine's ordered sample path
(`generation`).

Every field is supported, ignored or refused (`PARAMETERS`); a refusal comes in Anthropic's shape,
`{"type": "error", "error": {"type", "message"}}`, with status 400, 401, 404 or 413, before anything is
queued. The `anthropic` client (2.x) has no arguments for `temperature`, `top_p` and `top_k`; they go in
`extra_body={"temperature": 0}`, as the Messages API reads them. Streams (`stream: true`) send Anthropic's events (message_start, content_block_start, ping,
content_block_delta, content_block_stop, message_delta, message_stop) once the reply is sampled.
"""

from __future__ import annotations

import secrets
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from workbench.engine.local.engine import Engine
from workbench.server.chat_format import end_of_turn_ids, render_chat
from workbench.server.compat_http import error_status, event_stream, guarded, json_body
from workbench.server.errors import RequestError, message_of
from workbench.server.generation import (
    Completion,
    GenerationCall,
    check_calls,
    check_stop_strings,
    generate,
    text_deltas,
    token_text,
)
from workbench.server.served_weights import ServedWeights
from workbench.server.service import TinkerService

PREFIX = "/anthropic/api"

PARAMETERS: dict[str, str] = {
    "model": "supported: a base model, a tinker:// checkpoint path, '<base>;<path>' or a model id",
    "messages": "supported: user / assistant messages, content a string or text blocks",
    "system": "supported: a string or text blocks",
    "max_tokens": "supported (required, >= 1)",
    "temperature": "supported: 0 (greedy) or at least 1e-3",
    "top_p": "supported",
    "top_k": "supported",
    "stop_sequences": "supported: up to 16",
    "stream": "supported (sent once the reply is sampled)",
    "metadata": "ignored",
    "service_tier": "ignored",
    "cache_control": "ignored",
    "diagnostics": "ignored",
    "inference_geo": "ignored",
    "speed": "ignored",
    "user_profile_id": "ignored",
    "workspace_id": "ignored",
    "output_config": "refused unless empty",
    "tools": "refused",
    "tool_choice": "refused",
    "thinking": "refused unless disabled",
    "container": "refused",
    "mcp_servers": "refused",
}
"""Each request field, and what this server does with it; a field not listed here is ignored."""

_REFUSED_UNLESS: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None,),
    "thinking": (None, {"type": "disabled"}),
    "container": (None,),
    "mcp_servers": (None, []),
    "output_config": (None, {}),
}


def _error_type(status: int) -> str:
    return {
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        413: "request_too_large",
    }.get(status, "invalid_request_error" if status < 500 else "api_error")


class AnthropicRoutes:
    """The routes' work for the requests that name weights of one base model (its tokenizer renders and
    reads them), over the Tinker service and the weights it serves."""

    def __init__(self, service: TinkerService, weights: ServedWeights, engine: Engine):
        self.service = service
        self.weights = weights
        self.engine = engine  # the base model's whose weights the requests name
        self.tokenizer = engine.tokenizer
        self.end_of_turn = end_of_turn_ids(self.tokenizer)

    def prompt(self, body: Mapping[str, Any]) -> list[int]:
        """The conversation's prompt tokens: the system prompt, then the messages, the assistant's turn
        opened."""
        for name, allowed in _REFUSED_UNLESS.items():
            if name in body and body[name] not in allowed:
                raise RequestError(f"{name}: {PARAMETERS[name]} on this server")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError("messages must be a non-empty list of {'role', 'content'} objects")
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or message.get("role") not in ("user", "assistant"):
                raise RequestError(f"messages[{index}].role must be 'user' or 'assistant'")
        system = body.get("system")
        conversation: list[Any] = [{"role": "system", "content": system}] if system else []
        try:
            return render_chat(self.tokenizer, [*conversation, *messages])
        except ValueError as error:
            raise RequestError(str(error)) from None

    def call(self, body: Mapping[str, Any]) -> GenerationCall:
        prompt = self.prompt(body)
        max_tokens = body.get("max_tokens")
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise RequestError(f"max_tokens: an integer >= 1 is required, got {max_tokens!r}")
        numbers = {}
        for name, default in (("temperature", 1.0), ("top_p", 1.0)):
            value = body.get(name, default)
            if value is None:
                value = default
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise RequestError(f"{name} must be a number, got {value!r}")
            numbers[name] = float(value)
        if not (numbers["temperature"] == 0 or 1e-3 <= numbers["temperature"] <= 100):
            raise RequestError(
                f"temperature must be 0 (greedy) or in [0.001, 100], got {numbers['temperature']!r}"
            )
        if not 0 < numbers["top_p"] <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {numbers['top_p']!r}")
        top_k = body.get("top_k")
        if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
            raise RequestError(f"top_k must be an integer >= 1, got {top_k!r}")
        try:
            stops = check_stop_strings(body.get("stop_sequences"), "stop_sequences")
        except ValueError as error:
            raise RequestError(str(error)) from None
        extra = tuple(
            token_text(self.tokenizer, t)
            for t in sorted(self.end_of_turn)
            if t != self.tokenizer.eos_token_id
        )
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise RequestError(f"stream must be true or false, got {stream!r}")
        return GenerationCall(
            prompt_ids=prompt,
            max_tokens=max_tokens,
            temperature=numbers["temperature"],
            top_p=numbers["top_p"],
            top_k=-1 if top_k is None else top_k,
            stop_strings=(*stops, *extra) if stops else (),
            stop_ids=self.end_of_turn,
        )

    @staticmethod
    def stop_reason(completion: Completion, stops: tuple[str, ...]) -> tuple[str, str | None]:
        if completion.stop_string is not None and completion.stop_string in stops:
            return "stop_sequence", completion.stop_string
        return ("max_tokens" if completion.finish == "length" else "end_turn"), None

    async def messages(self, body: Mapping[str, Any]) -> Response:
        call = self.call(body)
        try:
            check_calls(self.engine, [call])
        except ValueError as error:
            raise RequestError(str(error)) from None
        weights = await self.weights.resolve(body.get("model"))
        try:
            result = (await generate(weights.engine, weights.pin, [call]))[0]
        finally:
            weights.done()
        completion = result.completions[0]
        stops = check_stop_strings(body.get("stop_sequences"), "stop_sequences")
        reason, sequence = self.stop_reason(completion, stops)
        message = {
            "id": f"msg_{secrets.token_hex(12)}",
            "type": "message",
            "role": "assistant",
            "model": str(body["model"]),
            "content": [{"type": "text", "text": completion.text}],
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": {"input_tokens": len(result.prompt_ids), "output_tokens": len(completion.token_ids)},
        }
        if body.get("stream"):
            return event_stream(self._events(message, completion), done_marker=False)
        return JSONResponse(message)

    def _events(
        self, message: dict[str, Any], completion: Completion
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        usage = message["usage"]
        start = {**message, "content": [], "stop_reason": None, "stop_sequence": None}
        start["usage"] = {"input_tokens": usage["input_tokens"], "output_tokens": 0}
        yield "message_start", {"type": "message_start", "message": start}
        yield (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        )
        yield "ping", {"type": "ping"}
        for piece in text_deltas(self.tokenizer, completion):
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": 0,
                    "delta": {"type": "text_delta", "text": piece},
                },
            )
        yield "content_block_stop", {"type": "content_block_stop", "index": 0}
        yield (
            "message_delta",
            {
                "type": "message_delta",
                "delta": {"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
                "usage": {"output_tokens": usage["output_tokens"]},
            },
        )
        yield "message_stop", {"type": "message_stop"}

    async def count_tokens(self, body: Mapping[str, Any]) -> Response:
        return JSONResponse({"input_tokens": len(self.prompt(body))})


def anthropic_router(service: TinkerService, weights: ServedWeights) -> APIRouter:
    """The routes under `PREFIX`; the app mounts them with `include_router(..., prefix=PREFIX)`."""
    routes: weakref.WeakKeyDictionary[Engine, AnthropicRoutes] = weakref.WeakKeyDictionary()
    router = APIRouter()

    async def for_the_model(request: Request) -> tuple[AnthropicRoutes, dict[str, Any]]:
        """The request's body, and the routes of the base model its `model` names."""
        body = await json_body(request, service.config)
        engine = (await weights.identify(body.get("model"))).engine
        if engine not in routes:
            routes[engine] = AnthropicRoutes(service, weights, engine)
        return routes[engine], body

    async def messages_of_the_model(request: Request) -> Response:
        model_routes, body = await for_the_model(request)
        return await model_routes.messages(body)

    async def count_tokens_of_the_model(request: Request) -> Response:
        model_routes, body = await for_the_model(request)
        return await model_routes.count_tokens(body)

    def answer(error: BaseException) -> JSONResponse:
        status = error_status(error)
        message = service.client_message(message_of(error))
        return JSONResponse(
            {"type": "error", "error": {"type": _error_type(status), "message": message}}, status_code=status
        )

    async def answered(request: Request, work: Callable[[Request], Awaitable[Response]]) -> Response:
        return await guarded(request, service.config, work, answer)

    @router.post("/v1/messages")
    async def messages(request: Request) -> Response:
        return await answered(request, messages_of_the_model)

    @router.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        return await answered(request, count_tokens_of_the_model)

    @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def unknown(request: Request, path: str) -> Response:
        async def missing(_: Request) -> Response:
            raise RequestError(
                f"no endpoint {request.method} {PREFIX}/{path} here: /v1/messages and /v1/messages/count_tokens are served",
                404,
            )

        return await answered(request, missing)

    return router
