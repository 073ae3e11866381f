"""Where a model's files live, and how `tinker://` paths name its checkpoints.

A model is a folder under the models root (`$WORKBENCH_RUNS`, default `./runs`) named by its id, which
is also its Tinker model id and training run id and its W&B run id. Inside it, `checkpoints/<name>`
holds state checkpoints (`save_state`) and `sampler_weights/<name>` sampler checkpoints
(`save_weights_for_sampler`), so the Tinker paths map onto folders one to one:

    tinker://<model id>/weights/<name>          ->  <models root>/<model id>/checkpoints/<name>
    tinker://<model id>/sampler_weights/<name>  ->  <models root>/<model id>/sampler_weights/<name>

A model living in a folder outside the models root (`Session(model_dir=...)`) is found through the
models the caller knows (`known_models`); in another process, name its folder instead.

`run.json` in the folder says what the model is (base model, adapter, user metadata, creation time), so
a model can be described (Tinker's `RestClient.get_training_run`) after the process that trained it ended.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from workbench.storage.checkpoint_store import (
    CheckpointError,
    CheckpointKind,
    check_name,
    is_name,
    json_bytes,
    kind_dir,
    write_file,
)

MODELS_ROOT_ENV = "WORKBENCH_RUNS"
"""The environment variable naming the models root."""
MODEL_INFO = "run.json"
TINKER_SCHEME = "tinker://"
SEGMENTS: dict[CheckpointKind, str] = {
    "state": "weights",
    "sampler": "sampler_weights",
    "external": "external_weights",
}

_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")


IN_USE = ".in-use"
"""The file a live run holds an advisory lock on (`hold_model_folder`)."""

_held: dict[Path, IO[bytes]] = {}  # model folder -> the open lock file of its live run in this process


def hold_model_folder(model_dir: Path) -> None:
    """Mark `model_dir` as the folder of a live run until `release_model_folder` (or this process ends): an
    exclusive `flock` on its `.in-use` file, which the system drops with the process, so a run killed
    with `kill -9` leaves nothing to clean up. A second live run in the same folder, in this process or
    another, would overwrite its run.json and mix its checkpoints and history: it is refused."""
    handle = open(model_dir / IN_USE, "ab")  # noqa: SIM115 (held open until release)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise ValueError(
            f"model folder {model_dir} is in use by a live session (in this process or another); close it "
            "first, or give another model_dir"
        ) from None
    _held[model_dir] = handle


def release_model_folder(model_dir: Path) -> None:
    handle = _held.pop(model_dir, None)
    if handle is not None:
        handle.close()


def models_root() -> Path:
    """Where model folders go: `$WORKBENCH_RUNS`, default `./runs`, as an absolute path."""
    return Path(os.environ.get(MODELS_ROOT_ENV, "runs")).absolute()


def new_model_id(base_model: str) -> str:
    """`<model>-<date>-<time>-<random>`: sortable by creation, unique, and safe as a folder name, a
    W&B run id and a `tinker://` path component."""
    model = re.sub(r"[^A-Za-z0-9]+", "-", Path(base_model).name).strip("-").lower() or "model"
    return f"{model}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def check_model_id(model_id: str) -> str:
    """`model_id` when it is safe as a folder name and a `tinker://` path component; ValueError otherwise."""
    if not isinstance(model_id, str) or not _MODEL_ID.fullmatch(model_id) or ".." in model_id:
        raise ValueError(f"invalid model id {model_id!r}: use letters, digits, '.', '_', ':' and '-'")
    return model_id


@dataclass(frozen=True)
class CheckpointAddress:
    """A checkpoint named the Tinker way: the model, the kind (`weights` / `sampler_weights`), the name."""

    model_id: str
    kind: CheckpointKind
    name: str

    @property
    def tinker_path(self) -> str:
        return f"{TINKER_SCHEME}{self.model_id}/{SEGMENTS[self.kind]}/{self.name}"

    @property
    def checkpoint_id(self) -> str:
        """Tinker's `checkpoint_id`: `weights/<name>` or `sampler_weights/<name>`."""
        return f"{SEGMENTS[self.kind]}/{self.name}"

    @classmethod
    def parse(cls, path: str) -> CheckpointAddress:
        """Parse `tinker://<model id>/<weights|sampler_weights>/<name>`; a clear error for anything else."""
        if not path.startswith(TINKER_SCHEME):
            raise CheckpointError(f"{path!r} is not a tinker:// path")
        parts = path[len(TINKER_SCHEME) :].split("/")
        kinds = {segment: kind for kind, segment in SEGMENTS.items()}
        if len(parts) != 3 or parts[1] not in kinds:
            raise CheckpointError(
                f"{path!r} is not a checkpoint path: expected tinker://<model id>/weights/<name> or "
                "tinker://<model id>/sampler_weights/<name> (or external_weights/<name>)"
            )
        try:
            check_model_id(parts[0])
        except ValueError as error:
            raise CheckpointError(f"{path!r}: {error}") from None
        return cls(parts[0], kinds[parts[1]], check_name(parts[2]))

    def folder(self, known_models: Mapping[str, Path]) -> Path:
        """The checkpoint's folder: under the model's folder if the caller knows it, else under the models root."""
        model_dir = known_models.get(self.model_id, models_root() / self.model_id)
        return kind_dir(model_dir, self.kind) / self.name


