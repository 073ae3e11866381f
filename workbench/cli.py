"""The `workbench` command.

    workbench serve --base-model smollm2-135m --port 8000
    workbench serve --base-model Qwen/Qwen3-1.7B --base-model Qwen/Qwen3-8B --allow-base-model Qwen/Qwen3-4B \
        --memory-budget 70GiB

serves the Tinker REST protocol for a session on this machine's GPU (or CPU) until interrupted, so the
unmodified `tinker` SDK and tinker-cookbook scripts train on it. The first `--base-model` is the
session's; every `--base-model` is loaded at start, and each `--allow-base-model` when a client first
names it (a teacher, a grader, a KL reference), within `--memory-budget` (idle base models are freed
first; a load that still does not fit is refused, naming the budget and what holds it). On a loopback
address a base that loads from this machine alone (a built-in, a model folder, an HF id in the local
HF cache) loads on a client's first use without a flag; anything else is refused, naming the flags.

On SIGINT or SIGTERM it stops within `SHUTDOWN_BOUND_S` plus one decoding step: the server stops
answering, the sampling in progress (HF or vLLM) fails with "sampling was interrupted" at its next
decoding step, queued requests fail the same way or finish, and the history is written.

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

from workbench.engine.config import DEFAULT_MAX_MODELS, QUANTIZATION_METHODS
from workbench.engine.local.base_models import format_size, parse_size
from workbench.engine.samplers.factory import sampler_choices
from workbench.notebook.session import Session
from workbench.server import ServerConfig, TinkerServer

API_KEY_ENV = "WORKBENCH_API_KEY"
SHUTDOWN_BOUND_S = 5.0
"""What `workbench serve` takes to exit after SIGINT/SIGTERM, beyond one decoding step of the sampling
in progress and the interpreter's exit: 0.5 s to notice, 1 s of graceful HTTP shutdown, the models
freed and the history written. Measured with a 128 × 4,000-token sample in flight on 2 busy cores: 12 s
from the signal to the process's exit on HF, 7 s on vLLM (its engine processes ended too); before, the
generation ran on (over 120 s on HF, 137 s on vLLM)."""


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
        "--base-model",
        action="append",
        default=None,
        help="a built-in alias, a local HF folder or an HF id (repeat for several; the first is the "
        "session's; default smollm2-135m)",
    )
    serve.add_argument(
        "--allow-base-model",
        action="append",
        default=[],
        help="a base model loaded when a client first names it (repeatable; on a loopback address a "
        "built-in, a model folder or an HF id in the local HF cache needs none)",
    )
    serve.add_argument(
        "--memory-budget",
        default=None,
        help="what the base models' weights may hold together, e.g. 70GiB (default: no bound)",
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
        "--devices",
        type=_devices,
        default=None,
        help="train on several devices, data parallel: a count (2: two CUDA devices, or two CPU ranks "
        "without CUDA), 'all', or names (cuda:0,cuda:1); default one device",
    )
    serve.add_argument(
        "--shard-base",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with --devices: shard the frozen base across the ranks (FSDP2), about 1/N each; default: "
        "only when the base does not fit one device",
    )
    serve.add_argument(
        "--model-dir",
        "--run-dir",  # the deprecated spelling, still accepted
        dest="model_dir",
        default=None,
        help="the session model's folder (history, W&B files)",
    )
    serve.add_argument(
        "--sampler",
        choices=sampler_choices(),
        default="auto",
        help="the sampling engine (default: vLLM when installed for the device, else HF generate)",
    )
    serve.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads per operation (default: one per core other processes leave free)",
    )
    serve.add_argument(
        "--quantize",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="quantize the frozen base at load with bitsandbytes (QLoRA; default: full precision)",
    )
    serve.add_argument("--no-wandb", action="store_true", help="no W&B run")
    serve.add_argument("--quiet", action="store_true", help="no line per operation")
    return parser


def _devices(text: str) -> int | str | list[str]:
    """`--devices`: a count, `all`, or device names separated by commas."""
    if text.isdigit():
        return int(text)
    if text == "all":
        return text
    return [name.strip() for name in text.split(",") if name.strip()]


def _print_serving(
    session: Session, server: TinkerServer, args: argparse.Namespace, has_key: bool, budget: int | None
) -> None:
    """What the server runs and where: its base models, budget, threads, history and W&B run, and how
    clients reach its three APIs."""
    assert session.base_models is not None
    for engine in session.base_models.engines():
        info, engine_config = engine.base_info, engine.config
        quantized = "" if engine_config.quantization is None else f" {engine_config.quantization.describe()}"
        quantized += ", base sharded" if engine.sharded else ""
        print(
            f"workbench: base model {engine_config.base_model} ({info.path}) on "
            f"{'+'.join(engine.devices)}/{engine_config.dtype}{quantized}, up to {engine_config.max_models} models",
            flush=True,
        )
    if args.allow_base_model:
        print(f"workbench: loaded on first use: {', '.join(args.allow_base_model)}", flush=True)
    if budget is not None:
        print(f"workbench: memory budget {format_size(budget)} ({session.base_models!r})", flush=True)
    print(f"workbench: torch threads {session.threads}; history in {session.model_dir}", flush=True)
    wandb = session.wandb_run
    if wandb is not None:
        where = wandb.url or f"offline in {wandb.directory} (upload with: wandb sync {wandb.directory})"
        print(f"workbench: W&B run {wandb.run_id}: {where}", flush=True)
    key_hint = "the server's key" if has_key else "tml-local"
    print(
        f"workbench: clients: TINKER_API_KEY={key_hint} tinker.ServiceClient(base_url={server.url!r})",
        flush=True,
    )
    print(
        f"workbench: OpenAI's API at {server.url}/oai/api/v1, Anthropic's at {server.url}/anthropic/api "
        "(the same key)",
        flush=True,
    )


def _log_operations() -> None:
    """The server's log of each operation, on stdout with the time."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    operations = logging.getLogger("workbench.server")
    operations.addHandler(handler)
    operations.setLevel(logging.INFO)


