"""What the OpenAI- and Anthropic-compatible routes share over HTTP: the key, the body, a failure's status,
the event stream.

The key is the Tinker API's: a server started with one takes it from OpenAI clients as
`Authorization: Bearer <key>` and from Anthropic clients (and Tinker's) as `X-API-Key`. A body is read
within the server's `max_body_bytes` and must be a JSON object; each API answers a refusal in its own
error shape (`openai_api`, `anthropic_api`). Streams are server-sent events through Starlette's own
`StreamingResponse`, answered once their first event is in (`started`), so that a request that fails
before any token is answered in its API's error shape with a status, like an unstreamed one; a failure
after that comes as the API's error event.

`CompatRoutes` is what both routers share: a request's body and the routes of the base model its
`model` names (one per base model: its tokenizer renders and reads the requests), every failure answered
in the API's shape, and the catch-all 404 for a path the API does not serve.
"""

from __future__ import annotations

import hmac
import json
import weakref
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from workbench.server.config import ServerConfig
from workbench.server.errors import RequestError
from workbench.server.sampling_fields import FieldError

if TYPE_CHECKING:
    from workbench.engine.local.engine import Engine
    from workbench.server.served_weights import ServedWeights
    from workbench.server.service import TinkerService

T = TypeVar("T")
RoutesT = TypeVar("RoutesT")


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


class CompatRoutes(Generic[RoutesT]):
    """A compatible API's routes of each base model (`make(service, weights, engine)`), and its
    failures answered by `error_body` in the API's shape."""

    def __init__(
        self,
        service: TinkerService,
        weights: ServedWeights,
        make: Callable[[TinkerService, ServedWeights, Engine], RoutesT],
        error_body: Callable[[TinkerService, BaseException], dict[str, Any]],
    ):
        self.service = service
        self.weights = weights
        self.make = make
        self.error_body = error_body
        self.routes: weakref.WeakKeyDictionary[Engine, RoutesT] = weakref.WeakKeyDictionary()

    async def answered(self, request: Request, work: Callable[[Request], Awaitable[Response]]) -> Response:
        return await guarded(request, self.service.config, work, self.answer)

    def answer(self, error: BaseException) -> JSONResponse:
        return JSONResponse(self.error_body(self.service, error), status_code=error_status(error))

    async def on_the_model(
        self, request: Request, work: Callable[[RoutesT, dict[str, Any]], Awaitable[Response]]
    ) -> Response:
        """`work(routes, body)` with the routes of the base model the body's `model` names."""

        async def run(request: Request) -> Response:
            body = await json_body(request, self.service.config)
            try:
                engine = (await self.weights.identify(body.get("model"))).engine
            except RequestError as error:
                raise FieldError(error.message, error.status, "model") from None
            if engine not in self.routes:
                self.routes[engine] = self.make(self.service, self.weights, engine)
            return await work(self.routes[engine], body)

        return await self.answered(request, run)

    def post(
        self, router: APIRouter, path: str, work: Callable[[RoutesT, dict[str, Any]], Awaitable[Response]]
    ) -> None:
        """A POST route at `path` that runs `work(routes, body)` on the model's routes (`on_the_model`)."""

        async def route(request: Request) -> Response:
            return await self.on_the_model(request, work)

        router.add_api_route(path, route, methods=["POST"])

    def refuse_other_paths(self, router: APIRouter, prefix: str, served: str) -> None:
        """A 404 naming what is `served` for every other path under `prefix`."""

        @router.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
        async def unknown(request: Request, path: str) -> Response:
            async def missing(_: Request) -> Response:
                raise RequestError(f"no endpoint {request.method} {prefix}/{path} here: {served}", 404)

            return await self.answered(request, missing)
