"""A follower rank's process: its own engine, doing what rank 0 says, in the order rank 0 says it.

Started by rank 0 (`workbench.engine.local.ranks.FollowerRanks`) as `python -m
workbench.engine.local.rank_follower <fd> <pid>`: one end of its control pipe as file descriptor `fd`,
and rank 0's process id. It loads its engine from the settings rank 0 sends first, says so, joins the
process group, and then answers each message in turn: an operation to repeat (`REPEATS`: rank 0 repeats
every op that changes a model on every rank), its part of a training call (`Engine.run_shard`) or of a
sample call (`Engine.run_sample_shard`), a digest of a model's state (or of one role of it). Its models live in a private temporary folder: rank 0 alone writes the models' files
(checkpoints, history), the followers only read checkpoints rank 0 names by their folder.

It ends when told to, when its pipe reaches end of file, and when rank 0's process is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from workbench.engine.config import QuantizationConfig
from workbench.engine.interface import Restore
from workbench.engine.local.collectives import GroupAddress
from workbench.engine.local.data_parallel import SHARD_TYPES
from workbench.engine.local.engine import Engine
from workbench.engine.local.rank_sampling import MESSAGE_TYPES as SAMPLING_TYPES
from workbench.engine.local.ranks import PARENT_CHECK_S, FollowerSettings, RankOp, receive, send
from workbench.types import AdamParams, LoraConfig

REPEATS: dict[str, Callable[[Engine, tuple[Any, ...], Path], object]] = {
    "create_model": lambda engine, args, folder: engine.create_model(
        args[0], seed=args[1], model_id=args[2], model_dir=folder / args[2], user_metadata=args[3]
    ).result(),
    "delete_model": lambda engine, args, folder: engine.delete_model(args[0]).result(),
    "create_critic": lambda engine, args, folder: engine.create_critic(args[0], args[1]).result(),
    "delete_critic": lambda engine, args, folder: engine.delete_critic(args[0]).result(),
    "optim_step": lambda engine, args, folder: engine.optim_step(args[0], args[1], args[2]).result(),
    "load_state": lambda engine, args, folder: engine.load_state(args[0], args[1], args[2]).result(),
    "create_model_from_state": lambda engine, args, folder: engine.create_model_from_state(
        args[0], restore=args[1], model_id=args[2], model_dir=folder / args[2], user_metadata={}
    ).result(),
}
"""What a follower does for each operation rank 0 mirrors (`RankOp.name`), with the op's arguments."""


@dataclass(frozen=True)
class AppliedAdamParams(AdamParams):
    """An optimizer step's `AdamParams` as rank 0 applies them, taken as they are: rank 0 validated them
    when the step was submitted, and whatever its step then does with them (undone, when the weights
    would turn non-finite) every follower's must do alike. Validating them again here could only refuse
    what rank 0 has already done, and leave the ranks apart."""

    def __post_init__(self) -> None:
        """Nothing to check again (see the class)."""


MESSAGE_TYPES: dict[str, type] = {
    **SHARD_TYPES,
    **SAMPLING_TYPES,
    **{
        cls.__name__: cls
        for cls in (
            FollowerSettings,
            GroupAddress,
            QuantizationConfig,
            RankOp,
            LoraConfig,
            Restore,
        )
    },
    AdamParams.__name__: AppliedAdamParams,
}
"""What rank 0's messages are built of, besides plain data and tensors (`rank_messages`)."""


def _exit_with_parent(parent: int) -> None:
    """End this process as soon as the one that started it (`parent`, named by it: a parent that died
    before this check began is already not ours) is gone (a killed kernel)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(1)

    threading.Thread(target=watch, name="workbench-parent-watch", daemon=True).start()


def _answer(engine: Engine, message: tuple[Any, ...], folder: Path) -> object:
    kind = message[0]
    if kind == "mirror":
        op: RankOp = message[1]
        REPEATS[op.name](engine, op.args, folder)
        return None
    if kind == "shard":
        return engine.run_shard(message[1])
    if kind in ("sample", "logprobs"):
        return engine.run_sample_shard(message[1])
    if kind == "digest":
        return engine.state_digest(message[1], message[2])
    if kind == "base_bytes":
        return engine.resident_base_bytes
    raise ValueError(f"unknown message {kind!r}")


def serve(engine: Engine, connection: Connection, folder: Path) -> None:
    """Answer rank 0's messages until it says close or its pipe ends."""
    while True:
        try:
            message = receive(connection, MESSAGE_TYPES)
        except EOFError:
            return
        if message[0] == "close":
            return
        try:
            value = _answer(engine, message, folder)
        except Exception as error:  # reported to rank 0, which raises it naming this rank
            send(connection, ("error", f"{type(error).__name__}: {error}"))
        else:
            send(connection, ("ok", value))


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # rank 0 alone decides; Ctrl-C reaches process groups
    _exit_with_parent(int(sys.argv[2]))
    connection = Connection(int(sys.argv[1]))
    settings: FollowerSettings = receive(connection, MESSAGE_TYPES)
    try:
        engine = Engine(
            settings.base_model,
            seed=settings.seed,
            device=settings.device,
            dtype=settings.dtype,
            max_tokens_per_microbatch=settings.max_tokens_per_microbatch,
            sampler="hf",
            threads=settings.threads,
            quantize=settings.quantization,
            shard_base=settings.shard_base,
        )
    except Exception as error:
        send(connection, ("error", f"loading the base model failed: {type(error).__name__}: {error}"))
        return
    send(connection, ("ok", None))
    try:
        engine.join_group(settings.address)  # and shards the base, when asked
        with tempfile.TemporaryDirectory(prefix=f"workbench-rank{settings.address.rank}-") as folder:
            serve(engine, connection, Path(folder))
    finally:
        engine.close()


if __name__ == "__main__":
    main()
    # what the engine held is freed and its files are gone: the interpreter's teardown (seconds of
    # torch's and transformers' module finalizers) would only delay the session's close
    os._exit(0)