def serve(args: argparse.Namespace) -> int:
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    base_models = args.base_model or ["smollm2-135m"]
    budget = None if args.memory_budget is None else parse_size(args.memory_budget)
    print(f"workbench: loading {base_models[0]} ...", flush=True)
    session = Session(
        base_models[0],
        device=args.device,
        devices=args.devices,
        shard_base=args.shard_base,
        sampler=args.sampler,
        max_models=args.max_models,
        threads=args.threads,
        model_dir=args.model_dir,
        wandb=False if args.no_wandb else None,
        memory_budget_bytes=budget,
        quantize=args.quantize,
    )
    stop = threading.Event()

    def stop_now(*_: object) -> None:
        stop.set()
        for signum in (signal.SIGINT, signal.SIGTERM):  # a second signal ends the process at once
            signal.signal(signum, signal.SIG_DFL)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop_now)
    assert session.base_models is not None
    try:
        for other in base_models[1:]:
            print(f"workbench: loading {other} ...", flush=True)
            session.base_models.engine(other)
        config = ServerConfig(
            host=args.host, port=args.port, api_key=api_key, allowed_base_models=tuple(args.allow_base_model)
        )
        server = TinkerServer(session.base_models, config)
        session.servers.append(server)
        print(f"workbench: serving the Tinker API at {server.url}", flush=True)
        _print_serving(session, server, args, api_key is not None, budget)
        if not args.quiet:
            _log_operations()
        while not stop.wait(0.5):
            if not server.running:
                print("workbench: the server stopped", file=sys.stderr, flush=True)
                return 1
        print("workbench: stopping", flush=True)
        return 0
    finally:
        # The sampling in progress fails at its next decoding step, so a client waiting for it is
        # answered ("sampling was interrupted") while the server still finishes responses; then the
        # server stops and the models are freed.
        for engine in session.base_models.engines():
            engine.interrupt_sampling()
        for server in session.servers:
            server.stop()
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
