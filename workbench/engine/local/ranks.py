"""The follower ranks of an engine on several devices: their processes, their control pipes, their deaths.

Rank 0 is the engine in the caller's process (its worker thread keeps the one ordered queue); ranks
1..N-1 are processes the engine starts itself (`python -m workbench.engine.local.rank_follower`, no
launcher), each with its own engine on its own device, loaded from the same base model. A pipe per
follower carries what to do next (`RankOp`: an operation to repeat, or a rank's part of a training
call) and its short reply; gradients move only through torch.distributed (`collectives`).

Every operation that changes a model is mirrored (`FollowerRanks.mirrored`): on rank 0's worker, in
queue order, the op is sent to every follower, done on rank 0, and then every follower's reply is
awaited, so every rank does the same operations in the same order.

A follower ends with its engine: on `close()`, when its pipe reaches end of file, and when the process
that started it is gone (it checks its parent every `PARENT_CHECK_S`), so no process is left behind when
the kernel is killed. It ignores SIGINT: Ctrl-C in a terminal reaches the whole process group, and the
followers only ever act on rank 0's word. A watcher thread on rank 0 notices a follower that died
(killed, out of memory) within `WATCH_INTERVAL_S`, and fails every operation still queued with a
`RankFailedError` naming the rank and the operation it died in; the operation running then fails with
the same error as soon as it next waits on that rank, and the session refuses new work: it must be
restarted from its last saved state (`Session.restart()` does so, on the same devices).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, Pipe
from typing import Any, TypeVar

import torch.distributed as dist

from workbench.engine.config import QuantizationConfig
from workbench.engine.local.collectives import COLLECTIVE_TIMEOUT, GroupAddress
from workbench.engine.local.rank_messages import decode, encode

T = TypeVar("T")

WATCH_INTERVAL_S = 0.25
"""How often rank 0 looks at its followers' processes."""
PARENT_CHECK_S = 1.0
"""How often a follower checks that the process that started it is still there."""
EXIT_WAIT_S = 10.0
"""How long `close()` waits for a follower to exit before killing it."""
FOLLOWER_MODULE = "workbench.engine.local.rank_follower"


class RankFailedError(RuntimeError):
    """A rank of a multi-device engine died, or disagreed with rank 0: the session must be restarted."""


@dataclass(frozen=True)
class RankOp:
    """An operation every follower repeats after rank 0 (`name`: an `Engine` method; `args`: plain data)."""

    name: str
    args: tuple[Any, ...]


@dataclass(frozen=True)
class FollowerSettings:
    """What a follower builds its engine with, and where it joins the group."""

    base_model: str
    seed: int
    device: str
    dtype: str
    max_tokens_per_microbatch: int
    threads: int | None
    quantization: QuantizationConfig | None
    address: GroupAddress
    shard_base: bool  # the base sharded across the group once joined (`Engine.join_group`)


def send(connection: Connection, message: Any) -> None:
    connection.send_bytes(encode(message))


def receive(connection: Connection, types: Mapping[str, type]) -> Any:
    """What `send` sent, building only `types` (`rank_messages.decode`)."""
    return decode(connection.recv_bytes(), types)


def _describe_exit(returncode: int) -> str:
    if returncode < 0:
        return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


class FollowerRanks:
    """Ranks 1..N-1 of an engine, seen from rank 0."""

    def __init__(self, settings: list[FollowerSettings], reply_types: Mapping[str, type]):
        """Start one process per follower and send it its settings; `wait_loaded` waits for them. The
        followers' replies may build `reply_types` (`rank_messages.decode`)."""
        self._reply_types = reply_types
        self._closing = False
        self._lock = threading.Lock()
        self.failure: RankFailedError | None = None
        self.current_op: str | None = None
        self._connections: list[Connection] = []
        self._processes: list[subprocess.Popen[bytes]] = []
        path = os.pathsep.join(entry for entry in sys.path if entry)
        environment = {**os.environ, "PYTHONPATH": path}
        try:
            for follower in settings:
                ours, theirs = Pipe(duplex=True)
                process = subprocess.Popen(
                    [sys.executable, "-m", FOLLOWER_MODULE, str(theirs.fileno()), str(os.getpid())],
                    pass_fds=(theirs.fileno(),),
                    env=environment,
                )
                theirs.close()
                send(ours, follower)
                self._connections.append(ours)
                self._processes.append(process)
        except BaseException:
            self.close()
            raise
        self._watcher: threading.Thread | None = None

    @property
    def ranks(self) -> range:
        return range(1, len(self._processes) + 1)

    @property
    def pids(self) -> list[int]:
        return [process.pid for process in self._processes]

    def wait_loaded(self) -> None:
        """Wait until every follower has loaded its engine (before rank 0 joins the group, so that a
        follower that fails to load is reported at once, not at the group's timeout)."""
        for rank in self.ranks:
            self.reply(rank)

    def watch(self, on_failure: Callable[[RankFailedError], None]) -> None:
        """Start the watcher thread: `on_failure` is called once, from it, when a follower dies."""

        def loop() -> None:
            while not self._closing:
                for rank, process in zip(self.ranks, self._processes, strict=True):
                    if process.poll() is not None and not self._closing:
                        on_failure(self._failed(rank))
                        return
                time.sleep(WATCH_INTERVAL_S)

        self._watcher = threading.Thread(target=loop, name="workbench-rank-watcher", daemon=True)
        self._watcher.start()

    def _failed(self, rank: int) -> RankFailedError:
        """The failure of `rank`, made once (the first failure is the one every caller sees)."""
        with self._lock:
            if self.failure is None:
                process = self._processes[rank - 1]
                returncode = process.poll()
                how = "stopped answering" if returncode is None else _describe_exit(returncode)
                during = f"during {self.current_op}" if self.current_op else "between operations"
                self.failure = RankFailedError(
                    f"rank {rank} (pid {process.pid}) {how} {during}; this session must be restarted: "
                    "Session.restart() makes a new one from its last saved state"
                )
            return self.failure

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ------------------------------------------------------------------------------------------ messages

    def request(self, rank: int, message: Any) -> None:
        try:
            send(self._connections[rank - 1], message)
        except OSError as error:
            raise self._failed(rank) from error

    def reply(self, rank: int) -> Any:
        """The follower's answer to its last request; its error re-raised here, naming it. A follower
        that does not answer within the group's timeout (`COLLECTIVE_TIMEOUT`) has failed too."""
        connection, process = self._connections[rank - 1], self._processes[rank - 1]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        try:
            while not connection.poll(WATCH_INTERVAL_S):
                if process.poll() is not None or time.monotonic() > deadline:
                    raise self._failed(rank)
            status, value = receive(connection, self._reply_types)
        except (EOFError, OSError) as error:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=2.0)  # a dead follower's exit status, for the message
            raise self._failed(rank) from error
        if status == "error":
            raise RuntimeError(f"rank {rank}: {value}")
        return value

    def dead_rank_error(self, error: BaseException) -> RankFailedError | None:
        """After an operation on rank 0 failed: the failure of a follower that died meanwhile (a
        collective fails when a peer's sockets close), if one did."""
        deadline = time.monotonic() + 2.0
        while True:
            for rank, process in zip(self.ranks, self._processes, strict=True):
                if process.poll() is not None:
                    return self._failed(rank)
            # a collective that lost a peer raises torch's RuntimeError; nothing else waits
            waits = type(error) is RuntimeError or isinstance(error, dist.DistError)
            if time.monotonic() > deadline or not waits:
                return None
            time.sleep(0.05)

    @contextlib.contextmanager
    def during(self, op: str) -> Iterator[None]:
        """Rank 0's part of `op`: refused once a rank has failed; a failure while a follower died is
        reported as that follower's death, naming it and `op`."""
        self.check()
        self.current_op = op
        try:
            yield
        except RankFailedError:
            raise
        except BaseException as error:
            dead = self.dead_rank_error(error)
            if dead is not None:
                raise dead from error
            raise
        finally:
            self.current_op = None

    def mirrored(self, op: RankOp, work: Callable[[], T]) -> T:
        """Send `op` to every follower, do `work` here, then take every follower's reply: the op takes
        effect on every rank, or (when it fails alike everywhere, as a refused load does) on none. A rank
        that disagrees with rank 0 leaves the ranks apart, and the session must be restarted."""
        with self.during(op.name):
            for rank in self.ranks:
                self.request(rank, ("mirror", op))
            try:
                result = work()
            except BaseException:
                outcomes = [self._outcome(rank) for rank in self.ranks]
                if any(outcome is None for outcome in outcomes):
                    self._disagree(op, "rank 0 failed and a follower succeeded")
                raise
            for rank in self.ranks:
                outcome = self._outcome(rank)
                if outcome is not None:
                    self._disagree(op, f"rank {rank} failed where rank 0 succeeded ({outcome})")
            return result

    def _outcome(self, rank: int) -> BaseException | None:
        try:
            self.reply(rank)
        except RankFailedError:
            raise
        except RuntimeError as error:
            return error
        return None

    def _disagree(self, op: RankOp, why: str) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = RankFailedError(
                    f"the ranks disagree after {op.name}: {why}; this session must be restarted: "
                    "Session.restart() makes a new one from its last saved state"
                )
        raise self.failure

    def ask(self, rank: int, message: Any) -> Any:
        """One request and its reply (between operations, on rank 0's worker)."""
        self.request(rank, message)
        return self.reply(rank)

    # ------------------------------------------------------------------------------------------ end

    def close(self) -> None:
        """Ask every follower to end, wait for it (killing it after `EXIT_WAIT_S`), and reap it."""
        self._closing = True
        for connection in self._connections:
            with contextlib.suppress(OSError):
                send(connection, ("close",))
        for process in self._processes:
            try:
                process.wait(timeout=EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for connection in self._connections:
            connection.close()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join()


Devices = int | str | Sequence[str] | None
"""`devices=`: a count, `"all"`, or the devices by name; None or 1: one device."""


def rank_devices(devices: Devices, device: str | None, cuda_devices: int) -> list[str]:
    """The device of each rank: N ranks on the first N CUDA devices (N CPU ranks without CUDA; a CPU
    rank per process, each with its share of the cores), `"all"` one per CUDA device (one CPU rank
    without), or the devices named. An empty list means one device: today's engine on `device`."""
    if devices is None or devices == 1:
        return []
    if isinstance(devices, str) and devices != "all":
        raise ValueError(f"devices must be a count, 'all' or a list of device names, got {devices!r}")
    if device is not None:
        raise ValueError("give either device= (one device) or devices= (several), not both")
    if devices == "all":
        names = [f"cuda:{index}" for index in range(cuda_devices)]
    elif isinstance(devices, int) and not isinstance(devices, bool):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        if cuda_devices and devices > cuda_devices:
            raise ValueError(f"devices={devices}, but this machine has {cuda_devices} CUDA device(s)")
        names = [f"cuda:{index}" for index in range(devices)] if cuda_devices else ["cpu"] * devices
    elif isinstance(devices, Sequence) and all(isinstance(name, str) for name in devices):
        names = list(devices)
    else:
        raise ValueError(f"devices must be a count, 'all' or a list of device names, got {devices!r}")
    kinds = {name.split(":")[0] for name in names}
    if len(kinds) > 1:
        raise ValueError(f"the ranks' devices must be of one kind (all CUDA or all CPU), got {names}")
    return names
