"""Sweep checkpoints: a whole sweep saved every k rounds, so that a new session continues it exactly.

A sweep is saved in two layers. Each member's model and loop are a run checkpoint in its own model
folder (`run-<next step>`, as `sess.run(..., save_every=k)` saves them, `workbench.notebook.run_checkpoints`:
adapter, optimizer state, counters, `loop_state`, history and rollout-log positions, one atomic folder).
The sweep's own state is `sweep.json` in the sweep's folder (`<models root>/<sweep name>`, beside its
members' folders): for each member in order (clones included) its settings, its state (running, paused,
finished, stopped), the optimizer settings its next step uses, its sampling stream (the engine's
generator state between its steps) and the path of its newest run checkpoint; the rounds taken, the
halvings done and still to do.

`sweep.json` is the commit point. It is written after the members' checkpoints it names, aside and then
renamed over the old one (`write_text_atomically`), so it always names complete checkpoints; pruning (each
member's newest `keep` run checkpoints, `to_prune`) runs after it is written and never removes the
newest, which it names. A kernel lost between a member's save and the file's leaves the previous file,
naming the previous checkpoints. Members train independently of each other (each on its own model and
sampling stream), so each member's entry is a consistent point of that member, whatever the others'.

Resuming (`sess.sweep(step_fn, configs, steps, resume=<sweep name or folder>)`) rebuilds each member's
model from its run checkpoint (`Restore.WITH_OPTIMIZER`: the engine's RNGs are the session's, the member's
sampling stream is its own), rewinds its folder's logs to it (`rewind_logs`: rows recorded after it are
kept marked discarded) and calls the step function from each member's saved step on.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from workbench.notebook.run_checkpoints import write_text_atomically

SWEEP_FILE = "sweep.json"
"""The sweep's own state, in the sweep's folder."""


@dataclasses.dataclass(frozen=True)
class SavedMember:
    """One member as `sweep.json` has it."""

    model_id: str
    settings: dict[str, Any]  # `MemberSettings.to_json()`
    state: str  # a `RunState` value
    adam_params: dict[str, float]  # the settings its next step uses (live edits included)
    rng_state: str  # its sampling generator's state between its steps, base64
    checkpoint: str  # the folder of its newest run checkpoint
    clone_of: str | None = None  # the model id of the member it was cloned from


@dataclasses.dataclass(frozen=True)
class SavedSweep:
    """A sweep as `sweep.json` has it: enough, with its members' run checkpoints, to continue it."""

    name: str
    steps: int
    rounds: int  # rounds taken (a round: each member that may, one step)
    by: str | None
    mode: str
    halve_at: list[int]  # the halvings still to do
    halvings: list[tuple[int, list[str]]]  # those done: (step, names of the members stopped)
    members: list[SavedMember]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> SavedSweep:
        fields = json.loads(text)
        fields["members"] = [SavedMember(**member) for member in fields["members"]]
        fields["halvings"] = [(step, list(names)) for step, names in fields["halvings"]]
        return cls(**fields)


def write_sweep(folder: Path, saved: SavedSweep) -> None:
    """Replace the folder's `sweep.json` with `saved`, atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    write_text_atomically(folder / SWEEP_FILE, saved.to_json())


def read_sweep(folder: Path) -> SavedSweep:
    """The sweep saved in `folder`; FileNotFoundError naming the folder when it holds none."""
    path = folder / SWEEP_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{folder} holds no saved sweep ({SWEEP_FILE}): a sweep with save_every saves one"
        )
    return SavedSweep.from_json(path.read_text(encoding="utf-8"))


def encode_rng(state: torch.Tensor) -> str:
    """A generator state (a uint8 tensor) as text for `sweep.json`."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8).clone()


def check_json_options(name: str, options: Mapping[str, Any]) -> None:
    """Refuse options `sweep.json` cannot hold (a function, a tensor): a saved sweep restores them."""
    try:
        json.dumps(dict(options), allow_nan=False)
    except (TypeError, ValueError) as error:
        raise ValueError(
            f"save_every saves each member's settings as JSON; {name}'s options {dict(options)!r} are not "
            f"({error})"
        ) from None
