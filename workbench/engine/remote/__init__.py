"""The remote engine: a model on any service that speaks the Tinker API, driven through the `tinker` SDK.

`engine.py` is the engine (`RemoteEngine`); the other modules are what it does for servers that differ
from hosted Tinker: `server_profiles.py` (what a known server does differently, found at connect),
`sequence_id_relay.py` (sequence ids for servers of the older protocol) and `client_metrics.py` (`loss:sum`
and `num_tokens:sum` where a server sends none).
"""
