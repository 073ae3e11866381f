"""The Tinker REST protocol, served for an engine: the unmodified `tinker` SDK and tinker-cookbook
scripts drive workbench over HTTP.

    srv = sess.serve()                               # in a notebook: a background thread, 127.0.0.1
    tinker.ServiceClient(base_url=srv.url)           # any process on this machine (TINKER_API_KEY=tml-...)

    $ workbench serve --base-model smollm2-135m --port 8000     # the same from a shell

Modules, one concept each: `app.py` (the routes), `wire.py` (protobuf and JSON to workbench's types),
`schemas.py` (the JSON bodies, field by field), `errors.py` (refusals and error categories),
`future_table.py` (results and long-polls), `ordering.py` (seq_id order and retries), `sessions.py`
(client sessions and what they created), `service.py` (what each endpoint does on the engine),
`model_listings.py` (the models and checkpoints listed, described and deleted), `config.py`, and
`server_thread.py` (the thread and event loop the server runs on). The compatible APIs: `openai_api.py`
and `anthropic_api.py` (the routes), `generation.py` (a request as engine sample calls),
`served_weights.py` (a request's `model` name to pinned weights), `sampling_fields.py` (the sampling
fields both APIs share, one rule each) and `compat_http.py` (key check, body reading, event streams);
conversations become prompt tokens in `workbench/loops/chat.py`.
"""

from workbench.server.config import ServerConfig
from workbench.server.server_thread import TinkerServer

__all__ = ["ServerConfig", "TinkerServer"]
