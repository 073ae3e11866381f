"""The HTTP face of the Tinker service: FastAPI routes for every endpoint the `tinker` SDK calls.

Each route reads its body (at most `max_body_bytes`, after zstd), checks the API key when the server has
one, parses the body against its schema (`schemas`, or `wire` for protobuf) and hands it to
`TinkerService`. A refused request is answered with its HTTP status and `{"error", "category"}`; an
unexpected failure in a route is answered the same way with category "server" (status 400, so the SDK
reports it at once rather than retrying a deterministic failure for minutes). Results of operations
are fetched with `retrieve_future`, which long-polls; `ForwardBackwardOutput` and `SampleResponse`
results go out as protobuf when the client accepts it (every SDK since 0.18.1 does).

A request to a model's ordered endpoint (forward_backward, optim_step, save_weights,
save_weights_for_sampler, load_weights) that is refused before its seq_id is taken still takes it
(`TinkerService.refused`): the SDK counted it, and the model's next request would otherwise wait for it
forever. Query parameters are read inside the routes, after the key check, and every error a client
reads goes through `TinkerService.client_message`, which names no folder of this machine.

Checkpoint archives are downloaded as the SDK's archive endpoint has it: the endpoint answers 302 with
a URL of this server signed for 15 minutes (HMAC with a per-server secret), so the download itself
needs no API key; the file is the checkpoint folder as `workbench.export_archive` writes it. External
weights (`save_weights_external`) are downloaded the same way, file by file: `external_weights_urls`
answers a URL of this server per file, signed with the same key for the same 15 minutes.

`create_app` is the route table. A JSON endpoint that answers at once goes straight to the service (or
to `ModelListings`); the others are methods of `TinkerRoutes`, which also holds what every route goes
through: the key check and error answer (`guarded`) and the seq_id rule of ordered operations (`ordered`).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import hmac
import json
import secrets
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from email.utils import formatdate
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from workbench.server import anthropic_api, openai_api, schemas, wire
from workbench.server.errors import ENVELOPE_BYTES, BodyTooLarge, RequestError, error_body
from workbench.server.model_listings import ModelListings
from workbench.server.served_weights import ServedWeights
from workbench.server.service import SampleResult, TinkerService
from workbench.storage.archive import export_archive
from workbench.types import ForwardBackwardOutput

ARCHIVE_URL_LIFETIME_S = 900
Route = Callable[..., Awaitable[Response]]


def create_app(service: TinkerService) -> FastAPI:
    """The ASGI app serving `service`: the Tinker API's routes, then OpenAI's and Anthropic's."""
    app = FastAPI(title="workbench Tinker server", docs_url=None, redoc_url=None, openapi_url=None)
    app.exception_handler(RequestValidationError)(invalid_request)
    app.exception_handler(StarletteHTTPException)(http_error)
    listings = ModelListings(service)
    tinker = TinkerRoutes(service, listings)
    guarded, ordered = tinker.guarded, tinker.ordered
    post = functools.partial(tinker.add_json_post, app)

    # ------------------------------------------------------------------------------------------ sessions

    post("/api/v1/client/config", schemas.ClientConfigRequest, lambda _r, _b: service.client_config())
    post("/api/v1/client/dynamic_config", schemas.ClientConfigRequest, lambda _r, _b: {})
    post("/api/v1/create_session", schemas.CreateSessionRequest, lambda r, _b: service.create_session(r))
    post("/api/v1/session_heartbeat", schemas.SessionHeartbeatRequest, lambda r, _b: service.heartbeat(r))
    app.post("/api/v1/sessions/{session_id}/finish")(guarded(tinker.finish_session))
    app.post("/api/v1/telemetry")(guarded(tinker.telemetry))

    # ------------------------------------------------------------------------------------------ models and ops

    post("/api/v1/create_model", schemas.CreateModelRequest, service.create_model)
    post("/api/v1/get_info", schemas.GetInfoRequest, lambda r, _b: service.get_info(r))
    post("/api/v1/optim_step", schemas.OptimStepRequest, service.optim_step, in_order=True)
    post("/api/v1/save_weights", schemas.SaveWeightsRequest, service.save_weights, in_order=True)
    post(
        "/api/v1/save_weights_for_sampler",
        schemas.SaveWeightsForSamplerRequest,
        service.save_weights_for_sampler,
        in_order=True,
    )
    post(
        "/api/v1/save_weights_external",
        schemas.SaveWeightsExternalRequest,
        service.save_weights_external,
        in_order=True,
    )
    post("/api/v1/load_weights", schemas.LoadWeightsRequest, service.load_weights, in_order=True)
    post("/api/v1/weights_info", schemas.WeightsInfoRequest, lambda r, _b: listings.weights_info(r))
    post(
        "/api/v1/create_sampling_session",
        schemas.CreateSamplingSessionRequest,
        lambda r, _b: service.create_sampling_session(r),
    )
    post("/api/v1/asample", schemas.SampleRequestBody, service.asample)
    app.post("/api/v1/forward_backward")(guarded(ordered(tinker.forward_backward)))
    app.post("/api/v1/retrieve_future")(guarded(tinker.retrieve_future))

    # ------------------------------------------------------------------------------------------ reads

    app.get("/api/v1/healthz")(guarded(tinker.healthz))
    app.get("/api/v1/get_server_capabilities")(guarded(tinker.capabilities))
    app.get("/api/v1/samplers/{sampler_id}")(guarded(tinker.get_sampler))
    app.get("/api/v1/training_runs")(guarded(tinker.training_runs))
    app.get("/api/v1/training_runs/{training_run_id}")(guarded(tinker.training_run))
    app.get("/api/v1/training_runs/{training_run_id}/checkpoints")(guarded(tinker.checkpoints))
    app.get("/api/v1/checkpoints")(guarded(tinker.user_checkpoints))
    app.delete("/api/v1/training_runs/{training_run_id}/checkpoints/{segment}/{name}")(
        guarded(tinker.delete_checkpoint)
    )

    # ------------------------------------------------------------------------------------------ downloads

    app.get("/api/v1/training_runs/{training_run_id}/checkpoints/{segment}/{name}/archive")(
        guarded(tinker.archive_url)
    )
    app.get("/api/v1/training_runs/{training_run_id}/checkpoints/{segment}/{name}/external_weights_urls")(
        guarded(tinker.external_weights_urls)
    )
    # the signed URLs those two answer: the signature stands in for the API key
    app.get("/api/v1/archives/{model_id}/{segment}/{name}")(tinker.archive_download)
    app.get("/api/v1/external_weights/{model_id}/{name}/{file}")(tinker.external_weights_download)

    # ------------------------------------------------------------------------------------------ compatible APIs

    # OpenAI's and Anthropic's APIs on the same engine, key and port (`app.state.served_weights.release_all()`
    # lets go of the weights they keep loaded)
    app.state.served_weights = weights = ServedWeights(service, listings)
    app.include_router(openai_api.openai_router(service, weights), prefix=openai_api.PREFIX)
    app.include_router(anthropic_api.anthropic_router(service, weights), prefix=anthropic_api.PREFIX)
    return app


