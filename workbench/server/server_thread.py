"""The thread that owns the server's event loop: uvicorn serving the app, beside the kernel's own loop.

The server never runs on the caller's event loop. In Jupyter that loop is the kernel's, and a cell that
calls an SDK method's `.result()` blocks it until the HTTP round trip completes: a server on that loop
could never answer. Here the server gets its own thread and loop, binds its socket before the thread
starts (so `url` is known at once, with the port the OS chose for port 0), and a background task on the
same loop expires sessions that stopped heartbeating and drops old results.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading

import uvicorn

from workbench.engine.local.base_models import BaseModels
from workbench.engine.local.engine import Engine
from workbench.server.app import create_app
from workbench.server.config import ServerConfig
from workbench.server.service import TinkerService

START_TIMEOUT_S = 30.0


class TinkerServer:
    """The Tinker REST protocol served for an engine, on a background thread.

    Args:
        base_models: The base models served (each on its engine; the first is the serving session's),
            or one engine alone.
        config: Where to listen, the API key, the limits, the base models loaded on first use.
    """

    def __init__(self, base_models: BaseModels | Engine, config: ServerConfig | None = None):
        self.config = config or ServerConfig()
        family = socket.AF_INET6 if ":" in self.config.host else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((self.config.host, self.config.port))
        self._socket.listen(128)
        self._loop = asyncio.new_event_loop()
        if isinstance(base_models, Engine):
            base_models = BaseModels(base_models)
        self.service = TinkerService(base_models, self.config, self._loop)
        self._app = create_app(self.service)
        uvicorn_config = uvicorn.Config(
            self._app,
            log_level="warning",
            access_log=False,
            lifespan="off",
            timeout_keep_alive=75,
            timeout_graceful_shutdown=1,  # a long-poll in progress does not hold up stop()
        )
        self._server = uvicorn.Server(uvicorn_config)
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name="workbench-server", daemon=True)
        self._thread.start()
        if not self._started.wait(START_TIMEOUT_S) or not self._server.started:
            self.stop()
            raise RuntimeError("the Tinker server did not start")

    @property
    def host(self) -> str:
        return self.config.host

    @property
    def port(self) -> int:
        return int(self._socket.getsockname()[1])

    @property
    def url(self) -> str:
        """The base URL clients use: `ServiceClient(base_url=server.url)` or `TINKER_BASE_URL`."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        housekeeping = asyncio.create_task(self._housekeeping())
        serving = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started and not serving.done():
            await asyncio.sleep(0.01)
        self._started.set()
        try:
            await serving
        finally:
            housekeeping.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await housekeeping
            for session in self.service.sessions.live():  # no client can reach their models any more
                self.service.end_session(session, "the server stopped")
            self._app.state.served_weights.release_all()

    async def _housekeeping(self) -> None:
        interval = min(5.0, self.config.session_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.service.expire_silent_sessions()
            self.service.futures.sweep()

    def stop(self) -> None:
        """Stop serving; the models clients made are freed (their files stay), the engine and the
        session's own model stay. Safe to call again."""
        self._server.should_exit = True
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=START_TIMEOUT_S)
        self._socket.close()

    def __enter__(self) -> TinkerServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "serving" if self.running else "stopped"
        return f"TinkerServer({self.url}, {state}, {len(self.service.models)} client model(s))"
