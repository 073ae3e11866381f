"""The Tinker REST protocol, served for an engine: the unmodified `tinker` SDK and tinker-cookbook
scripts drive workbench over HTTP.

    srv = sess.serve()                               # in a notebook: a background thread, 127.0.0.1
    tinker.ServiceClient(base_url=srv.url)           # any process on this machine (TINKER_API_KEY=tml-...)

    $ workbench serve --base-model smollm2-135m --port 8000     # the same from a shell

Modules, one concept each: `app` (the routes), `wire` (protobuf and JSON to workbench's types),
`schemas` (the JSON bodies, field by field), `errors` (refusals and error categories), `future_table`
(results and long-polls), `ordering` (seq_id order and retries), `sessions` (client sessions and what
they created), `service` (what each endpoint does on the engine), `config`, and `server_thread` (the
thread and event loop the server runs on).
"""

from workbench.server.config import ServerConfig
from workbench.server.server_thread import TinkerServer

__all__ = ["ServerConfig", "TinkerServer"]
