"""What a server is told at start: where it listens, who may call it, and its limits."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024


def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServerConfig:
    """A server's settings.

    Attributes:
        host: The address to bind. Anything but a loopback address needs `api_key`.
        port: The port; 0 picks a free one.
        api_key: When set, every request must carry it (`X-API-Key`, as the SDK sends `TINKER_API_KEY`);
            Tinker keys start with `tml-`, and the SDK refuses any other.
        max_body_bytes: The largest request body accepted (after decompression).
        session_timeout_s: A client session without a heartbeat for this long expires and its models
            are freed (the SDK heartbeats every 10 s).
        long_poll_s: How long `retrieve_future` waits for a result before answering `try_again` (the
            SDK gives each poll 45 s).
        compress_requests: Ask SDKs to zstd-compress forward_backward bodies (`proto_compress_fwdbwd`).
        allowed_base_models: Base models a client may have loaded on first use (by naming one in a
            request), beside those the server holds already; nothing else is ever loaded for a client.
    """

    host: str = "127.0.0.1"
    port: int = 0
    api_key: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    session_timeout_s: float = 120.0
    long_poll_s: float = 30.0
    compress_requests: bool = False
    allowed_base_models: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.api_key is None and not is_loopback(self.host):
            raise ValueError(
                f"binding {self.host!r} lets other machines reach the server: give an api_key (clients "
                "send it as TINKER_API_KEY), or bind 127.0.0.1"
            )
        if self.api_key is not None and (not self.api_key.startswith("tml-") or len(self.api_key) < 12):
            raise ValueError(
                "api_key must start with 'tml-' (the SDK sends no other kind) and have at least 8 "
                "characters after it"
            )
        if isinstance(self.port, bool) or not isinstance(self.port, int) or not 0 <= self.port < 65536:
            raise ValueError(f"port must be an integer in [0, 65535], got {self.port!r}")
        for name in ("max_body_bytes", "session_timeout_s", "long_poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
