"""The tinker SDK clients a test makes against a session's server, closed while the server answers.

A `tinker.ServiceClient` holds a server-side session and heartbeats it from a thread of its own until it
is closed; tinker-cookbook's recipes make clients and never close them. A session fixture that serves
takes `sdk_clients` and calls `sdk_clients.close()` before it closes the session, so no heartbeat outlives
the server it talks to (and none warns into a later test's log).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import tinker

CLOSE_S = 60
"""How long closing one client may take on a loaded machine."""


class SdkClients:
    """Every `tinker.ServiceClient` made since the fixture began."""

    def __init__(self) -> None:
        self.made: list[tinker.ServiceClient] = []

    def close(self) -> None:
        """End each client's session on its server and stop its heartbeat."""
        while self.made:
            self.made.pop().close("success").result(timeout=CLOSE_S)


@pytest.fixture
def sdk_clients(monkeypatch: pytest.MonkeyPatch) -> Iterator[SdkClients]:
    clients = SdkClients()
    sdk_init = tinker.ServiceClient.__init__

    def recorded(client: tinker.ServiceClient, *args: object, **kwargs: object) -> None:
        sdk_init(client, *args, **kwargs)
        clients.made.append(client)

    monkeypatch.setattr(tinker.ServiceClient, "__init__", recorded)
    yield clients
    clients.close()  # a fixture that forgot to: still before the monkeypatch is undone
