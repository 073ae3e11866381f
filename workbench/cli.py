"""The `workbench` command.

    workbench serve --base-model smollm2-135m --port 8000

serves the Tinker REST protocol for a session on this machine's GPU (or CPU) until interrupted, so the
unmodified `tinker` SDK and tinker-cookbook scripts train on it:

    TINKER_API_KEY=tml-local python -m tinker_cookbook.recipes.sl_loop base_url=http://127.0.0.1:8000 ...

and OpenAI's and Anthropic's APIs on the same port (`/oai/api/v1`, `/anthropic/api`), for evaluation
harnesses and chat clients.

It prints where it serves and the model, then one line per operation that clients run (`--quiet` keeps
only the first lines). The session's model folder gets the history of every operation (`history.jsonl`)
and its W&B run, as in the notebook. Binding anything but a loopback address requires an API key
(`--api-key`, or `WORKBENCH_API_KEY` to keep it out of the process list).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence

from workbench.engine.config import DEFAULT_MAX_MODELS
from workbench.notebook.session import Session

API_KEY_ENV = "WORKBENCH_API_KEY"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="workbench", description="A research workbench for LLM post-training."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="serve the Tinker REST protocol (the tinker SDK and tinker-cookbook drive this machine's model)",
        description="Serve the Tinker REST protocol for a base model until interrupted.",
    )
    serve.add_argument(
        "--base-model", default="smollm2-135m", help="a built-in alias, a local HF folder or an HF id"
    )
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (others need an API key)")
    serve.add_argument("--port", type=int, default=8000, help="the port (0: any free one)")
    serve.add_argument("--api-key", default=None, help=f"the key clients must send (default: ${API_KEY_ENV})")
    serve.add_argument(
        "--max-models",
        type=int,
        default=DEFAULT_MAX_MODELS,
        help="LoRA models that may share the base at once",
    )
    serve.add_argument("--device", default=None, help="cuda, cpu, ... (default: CUDA when present)")
    serve.add_argument(
        "--model-dir",
        "--run-dir",  # the deprecated spelling, still accepted
        dest="model_dir",
        default=None,
        help="the session model's folder (history, W&B files)",
    )
    serve.add_argument(
        "--sampler",
        choices=("auto", "hf", "vllm"),
        default="auto",
        help="the sampling engine (default: vLLM when installed for the device, else HF generate)",
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads per operation (default: one per core other processes leave free)",
    )
    serve.add_argument("--no-wandb", action="store_true", help="no W&B run")
    serve.add_argument("--quiet", action="store_true", help="no line per operation")
    return parser


def serve(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    print(f"workbench: loading {args.base_model} ...", flush=True)
    session = Session(
        args.base_model,
        device=args.device,
        sampler=args.sampler,
        max_models=args.max_models,
        threads=args.threads,
        model_dir=args.model_dir,
        wandb=False if args.no_wandb else None,
    )
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    try:
        server = session.serve(args.host, args.port, api_key=api_key)
        info, config = session.base_info, session.engine.config
        print(f"workbench: serving the Tinker API at {server.url}", flush=True)
        print(
            f"workbench: base model {config.base_model} ({info.path}) on {config.device}/{config.dtype}, "
            f"up to {config.max_models} models; torch threads {session.threads}; "
            f"history in {session.model_dir}",
            flush=True,
        )
        wandb = session.wandb_run
        if wandb is not None:
            where = wandb.url or f"offline in {wandb.directory} (upload with: wandb sync {wandb.directory})"
            print(f"workbench: W&B run {wandb.run_id}: {where}", flush=True)
        key_hint = "the server's key" if api_key else "tml-local"
        print(
            f"workbench: clients: TINKER_API_KEY={key_hint} tinker.ServiceClient(base_url={server.url!r})",
            flush=True,
        )
        print(
            f"workbench: OpenAI's API at {server.url}/oai/api/v1, Anthropic's at {server.url}/anthropic/api "
            "(the same key)",
            flush=True,
        )
        if not args.quiet:
            handler = logging.StreamHandler(sys.stdout)
            handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
            operations = logging.getLogger("workbench.server")
            operations.addHandler(handler)
            operations.setLevel(logging.INFO)
        while not stop.wait(0.5):
            if not server.running:
                print("workbench: the server stopped", file=sys.stderr, flush=True)
                return 1
        print("workbench: stopping", flush=True)
        return 0
    finally:
        session.close()


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return serve(args)
    except ValueError as error:
        print(f"workbench: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
