"""The sampling exchange with services that speak the older protocol: sequence ids made up locally.

Since SDK 0.38 the Tinker protocol fixes each sampled sequence's identity when the sample is
submitted: the `asample` future carries `sample_sequence_ids`, one per sample, and the SDK stamps them
onto the returned sequences (and asserts that they are there). Services built for older SDKs (SkyRL's
pins `tinker>=0.25,<0.26`) finish the sample but send no ids, so SDK 0.38 fails after the work is done.

`SequenceIdRelay` sits between the SDK and such a service, on a local port: it passes every request
and response through unchanged, except an `asample` answer without `sample_sequence_ids`, to which it
adds `num_samples` ids made up here. Each made-up id starts with `MADE_UP_ID_PREFIX`, so training data
and provenance can tell them from ids a service issued (the service has never seen them). Neither the
SDK nor its version changes; only the HTTP exchange is adapted.
"""

from __future__ import annotations

import contextlib
import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx

MADE_UP_ID_PREFIX = "client-made:"
"""Starts every sequence id made up here rather than issued by the service."""

SAMPLE_PATH = "/api/v1/asample"

_NOT_RELAYED_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "content-encoding"}


def made_up_sequence_ids(num_samples: int) -> list[str]:
    """`client-made:<random>:<i>` for each sample: unique per request, marked as not the service's."""
    request = secrets.token_hex(6)
    return [f"{MADE_UP_ID_PREFIX}{request}:{i}" for i in range(num_samples)]


def with_sequence_ids(request_body: bytes, response_body: bytes) -> bytes:
    """The `asample` answer, with made-up `sample_sequence_ids` when the service sent none."""
    try:
        future, request = json.loads(response_body), json.loads(request_body)
    except ValueError:
        return response_body
    if not isinstance(future, dict) or future.get("sample_sequence_ids") is not None:
        return response_body
    future["sample_sequence_ids"] = made_up_sequence_ids(int(request.get("num_samples", 1)))
    return json.dumps(future).encode()


class SequenceIdRelay:
    """A local HTTP relay to `upstream` that adds sequence ids to `asample` answers lacking them.

    `url` is what the SDK is given instead of the service's URL. `close()` stops it.
    """

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self._client = httpx.Client(base_url=self.upstream, timeout=None)
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _relay(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_RELAYED_HEADERS}
                try:
                    answer = relay._client.request(self.command, self.path, content=body, headers=headers)
                except httpx.HTTPError as error:
                    self.send_error(502, f"the service at {relay.upstream} did not answer: {error}")
                    return
                content = answer.content
                if self.path.split("?")[0] == SAMPLE_PATH and answer.status_code == 200:
                    content = with_sequence_ids(body, content)
                with contextlib.suppress(ConnectionError):  # the SDK gave up waiting: nobody to answer
                    self.send_response(answer.status_code)
                    for key, value in answer.headers.items():
                        if key.lower() not in _NOT_RELAYED_HEADERS:
                            self.send_header(key, value)
                    self.send_header("Content-Length", str(len(content)))
                    self.end_headers()
                    self.wfile.write(content)

            do_GET = do_POST = do_PUT = do_DELETE = do_PATCH = _relay

            def log_message(self, format: str, *args: object) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="workbench-relay", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()