class TinkerJSONResponse(JSONResponse):
    """JSON as the SDK reads it (Python's `json`): a non-finite metric, such as the gradient norm of a
    step skipped for a non-finite gradient, goes out as `NaN` / `Infinity` rather than failing."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, separators=(",", ":")).encode()


def _json(body: Any, status: int = 200) -> JSONResponse:
    return TinkerJSONResponse(body, status_code=status)


def _query_int(request: Request, name: str, default: int) -> int:
    """A query parameter that is a count (limit, offset, expires): a non-negative integer, read inside
    the route, after the key check."""
    text = request.query_params.get(name)
    if text is None:
        return default
    if not text.isdigit() or len(text) > 18:
        raise RequestError(f"query parameter {name} must be a non-negative integer, got {text[:40]!r}")
    return int(text)


async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
    """Parameters FastAPI could not read. Routes read their own parameters after the key check, so this
    answers only what slips past them, and says no more than that (a key-less caller learns nothing)."""
    return _json({"error": "invalid request parameters", "category": "user"}, 400)


async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
    """Starlette's own refusals (no such route, method not allowed) in the error body every route uses."""
    return _json({"error": str(error.detail), "category": "user"}, error.status_code)


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request body, decompressed, within `max_bytes`. A body over the limit is refused with
    `BodyTooLarge`, which keeps its beginning (it names the request's model and seq_id)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BodyTooLarge(
            f"the request body ({declared} bytes) exceeds the limit of {max_bytes}", await _head_of(request)
        )
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        chunks.append(chunk)
        if size > max_bytes:
            raise BodyTooLarge(f"the request body exceeds the limit of {max_bytes} bytes", b"".join(chunks))
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding == "zstd":
        return wire.decompress(body, max_bytes)
    if encoding != "identity":
        raise RequestError(f"unsupported Content-Encoding {encoding!r} (zstd or none)", 415)
    return body