def address_of(folder: Path) -> CheckpointAddress:
    """The Tinker address of a checkpoint folder `<model dir>/<checkpoints|sampler_weights>/<name>`."""
    folder = folder.absolute()
    for kind in SEGMENTS:
        if folder.parent == kind_dir(folder.parent.parent, kind):
            return CheckpointAddress(folder.parent.parent.name, kind, folder.name)
    raise CheckpointError(f"{folder} is not inside a model's checkpoint folders")


def checkpoint_folder(path: str | Path) -> Path:
    """The folder a `tinker://` checkpoint path (of either kind, under the models root) or a folder path names."""
    if isinstance(path, str) and path.startswith(TINKER_SCHEME):
        return CheckpointAddress.parse(path).folder({})
    return Path(path).expanduser()


def resolve_checkpoint(
    path_or_name: str | Path,
    kind: CheckpointKind,
    own_model_dir: Path | None,
    known_models: Mapping[str, Path],
) -> Path:
    """The folder a user means: a `tinker://` path, a checkpoint name of their own model, or a folder.

    Raises:
        CheckpointError: the path names another kind of checkpoint, or nothing that exists.
    """
    if isinstance(path_or_name, str) and path_or_name.startswith(TINKER_SCHEME):
        address = CheckpointAddress.parse(path_or_name)
        if address.kind != kind:
            wanted = {
                "state": "a state checkpoint (tinker://<run>/weights/<name>)",
                "sampler": "sampler weights (tinker://<run>/sampler_weights/<name>)",
                "external": "external weights (tinker://<run>/external_weights/<name>)",
            }[kind]
            raise CheckpointError(f"{path_or_name} is not {wanted}")
        folder = address.folder(known_models)
        if not folder.is_dir():
            raise CheckpointError(f"Can't find a valid checkpoint at {path_or_name}: no folder {folder}")
        return folder
    if isinstance(path_or_name, str) and own_model_dir is not None and is_name(path_or_name):
        own = kind_dir(own_model_dir, kind) / path_or_name
        if own.is_dir():
            return own
    folder = Path(path_or_name).expanduser()
    if not folder.is_dir():
        raise CheckpointError(
            f"Can't find a valid checkpoint at {str(path_or_name)!r}: not a tinker:// path, no such folder, "
            "and no checkpoint of this run has that name"
        )
    return folder


def write_model_info(model_dir: Path, info: Mapping[str, Any]) -> None:
    """Write `run.json` (what the model is) atomically: a reader sees the old file or the new one."""
    temporary = model_dir / f".{MODEL_INFO}.tmp-{secrets.token_hex(4)}"
    write_file(temporary, json_bytes(dict(info)))
    os.replace(temporary, model_dir / MODEL_INFO)


def read_model_info(model_dir: Path) -> dict[str, Any] | None:
    """The model's `run.json`, or None for a folder without one (not a model's, or made before it existed)."""
    path = model_dir / MODEL_INFO
    if not path.is_file():
        return None
    try:
        info = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise CheckpointError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{path} does not describe a model")
    return info


def model_folders(known_models: Mapping[str, Path]) -> dict[str, Path]:
    """Every model folder by model id: those under the models root that hold a `run.json`, and the known ones."""
    root = models_root()
    found = (
        {folder.name: folder for folder in root.iterdir() if (folder / MODEL_INFO).is_file()}
        if root.is_dir()
        else {}
    )
    return {**found, **known_models}
