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
from workbench.server.served_weights import ServedWeights
from workbench.server.service import SampleResult, TinkerService
from workbench.storage.archive import export_archive
from workbench.types import ForwardBackwardOutput

ARCHIVE_URL_LIFETIME_S = 900
Route = Callable[..., Awaitable[Response]]


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


def create_app(service: TinkerService) -> FastAPI:
    """The ASGI app serving `service`."""
    config = service.config
    secret = secrets.token_bytes(32)
    app = FastAPI(title="workbench Tinker server", docs_url=None, redoc_url=None, openapi_url=None)

    def answer_for(error: BaseException) -> dict[str, str]:
        body = error_body(error)
        return {**body, "error": service.client_message(body["error"])}

    def _refusal(error: BaseException) -> JSONResponse:
        status = error.status if isinstance(error, RequestError) else 400
        return _json(answer_for(error), status)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_: Request, error: RequestValidationError) -> JSONResponse:
        # routes read their own parameters after the key check; this answers whatever slips past
        return _json({"error": "invalid request parameters", "category": "user"}, 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, error: StarletteHTTPException) -> JSONResponse:
        return _json({"error": str(error.detail), "category": "user"}, error.status_code)

    def guarded(route: Route) -> Route:
        """Check the API key, then run the route; a refusal or a failure becomes an error response."""

        @functools.wraps(route)
        async def run(request: Request, *args: Any, **kwargs: Any) -> Response:
            try:
                if config.api_key is not None:
                    given = request.headers.get("x-api-key", "")
                    if not hmac.compare_digest(given.encode(), config.api_key.encode()):
                        raise RequestError(
                            "missing or wrong API key (X-API-Key; TINKER_API_KEY in the SDK)", 401
                        )
                return await route(request, *args, **kwargs)
            except Exception as error:  # every failure is answered with its message, never a traceback
                return _refusal(error)

        return run

    async def body_of(request: Request) -> bytes:
        """The request body, decompressed, within the size limit. A body over the limit is refused with
        `BodyTooLarge`, which keeps its beginning (it names the request's model and seq_id)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > config.max_body_bytes:
            raise BodyTooLarge(
                f"the request body ({declared} bytes) exceeds the limit of {config.max_body_bytes}",
                await head_of(request),
            )
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            chunks.append(chunk)
            if size > config.max_body_bytes:
                raise BodyTooLarge(
                    f"the request body exceeds the limit of {config.max_body_bytes} bytes",
                    b"".join(chunks),
                )
        body = b"".join(chunks)
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding == "zstd":
            return wire.decompress(body, config.max_body_bytes)
        if encoding != "identity":
            raise RequestError(f"unsupported Content-Encoding {encoding!r} (zstd or none)", 415)
        return body

    async def head_of(request: Request) -> bytes:
        """The first `ENVELOPE_BYTES` of a body that will be refused."""
        head = b""
        async for chunk in request.stream():
            head += chunk
            if len(head) >= ENVELOPE_BYTES:
                break
        return head[:ENVELOPE_BYTES]

    def ordered(route: Callable[[Request, bytes], Awaitable[Response]]) -> Route:
        """A route of a model's ordered operations: a request refused before its seq_id was taken still
        takes it (`TinkerService.refused`), since the client counted it."""

        async def run(request: Request) -> Response:
            raw = b""
            try:
                raw = await body_of(request)
                return await route(request, raw)
            except Exception as error:
                service.refused(error.head if isinstance(error, BodyTooLarge) else raw, error)
                raise

        run.__name__ = route.__name__
        return run

    def post(
        path: str,
        schema: type[schemas.StrictBody],
        handle: Callable[[Any, bytes], Any],
        in_order: bool = False,
    ) -> None:
        """A JSON POST endpoint whose handler answers at once; `in_order` for a model's ordered ops."""

        async def parsed(request: Request, raw: bytes) -> Response:
            result = handle(schemas.parse_body(schema, raw), raw)
            if asyncio.iscoroutine(result):
                result = await result
            return _json(result if result is not None else {})

        async def route(request: Request) -> Response:
            return await parsed(request, await body_of(request))

        chosen = ordered(parsed) if in_order else route
        chosen.__name__ = path.rsplit("/", 1)[-1]
        app.post(path)(guarded(chosen))

    # ------------------------------------------------------------------------------------------ sessions

    post("/api/v1/client/config", schemas.ClientConfigRequest, lambda _r, _b: service.client_config())
    post("/api/v1/client/dynamic_config", schemas.ClientConfigRequest, lambda _r, _b: {})
    post("/api/v1/create_session", schemas.CreateSessionRequest, lambda r, _b: service.create_session(r))
    post("/api/v1/session_heartbeat", schemas.SessionHeartbeatRequest, lambda r, _b: service.heartbeat(r))

    @app.post("/api/v1/sessions/{session_id}/finish")
    @guarded
    async def finish_session(request: Request, session_id: str) -> Response:
        body = schemas.parse_body(schemas.FinishSessionRequest, await body_of(request))
        await service.finish_session(session_id, body)
        return _json({})

    @app.post("/api/v1/telemetry")
    @guarded
    async def telemetry(request: Request) -> Response:
        await body_of(request)  # read (and size-limited), not kept
        return _json({"status": "accepted"})

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
    post("/api/v1/weights_info", schemas.WeightsInfoRequest, lambda r, _b: service.weights_info(r))
    post(
        "/api/v1/create_sampling_session",
        schemas.CreateSamplingSessionRequest,
        lambda r, _b: service.create_sampling_session(r),
    )
    post("/api/v1/asample", schemas.SampleRequest, service.asample)

    @app.post("/api/v1/forward_backward")
    @guarded
    @ordered
    async def forward_backward(request: Request, raw: bytes) -> Response:
        if wire.PROTOBUF not in request.headers.get("content-type", ""):
            raise RequestError(
                "forward_backward takes a protobuf ForwardBackwardRequest (Content-Type: application/x-protobuf), "
                "as tinker SDK 0.25 and later send it",
                415,
            )
        return _json(service.forward_backward(wire.parse_forward_backward(raw), raw))

    @app.post("/api/v1/retrieve_future")
    @guarded
    async def retrieve_future(request: Request) -> Response:
        body = schemas.parse_body(schemas.RetrieveFutureRequest, await body_of(request))
        entry = service.futures.get(body.request_id)
        if entry is None:
            raise RequestError(
                f"no request {body.request_id!r} on this server (or it finished over an hour ago)", 404
            )
        if not await service.futures.wait(entry, config.long_poll_s):
            return _json({"type": "try_again", "request_id": entry.request_id, "queue_state": "active"})
        entry.retrieved_at = time.monotonic()
        if entry.error is not None:
            return _json(answer_for(entry.error))
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

    @app.get("/api/v1/healthz")
    @guarded
    async def healthz(request: Request) -> Response:
        return _json({"status": "ok"})

    @app.get("/api/v1/get_server_capabilities")
    @guarded
    async def capabilities(request: Request) -> Response:
        return _json(service.capabilities())

    @app.get("/api/v1/samplers/{sampler_id}")
    @guarded
    async def get_sampler(request: Request, sampler_id: str) -> Response:
        return _json(service.get_sampler(sampler_id))

    @app.get("/api/v1/training_runs")
    @guarded
    async def training_runs(request: Request) -> Response:
        limit, offset = _query_int(request, "limit", 20), _query_int(request, "offset", 0)
        return _json(service.training_runs(limit, offset))

    @app.get("/api/v1/training_runs/{run_id}")
    @guarded
    async def training_run(request: Request, run_id: str) -> Response:
        return _json(service.training_run(run_id))

    @app.get("/api/v1/training_runs/{run_id}/checkpoints")
    @guarded
    async def checkpoints(request: Request, run_id: str) -> Response:
        return _json(service.checkpoints(run_id))

    @app.get("/api/v1/checkpoints")
    @guarded
    async def user_checkpoints(request: Request) -> Response:
        limit, offset = _query_int(request, "limit", 100), _query_int(request, "offset", 0)
        return _json(service.user_checkpoints(limit, offset))

    @app.delete("/api/v1/training_runs/{run_id}/checkpoints/{segment}/{name}")
    @guarded
    async def delete_checkpoint(request: Request, run_id: str, segment: str, name: str) -> Response:
        await service.delete_checkpoint(run_id, f"{segment}/{name}")
        return Response(status_code=204)

    # ------------------------------------------------------------------------------------------ archives

    def signature(path: str, expires: int) -> str:
        return hmac.new(secret, f"{path}|{expires}".encode(), hashlib.sha256).hexdigest()

    @app.get("/api/v1/training_runs/{run_id}/checkpoints/{segment}/{name}/archive")
    @guarded
    async def archive_url(request: Request, run_id: str, segment: str, name: str) -> Response:
        address = service.checkpoint_address(run_id, f"{segment}/{name}")
        service.checkpoint_folder(address)
        expires = int(time.time()) + ARCHIVE_URL_LIFETIME_S
        path = f"api/v1/archives/{address.run_id}/{segment}/{address.name}"
        url = f"{request.base_url}{path}?expires={expires}&signature={signature(path, expires)}"
        return Response(
            status_code=302, headers={"Location": url, "Expires": formatdate(expires, usegmt=True)}
        )

    def signed_url(request: Request, path: str) -> tuple[str, int]:
        expires = int(time.time()) + ARCHIVE_URL_LIFETIME_S
        return f"{request.base_url}{path}?expires={expires}&signature={signature(path, expires)}", expires

    def check_signature(request: Request, path: str) -> None:
        expires = _query_int(request, "expires", 0)
        given = request.query_params.get("signature", "")
        if expires < time.time() or not hmac.compare_digest(given, signature(path, expires)):
            raise RequestError("this download link is invalid or has expired; ask for a new one", 403)

    @app.get("/api/v1/training_runs/{run_id}/checkpoints/{segment}/{name}/external_weights_urls")
    @guarded
    async def external_weights_urls(request: Request, run_id: str, segment: str, name: str) -> Response:
        address = service.checkpoint_address(run_id, f"{segment}/{name}")
        _, files = service.external_files(address)
        urls: dict[str, str] = {}
        expires = 0
        for file in files:
            urls[file], expires = signed_url(
                request, f"api/v1/external_weights/{address.run_id}/{address.name}/{file}"
            )
        expires = expires or int(time.time()) + ARCHIVE_URL_LIFETIME_S
        return _json({"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()})

    @app.get("/api/v1/external_weights/{run_id}/{name}/{file}")
    async def external_weights_download(request: Request, run_id: str, name: str, file: str) -> Response:
        try:
            check_signature(request, f"api/v1/external_weights/{run_id}/{name}/{file}")
            address = service.checkpoint_address(run_id, f"external_weights/{name}")
            folder, files = service.external_files(address)
            if file not in files:
                raise RequestError(f"{address.tinker_path} has no file {file!r}", 404)
        except Exception as error:
            return _refusal(error)
        return FileResponse(folder / file, media_type="application/octet-stream", filename=file)

    @app.get("/api/v1/archives/{run_id}/{segment}/{name}")
    async def archive_download(request: Request, run_id: str, segment: str, name: str) -> Response:
        try:
            expires = _query_int(request, "expires", 0)
            path = f"api/v1/archives/{run_id}/{segment}/{name}"
            given = request.query_params.get("signature", "")
            if expires < time.time() or not hmac.compare_digest(given, signature(path, expires)):
                raise RequestError("this archive link is invalid or has expired; ask for a new one", 403)
            address = service.checkpoint_address(run_id, f"{segment}/{name}")
            folder = service.checkpoint_folder(address)
            scratch = Path(tempfile.mkdtemp(prefix="workbench-archive-"))
            tar_path = await asyncio.to_thread(export_archive, folder, scratch / f"{address.name}.tar")
        except Exception as error:
            return _refusal(error)
        return FileResponse(
            tar_path,
            media_type="application/x-tar",
            filename=tar_path.name,
            background=BackgroundTask(shutil.rmtree, scratch, True),
        )

    # ------------------------------------------------------------------------------------------ compatible APIs

    # OpenAI's and Anthropic's APIs on the same engine, key and port (`app.state.served_weights.release_all()`
    # lets go of the weights they keep loaded)
    app.state.served_weights = weights = ServedWeights(service)
    app.include_router(openai_api.openai_router(service, weights), prefix=openai_api.PREFIX)
    app.include_router(anthropic_api.anthropic_router(service, weights), prefix=anthropic_api.PREFIX)
    return app
