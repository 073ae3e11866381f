"""Move a checkpoint between machines as one tar file.

    wb.export_archive(p, "run.tar")              # or "run.tar.gz" / "run.tgz" for gzip
    folder = wb.import_archive("run.tar", dest)  # dest/<checkpoint name>, verified

An archive holds one checkpoint folder under its own name. Importing treats the file as hostile: before
anything is written, every member is checked (a relative path inside that one folder, no `..`, only
regular files and folders: no links, devices or fifos) and the archive is refused with
`UnsafeArchiveError` otherwise. Extraction then goes through tarfile's `filter="data"` as well, into a
temporary folder that becomes `dest/<name>` only after the checkpoint's manifest has been verified.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tarfile
from pathlib import Path, PurePosixPath

from workbench.storage.checkpoint_store import (
    CheckpointError,
    check_name,
    read_verified,
    require_checkpoint_folder,
)
from workbench.storage.model_folders import checkpoint_folder

_MODES = {".tar": "w", ".tar.gz": "w:gz", ".tgz": "w:gz"}


class UnsafeArchiveError(ValueError):
    """An archive member could write outside its folder or is not a plain file or folder."""


def _write_mode(tar_path: Path) -> str:
    for suffix, mode in _MODES.items():
        if tar_path.name.endswith(suffix):
            return mode
    raise ValueError(f"{tar_path.name}: use a .tar, .tar.gz or .tgz file name")


def export_archive(path: str | Path, tar_path: str | Path) -> Path:
    """Write the checkpoint at `path` (its folder, or its `tinker://` path; verified first: a corrupt
    checkpoint is not shipped) to `tar_path`, atomically. Returns `tar_path`."""
    folder = require_checkpoint_folder(checkpoint_folder(path))
    read_verified(folder)
    target = Path(tar_path).expanduser()
    mode = _write_mode(target)
    if target.exists():
        raise CheckpointError(f"{target} already exists")
    tmp = target.with_name(f".{target.name}.tmp-{secrets.token_hex(4)}")
    try:
        with tarfile.open(tmp, mode) as tar:
            tar.add(folder, arcname=folder.absolute().name)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _check_members(members: list[tarfile.TarInfo]) -> str:
    """The archive's one top-level folder name, after checking every member."""
    tops: set[str] = set()
    for member in members:
        name = member.name
        parts = PurePosixPath(name).parts
        if name.startswith(("/", "\\")) or PurePosixPath(name).is_absolute() or (parts and ":" in parts[0]):
            raise UnsafeArchiveError(f"archive member {name!r} has an absolute path")
        if ".." in parts or "\\" in name:
            raise UnsafeArchiveError(f"archive member {name!r} leaves its folder ('..' or a backslash)")
        if member.issym() or member.islnk():
            raise UnsafeArchiveError(
                f"archive member {name!r} is a link; checkpoints hold only files and folders"
            )
        if not (member.isreg() or member.isdir()):
            raise UnsafeArchiveError(
                f"archive member {name!r} is not a regular file or folder (device, fifo, ...)"
            )
        parts = tuple(part for part in parts if part != ".")
        if not parts:
            raise UnsafeArchiveError(f"archive member {name!r} has an empty path")
        tops.add(parts[0])
    if len(tops) != 1:
        raise UnsafeArchiveError(
            f"a checkpoint archive holds one folder; this one has {sorted(tops) or 'none'}"
        )
    return tops.pop()


def import_archive(tar_path: str | Path, dest: str | Path) -> Path:
    """Unpack a checkpoint archive into `dest` (created if missing) and return the checkpoint folder.

    Raises:
        UnsafeArchiveError: a member with an absolute path, `..`, a link, a device or another special
            file; nothing is written.
        CheckpointError: the checkpoint is already in `dest`; CorruptCheckpointError when its files do
            not match its manifest (nothing is left in `dest`).
    """
    destination = Path(dest).expanduser()
    with tarfile.open(Path(tar_path).expanduser(), "r:*") as tar:
        members = tar.getmembers()
        name = check_name(_check_members(members))
        target = destination / name
        if target.exists():
            raise CheckpointError(f"{target} already exists")
        destination.mkdir(parents=True, exist_ok=True)
        tmp = destination / f".{name}.tmp-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            tar.extractall(tmp, members=members, filter="data")
            read_verified(tmp / name)
            (tmp / name).rename(target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
