"""What the OpenAI- and Anthropic-compatible routes share over HTTP: the key, the body, a failure's status,
the event stream.

The key is the Tinker API's: a server started with one takes it from OpenAI clients as
`Authorization: Bearer <key>` and from Anthropic clients (and Tinker's) as `X-API-Key`. A body is read
within the server's `max_body_bytes` and must be a JSON object; each API answers a refusal in its own
error shape (`openai_api`, `anthropic_api`). Streams are server-sent events through Starlette's own
`StreamingResponse`, answered once their first event is in (`started`), so that a request that fails
before any token is answered in its API's error shape with a status, like an unstreamed one; a failure
after that comes as the API's error event.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from workbench.server.config import ServerConfig
from workbench.server.errors import RequestError

T = TypeVar("T")


def check_key(request: Request, config: ServerConfig) -> None:
    """Refuse (401) a request without the server's key, when it has one."""
    if config.api_key is None:
        return
    bearer = request.headers.get("authorization", "")
    given = bearer[len("Bearer ") :] if bearer.startswith("Bearer ") else request.headers.get("x-api-key", "")
    if not hmac.compare_digest(given.encode(), config.api_key.encode()):
        raise RequestError(
            "missing or wrong API key: send the server's key as 'Authorization: Bearer <key>' "
            "(the openai client's api_key) or 'X-API-Key' (the anthropic client's)",
            401,
        )


async def json_body(request: Request, config: ServerConfig) -> dict[str, Any]:
    """The request's JSON object, read within the size limit."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
        raise RequestError(
            f"the request body ({declared} bytes) exceeds the limit of {config.max_body_bytes}", 413
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > config.max_body_bytes:
            raise RequestError(f"the request body exceeds the limit of {config.max_body_bytes} bytes", 413)
        chunks.append(chunk)
    try:
        body = json.loads(b"".join(chunks))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def error_status(error: BaseException) -> int:
    """The HTTP status a failure is answered with: a `RequestError`'s own; a bad value, type or missing
    field in what the client sent is the client's (400); anything else the server's (500)."""
    if isinstance(error, RequestError):
        return error.status
    return 400 if isinstance(error, (ValueError, TypeError, KeyError)) else 500


async def guarded(
    request: Request,
    config: ServerConfig,
    work: Callable[[Request], Awaitable[Response]],
    answer: Callable[[BaseException], JSONResponse],
) -> Response:
    """`work(request)` once the key checks out; every failure answered by `answer`, in the API's own
    error shape, never as a traceback."""
    try:
        check_key(request, config)
        return await work(request)
    except Exception as error:  # answered in the API's shape
        return answer(error)


async def started(events: AsyncIterator[T]) -> AsyncIterator[T]:
    """`events` once its first item is in: what fails before it raises here, where the route still
    answers with a status."""
    first = await anext(events)

    async def from_the_first() -> AsyncIterator[T]:
        yield first
        async for event in events:
            yield event

    return from_the_first()


def event_stream(events: AsyncIterable[tuple[str | None, Any]], done_marker: bool) -> StreamingResponse:
    """Server-sent events: each `(event name or None, JSON data)`, then OpenAI's `data: [DONE]` when
    `done_marker`."""

    async def lines() -> AsyncIterator[bytes]:
        async for name, data in events:
            head = f"event: {name}\n" if name is not None else ""
            yield f"{head}data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n".encode()
        if done_marker:
            yield b"data: [DONE]\n\n"

    return StreamingResponse(
        lines(),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )
