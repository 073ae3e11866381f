"""The process group of a data-parallel engine, and the one collective a training call needs.

Every rank of an engine on several devices (`workbench.engine.local.ranks`) joins one torch.distributed
process group: gloo on CPUs, NCCL on CUDA devices. Tinker's losses are sums over tokens, so the gradient
of a call whose datums are split over the ranks is the sum of each rank's gradient of its own datums:
`sum_call_gradient` adds them up (all_reduce SUM) inside each rank's `TrainableAdapter.accumulating`, so
every rank accumulates the same total, applies the same optimizer step and keeps the same adapter. A rank
whose part of the call failed joins the collective anyway and says so, so that no rank waits on it and
every rank undoes the call alike.

The group's timeout (`COLLECTIVE_TIMEOUT`) bounds how long a rank waits for the others at a collective:
a rank that died is noticed much sooner (its sockets close, and rank 0 watches its process), so the
timeout only ends a wait on a rank that lives but no longer answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = timedelta(seconds=300)
"""The longest a rank waits for the others at a collective (or to join the group)."""


class RankCallFailedError(RuntimeError):
    """Another rank's part of the call failed: the call was undone on every rank."""


@dataclass(frozen=True)
class GroupAddress:
    """Where a rank finds the group's store (rank 0's `TCPStore`), and its place in the group."""

    host: str
    port: int
    rank: int
    world_size: int
    backend: str  # "gloo" or "nccl"


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def open_store(world_size: int) -> dist.TCPStore:
    """Rank 0's store on a free local port (`.port`), which the other ranks connect to."""
    return dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False
    )


@dataclass
class Collectives:
    """This process's membership of its engine's process group."""

    rank: int
    world_size: int
    device: torch.device

    @classmethod
    def join(
        cls, address: GroupAddress, device: torch.device, store: dist.Store | None = None
    ) -> Collectives:
        """Join the group (blocks until every rank has). Rank 0 passes the store it opened; the others
        connect to it. One process holds one group at a time (torch.distributed's default group)."""
        if dist.is_initialized():
            raise RuntimeError(
                "this process already runs an engine on several devices: close that session first "
                "(one multi-device session per process)"
            )
        if store is None:
            store = dist.TCPStore(
                address.host, address.port, address.world_size, is_master=False, timeout=COLLECTIVE_TIMEOUT
            )
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            address.backend,
            store=store,
            rank=address.rank,
            world_size=address.world_size,
            timeout=COLLECTIVE_TIMEOUT,
        )
        return cls(address.rank, address.world_size, device)

    def sum_call_gradient(self, parameters: Sequence[torch.nn.Parameter], failed: bool) -> None:
        """Replace each parameter's gradient of this call by its sum over the ranks (one all_reduce of
        one flat buffer). A parameter no rank has a gradient for keeps None, as on one device. Raises
        `RankCallFailedError` on every rank when any rank's part failed (`failed` on this one)."""
        sizes = [param.numel() for param in parameters]
        pieces = [
            torch.zeros(size, device=self.device, dtype=torch.float32)
            if failed or param.grad is None
            else param.grad.detach().reshape(-1).float()
            for param, size in zip(parameters, sizes, strict=True)
        ]
        present = [0.0 if failed or param.grad is None else 1.0 for param in parameters]
        flags = torch.tensor([*present, float(failed)], device=self.device)
        buffer = torch.cat([*pieces, flags])
        dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
        counts = buffer[sum(sizes) :].tolist()  # per parameter: the ranks with a gradient; then failures
        failures = int(counts[-1])
        if failures:
            raise RankCallFailedError(
                f"{failures} rank(s) failed their part of the call; it was undone on all"
            )
        offset = 0
        for index, (param, size) in enumerate(zip(parameters, sizes, strict=True)):
            total = buffer[offset : offset + size]
            offset += size
            if counts[index] == 0:
                param.grad = None
            else:
                param.grad = total.reshape(param.shape).to(param.dtype).clone()

    def agree_on_call(self, failed: bool) -> None:
        """On a sharded base, where every rank runs the whole call and computes the same gradient: one
        all_reduce of the failure flag, so that a call that failed on one rank is undone on every rank
        (`RankCallFailedError` where this one did not fail)."""
        flag = torch.tensor([float(failed)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.SUM)
        if int(flag.item()):
            raise RankCallFailedError(
                f"{int(flag.item())} rank(s) failed their part of the call; it was undone on all"
            )

    def combine_call_gradient(
        self, parameters: Sequence[torch.nn.Parameter], failed: bool, replicated: bool
    ) -> None:
        """The end of a training call's part on this rank: its gradient summed over the ranks
        (`sum_call_gradient`), or, when every rank ran the whole call (`replicated`: a sharded base),
        only the ranks' agreement that it succeeded (`agree_on_call`)."""
        if replicated:
            self.agree_on_call(failed)
        else:
            self.sum_call_gradient(parameters, failed)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
