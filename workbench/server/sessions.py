"""Client sessions: what each SDK `ServiceClient` created on the server, kept alive by its heartbeat.

The SDK opens a session (`create_session`) before its first model or sampler and sends a heartbeat
every 10 seconds while the process lives. Everything a session creates is recorded against it: its
models (`ServedModel`) and its samplers (`ServedSampler`). A session that is finished (`close()` in the
SDK) or stops heartbeating for the server's timeout expires, and the server frees what it created: the
models leave the engine (their files stay), the samplers' pinned weights are released. A heartbeat for
a session that has ended gets 410, which stops the SDK's heartbeat loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from workbench.engine.interface import SamplerPin
from workbench.engine.local.engine import Engine
from workbench.engine.roles import Role
from workbench.futures import APIFuture
from workbench.server.errors import RequestError
from workbench.storage.model_folders import new_model_id


@dataclass
class ServedModel:
    """A model a client created: a policy on the engine, or the critic of one (SkyRL's `model_role: "critic"`)."""

    model_id: str  # the client's id for it: "<session id>:train:<model_seq_id>"
    engine_model_id: str  # the engine's model it trains (a policy's own id; a critic's, its policy's)
    role: Role
    session_id: str
    engine: Engine  # its base model's
    last_request: float = field(default_factory=time.time)


@dataclass
class ServedSampler:
    """A sampling session: the weights a client's SamplingClient samples, pinned on the engine."""

    sampler_id: str
    pin: APIFuture[SamplerPin]
    session_id: str
    model_path: str | None  # the checkpoint it samples, if any
    model_id: str | None  # the served model whose current weights it pinned (an ephemeral sampler)
    engine: Engine  # its base model's


@dataclass
class ClientSession:
    session_id: str
    sdk_version: str | None
    user_metadata: dict[str, Any]
    tags: list[str]
    last_heartbeat: float = field(default_factory=time.monotonic)
    models: list[str] = field(default_factory=list)  # the served model ids it created, oldest first
    samplers: list[str] = field(default_factory=list)
    ended: str | None = None  # why it ended: "finished: success", "expired", ...
    ended_at: float | None = None  # time.monotonic() when it ended


ENDED_SESSIONS_KEPT_S = 600.0
"""How long an ended session is remembered (so that a late heartbeat gets 410, which stops the SDK's
heartbeat loop, rather than 404); then it is forgotten, so the table holds only recent sessions."""

MAX_ENDED_SESSIONS = 10_000
"""The most ended sessions remembered at once, however fast sessions come and go."""


class SessionTable:
    def __init__(self, base_model: str) -> None:
        self._base_model = base_model
        self._sessions: dict[str, ClientSession] = {}

    def create(
        self, sdk_version: str | None, user_metadata: dict[str, Any], tags: list[str]
    ) -> ClientSession:
        session = ClientSession(new_model_id(self._base_model), sdk_version, dict(user_metadata), list(tags))
        self._sessions[session.session_id] = session
        return session

    def find(self, session_id: str) -> ClientSession:
        """The session, live or ended; 404 for an id never seen."""
        session = self._sessions.get(session_id)
        if session is None:
            raise RequestError(f"no session {session_id!r} on this server", 404)
        return session

    def get(self, session_id: str) -> ClientSession:
        """The live session; 404 for an id never seen, 410 for one that has ended."""
        session = self.find(session_id)
        if session.ended is not None:
            raise RequestError(f"session {session_id!r} has ended ({session.ended})", 410)
        return session

    def heartbeat(self, session_id: str) -> None:
        self.get(session_id).last_heartbeat = time.monotonic()

    def end(self, session: ClientSession, why: str) -> None:
        session.ended, session.ended_at = why, time.monotonic()

    def forget_ended(self, now: float | None = None) -> None:
        """Forget sessions that ended more than `ENDED_SESSIONS_KEPT_S` ago, and the oldest ended ones
        beyond `MAX_ENDED_SESSIONS`."""
        now = time.monotonic() if now is None else now
        ended = [s for s in self._sessions.values() if s.ended_at is not None]
        ended.sort(key=lambda s: s.ended_at or 0.0)
        for position, session in enumerate(ended):
            old = now - (session.ended_at or 0.0) > ENDED_SESSIONS_KEPT_S
            if old or position < len(ended) - MAX_ENDED_SESSIONS:
                del self._sessions[session.session_id]

    def __len__(self) -> int:
        return len(self._sessions)

    def live(self) -> list[ClientSession]:
        return [s for s in self._sessions.values() if s.ended is None]

    def silent_for(self, timeout_s: float, now: float | None = None) -> list[ClientSession]:
        """Live sessions whose last heartbeat is older than `timeout_s`."""
        now = time.monotonic() if now is None else now
        return [s for s in self.live() if now - s.last_heartbeat > timeout_s]