async def _head_of(request: Request) -> bytes:
    """The first `ENVELOPE_BYTES` of a body that will be refused."""
    head = b""
    async for chunk in request.stream():
        head += chunk
        if len(head) >= ENVELOPE_BYTES:
            break
    return head[:ENVELOPE_BYTES]


class TinkerRoutes:
    """The Tinker API's handlers over `service`, and the wrappers every route goes through.

    Each app has its own, with its own secret: the download links it signs are good on that app only.

    Args:
        service: The service whose endpoints the routes call.
        listings: The listings of its models and checkpoints.
    """

    def __init__(self, service: TinkerService, listings: ModelListings):
        self.service = service
        self.listings = listings
        self.config = service.config
        self._secret = secrets.token_bytes(32)

    # ------------------------------------------------------------------------------------------ wrappers

    def answer_for(self, error: BaseException) -> dict[str, str]:
        """The error body a client reads: no folder of this machine named in it."""
        body = error_body(error)
        return {**body, "error": self.service.client_message(body["error"])}

    def refusal(self, error: BaseException) -> JSONResponse:
        """The response to a refused or failed request: its status (400 for an unexpected failure)."""
        status = error.status if isinstance(error, RequestError) else 400
        return _json(self.answer_for(error), status)

    def guarded(self, route: Route) -> Route:
        """Check the API key, then run the route; a refusal or a failure becomes an error response."""

        @functools.wraps(route)
        async def run(request: Request, *args: Any, **kwargs: Any) -> Response:
            try:
                self._check_key(request)
                return await route(request, *args, **kwargs)
            except Exception as error:  # every failure is answered with its message, never a traceback
                return self.refusal(error)

        return run

    def _check_key(self, request: Request) -> None:
        """Refuse (401) a request without the server's key, compared in constant time."""
        if self.config.api_key is None:
            return
        given = request.headers.get("x-api-key", "")
        if not hmac.compare_digest(given.encode(), self.config.api_key.encode()):
            raise RequestError("missing or wrong API key (X-API-Key; TINKER_API_KEY in the SDK)", 401)

    def ordered(self, route: Callable[[Request, bytes], Awaitable[Response]]) -> Route:
        """A route of a model's ordered operations: a request refused before its seq_id was taken still
        takes it (`TinkerService.refused`), since the client counted it."""

        async def run(request: Request) -> Response:
            raw = b""
            try:
                raw = await self.body_of(request)
                return await route(request, raw)
            except Exception as error:
                self.service.refused(error.head if isinstance(error, BodyTooLarge) else raw, error)
                raise

        run.__name__ = route.__name__
        return run

    async def body_of(self, request: Request) -> bytes:
        """The request body within the server's `max_body_bytes` (`read_body`)."""
        return await read_body(request, self.config.max_body_bytes)

    def add_json_post(
        self,
        app: FastAPI,
        path: str,
        schema: type[schemas.StrictBody],
        handle: Callable[[Any, bytes], Any],
        in_order: bool = False,
    ) -> None:
        """A JSON POST endpoint whose handler answers at once (its body parsed against `schema`, the raw
        body beside it); `in_order` for a model's ordered operations."""

        async def parsed(request: Request, raw: bytes) -> Response:
            result = handle(schemas.parse_body(schema, raw), raw)
            if asyncio.iscoroutine(result):
                result = await result
            return _json(result if result is not None else {})

        async def route(request: Request) -> Response:
            return await parsed(request, await self.body_of(request))

        chosen = self.ordered(parsed) if in_order else route
        chosen.__name__ = path.rsplit("/", 1)[-1]
        app.post(path)(self.guarded(chosen))

    # ------------------------------------------------------------------------------------------ sessions and ops

    async def finish_session(self, request: Request, session_id: str) -> Response:
        body = schemas.parse_body(schemas.FinishSessionRequest, await self.body_of(request))
        await self.service.finish_session(session_id, body)
        return _json({})

    async def telemetry(self, request: Request) -> Response:
        await self.body_of(request)  # read (and size-limited), not kept
        return _json({"status": "accepted"})

    async def forward_backward(self, request: Request, raw: bytes) -> Response:
        if wire.PROTOBUF not in request.headers.get("content-type", ""):
            raise RequestError(
                "forward_backward takes a protobuf ForwardBackwardRequest (Content-Type: application/x-protobuf), "
                "as tinker SDK 0.25 and later send it",
                415,
            )
        return _json(self.service.forward_backward(wire.parse_forward_backward(raw), raw))

    async def retrieve_future(self, request: Request) -> Response:
        """An operation's result, long-polled: `try_again` while it runs; protobuf when accepted."""
        body = schemas.parse_body(schemas.RetrieveFutureRequest, await self.body_of(request))
        entry = self.service.futures.get(body.request_id)
        if entry is None:
            raise RequestError(
                f"no request {body.request_id!r} on this server (or it finished over an hour ago)", 404
            )
        if not await self.service.futures.wait(entry, self.config.long_poll_s):
            return _json({"type": "try_again", "request_id": entry.request_id, "queue_state": "active"})
        entry.retrieved_at = time.monotonic()
        if entry.error is not None:
            return _json(self.answer_for(entry.error))
        proto = wire.PROTOBUF in request.headers.get("accept", "")
        result = entry.result
        if isinstance(result, ForwardBackwardOutput):
            if proto:
                return Response(wire.forward_backward_output_proto(result), media_type=wire.PROTOBUF)
            return _json(wire.forward_backward_output_json(result))
        if isinstance(result, SampleResult):
            if proto:
                return Response(
                    wire.sample_response_proto(result.response, result.target_layout),
                    media_type=wire.PROTOBUF,
                )
            return _json(wire.sample_response_json(result.response))
        return _json(result)

    # ------------------------------------------------------------------------------------------ reads

    async def healthz(self, request: Request) -> Response:
        return _json({"status": "ok"})

    async def capabilities(self, request: Request) -> Response:
        return _json(self.service.capabilities())

    async def get_sampler(self, request: Request, sampler_id: str) -> Response:
        return _json(self.service.get_sampler(sampler_id))

    async def training_runs(self, request: Request) -> Response:
        limit, offset = _query_int(request, "limit", 20), _query_int(request, "offset", 0)
        return _json(self.listings.training_runs(limit, offset))

    async def training_run(self, request: Request, training_run_id: str) -> Response:
        return _json(self.listings.training_run(training_run_id))

    async def checkpoints(self, request: Request, training_run_id: str) -> Response:
        return _json(self.listings.checkpoints(training_run_id))

    async def user_checkpoints(self, request: Request) -> Response:
        limit, offset = _query_int(request, "limit", 100), _query_int(request, "offset", 0)
        return _json(self.listings.user_checkpoints(limit, offset))

    async def delete_checkpoint(
        self, request: Request, training_run_id: str, segment: str, name: str
    ) -> Response:
        await self.listings.delete_checkpoint(training_run_id, f"{segment}/{name}")
        return Response(status_code=204)

    # ------------------------------------------------------------------------------------------ downloads

    def _signature(self, path: str, expires: int) -> str:
        return hmac.new(self._secret, f"{path}|{expires}".encode(), hashlib.sha256).hexdigest()

    def _signed_url(self, request: Request, path: str) -> tuple[str, int]:
        expires = int(time.time()) + ARCHIVE_URL_LIFETIME_S
        return (
            f"{request.base_url}{path}?expires={expires}&signature={self._signature(path, expires)}",
            expires,
        )

    def _check_signature(self, request: Request, path: str, what: str) -> None:
        expires = _query_int(request, "expires", 0)
        given = request.query_params.get("signature", "")
        if expires < time.time() or not hmac.compare_digest(given, self._signature(path, expires)):
            raise RequestError(f"this {what} link is invalid or has expired; ask for a new one", 403)

    async def archive_url(self, request: Request, training_run_id: str, segment: str, name: str) -> Response:
        """The SDK's archive endpoint: 302 to a signed URL of this server for the checkpoint's archive."""
        address = self.listings.checkpoint_address(training_run_id, f"{segment}/{name}")
        self.listings.checkpoint_folder(address)
        url, expires = self._signed_url(
            request, f"api/v1/archives/{address.model_id}/{segment}/{address.name}"
        )
        return Response(
            status_code=302, headers={"Location": url, "Expires": formatdate(expires, usegmt=True)}
        )

    async def external_weights_urls(
        self, request: Request, training_run_id: str, segment: str, name: str
    ) -> Response:
        """A signed URL of this server for each file of an external weights checkpoint."""
        address = self.listings.checkpoint_address(training_run_id, f"{segment}/{name}")
        _, files = self.listings.external_files(address)
        urls: dict[str, str] = {}
        expires = 0
        for file in files:
            urls[file], expires = self._signed_url(
                request, f"api/v1/external_weights/{address.model_id}/{address.name}/{file}"
            )
        expires = expires or int(time.time()) + ARCHIVE_URL_LIFETIME_S
        return _json({"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()})

    async def archive_download(self, request: Request, model_id: str, segment: str, name: str) -> Response:
        """A checkpoint's archive, at the URL `archive_url` signed; made in a scratch folder that goes
        once the file is sent."""
        try:
            self._check_signature(request, f"api/v1/archives/{model_id}/{segment}/{name}", "archive")
            address = self.listings.checkpoint_address(model_id, f"{segment}/{name}")
            folder = self.listings.checkpoint_folder(address)
            scratch = Path(tempfile.mkdtemp(prefix="workbench-archive-"))
            tar_path = await asyncio.to_thread(export_archive, folder, scratch / f"{address.name}.tar")
        except Exception as error:
            return self.refusal(error)
        return FileResponse(
            tar_path,
            media_type="application/x-tar",
            filename=tar_path.name,
            background=BackgroundTask(shutil.rmtree, scratch, True),
        )

    async def external_weights_download(
        self, request: Request, model_id: str, name: str, file: str
    ) -> Response:
        """A file of an external weights checkpoint, at the URL `external_weights_urls` signed."""
        try:
            self._check_signature(request, f"api/v1/external_weights/{model_id}/{name}/{file}", "download")
            address = self.listings.checkpoint_address(model_id, f"external_weights/{name}")
            folder, files = self.listings.external_files(address)
            if file not in files:
                raise RequestError(f"{address.tinker_path} has no file {file!r}", 404)
        except Exception as error:
            return self.refusal(error)
        return FileResponse(folder / file, media_type="application/octet-stream", filename=file)
