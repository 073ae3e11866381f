"""Checkpoint folders on disk: atomic writes, a manifest of hashes, listing, deletion and cleanup.

A checkpoint is a folder of files. It is written under a temporary name next to its target
(`.<name>.tmp-<random>`), every file is fsynced, `manifest.json` (size and sha256 of every other file)
is written last, and only then is the folder renamed to `<name>`. So a folder named `<name>` that holds a
`manifest.json` is complete; anything else is a leftover of an interrupted operation, which listing
ignores and `cleanup` removes. Replacing a checkpoint (`overwrite=True`) renames the old folder aside
(`.<name>.old-<random>`) and deletes it only once the new one is in place; if the process dies between
the two renames, `cleanup` moves the old folder back.

Reading goes the other way: `read_verified` checks every file against the manifest (no file missing,
none extra, sizes and hashes equal) and hands back the verified bytes, so what is parsed afterwards is
exactly what was checked.

This module knows nothing about sessions; `workbench.session_state` decides what the files contain.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shutil
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE_DIR = "checkpoints"
SAMPLER_DIR = "sampler_weights"
EXTERNAL_DIR = "external_weights"
# per kind: the file with step and time
INFO_FILE = {"state": "config.json", "sampler": "sampler.json", "external": "external.json"}

CheckpointKind = Literal["state", "sampler", "external"]
KINDS: tuple[CheckpointKind, ...] = ("state", "sampler", "external")
_KIND_DIRS: dict[CheckpointKind, str] = {"state": STATE_DIR, "sampler": SAMPLER_DIR, "external": EXTERNAL_DIR}

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?P<what>tmp|old|deleting)-[0-9a-f]+")


class CheckpointError(ValueError):
    """A checkpoint cannot be written or loaded: missing, already there, or made for another session."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint's files do not match its manifest (truncated, altered, missing or extra files), or a
    file that matches cannot be parsed."""


@dataclass(frozen=True)
class CheckpointInfo:
    """One complete checkpoint of a run, as `Session.list_checkpoints()` reports it."""

    name: str
    path: Path  # the folder
    kind: (
        CheckpointKind  # "state": save_state (resumable); "sampler": save_weights_for_sampler (adapter
        # only); "external": save_weights_external (the adapter's files, age-encrypted when asked)
    )
    step: int  # the policy's optimizer step when it was saved
    time: float  # unix seconds
    size_bytes: int
    expires_at: float | None = None  # unix seconds; None: kept until deleted
    user_metadata: Mapping[str, str] | None = None
    tinker_path: str | None = None  # set for a remote engine's checkpoints, which have no local folder


def check_name(name: str) -> str:
    """Checkpoint names are one path component of letters, digits, `.`, `_` and `-` that does not start
    with a dot (dot-names are reserved for temporary folders)."""
    if not isinstance(name, str) or not is_name(name):
        raise CheckpointError(
            f"invalid checkpoint name {name!r}: use letters, digits, '.', '_' and '-' (not starting with '.' or '-')"
        )
    return name


def is_name(text: str) -> bool:
    return bool(_NAME.fullmatch(text))


def check_free(target: Path, overwrite: bool) -> None:
    """Refuse to replace an existing checkpoint unless asked to."""
    if target.exists() and not overwrite:
        raise CheckpointError(
            f"a checkpoint named {target.name!r} already exists at {target}: pass overwrite=True to replace it"
        )


def kind_dir(model_dir: Path, kind: CheckpointKind) -> Path:
    return model_dir / _KIND_DIRS[kind]


# ---------------------------------------------------------------------------------------------- writing


def write_file(path: Path, data: bytes) -> None:
    """Write `data` and fsync it: after a crash, a committed checkpoint's files hold their bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def json_bytes(value: Any) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()


def manifest_for(files: Mapping[str, bytes]) -> bytes:
    """The manifest of a set of files: format version, and each file's size and sha256."""
    entries = {
        rel: {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for rel, data in sorted(files.items())
    }
    return json_bytes({"format_version": FORMAT_VERSION, "files": entries})


def write_atomically(target: Path, files: Mapping[str, bytes], overwrite: bool) -> Path:
    """Write a checkpoint folder at `target` with `files` (relative path -> bytes) plus its manifest.

    Either the complete folder appears at `target` or nothing changes: a failure at any point
    (KeyboardInterrupt included) removes the temporary folder and, when replacing, puts the old folder
    back. A kill leaves only dot-named leftovers for `cleanup`.
    """
    check_name(target.name)
    check_free(target, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{secrets.token_hex(4)}"
    aside: Path | None = None
    tmp.mkdir()
    try:
        for rel, data in files.items():
            write_file(tmp / rel, data)
        write_file(tmp / MANIFEST, manifest_for(files))
        for folder in sorted({(tmp / rel).parent for rel in files}, key=lambda p: len(p.parts), reverse=True):
            _fsync_dir(folder)
        if target.exists():
            aside = target.parent / f".{target.name}.old-{secrets.token_hex(4)}"
            target.rename(aside)
        tmp.rename(target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if aside is not None and not target.exists():
            aside.rename(target)
        raise
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    return target


# ---------------------------------------------------------------------------------------------- reading


def require_checkpoint_folder(folder: Path) -> Path:
    """`folder` if it is a complete checkpoint folder (it has a manifest), else a clear error."""
    if not folder.is_dir():
        raise CheckpointError(f"Can't find a valid checkpoint at {str(folder)!r}: no such folder")
    if not (folder / MANIFEST).is_file():
        raise CheckpointError(
            f"No valid checkpoint found in {str(folder)!r}: it has no {MANIFEST} (not a checkpoint folder, "
            "or a save that did not complete)"
        )
    return folder


def parse_json(folder: Path, rel: str, data: bytes) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptCheckpointError(f"{folder / rel} is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{folder / rel} does not hold a JSON object")
    return value


def _files_on_disk(folder: Path) -> list[str]:
    found = []
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink() or not (path.is_file() or path.is_dir()):
            raise CorruptCheckpointError(
                f"{path} is not a regular file or folder; checkpoints hold only those"
            )
        if path.is_file() and rel != MANIFEST:
            found.append(rel)
    return found


def read_verified(folder: Path) -> dict[str, bytes]:
    """Every file of a checkpoint folder (relative path -> bytes) after checking it against the manifest.

    Raises:
        CheckpointError: the folder is missing or has no manifest.
        CorruptCheckpointError: a file is missing, extra, truncated or altered, naming it.
    """
    require_checkpoint_folder(folder)
    manifest = parse_json(folder, MANIFEST, (folder / MANIFEST).read_bytes())
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(
            f"{folder} has checkpoint format {version!r}; this workbench reads format {FORMAT_VERSION} and older"
        )
    entries = manifest.get("files")
    if not isinstance(entries, dict):
        raise CorruptCheckpointError(f"{folder / MANIFEST} lists no files")
    on_disk = _files_on_disk(folder)
    missing = sorted(set(entries) - set(on_disk))
    extra = sorted(set(on_disk) - set(entries))
    if missing:
        raise CorruptCheckpointError(
            f"{folder} is incomplete: {missing[0]} is listed in the manifest but missing"
        )
    if extra:
        raise CorruptCheckpointError(f"{folder} has a file that is not in its manifest: {extra[0]}")
    contents: dict[str, bytes] = {}
    for rel in on_disk:
        entry = entries[rel]
        data = (folder / rel).read_bytes()
        if not isinstance(entry, dict) or len(data) != entry.get("size"):
            size = entry.get("size") if isinstance(entry, dict) else entry
            raise CorruptCheckpointError(
                f"{folder / rel} is truncated or altered: {len(data)} bytes, the manifest says {size}"
            )
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise CorruptCheckpointError(
                f"{folder / rel} is corrupted: its sha256 does not match the manifest"
            )
        contents[rel] = data
    return contents


# ---------------------------------------------------------------------------------------------- listing


def list_checkpoints(model_dir: Path) -> list[CheckpointInfo]:
    """The run's complete checkpoints (state, sampler and external weights), oldest first. Leftovers and expired
    checkpoints are skipped; a complete folder whose info file cannot be read is skipped with a warning
    naming it."""
    infos: list[CheckpointInfo] = []
    for kind in KINDS:
        parent = kind_dir(model_dir, kind)
        if not parent.is_dir():
            continue
        for folder in sorted(parent.iterdir()):
            if folder.name.startswith(".") or not (folder / MANIFEST).is_file():
                continue
            try:
                info = parse_json(folder, INFO_FILE[kind], (folder / INFO_FILE[kind]).read_bytes())
                manifest = parse_json(folder, MANIFEST, (folder / MANIFEST).read_bytes())
                size = (folder / MANIFEST).stat().st_size + sum(
                    int(entry["size"]) for entry in manifest["files"].values()
                )
                expires_at = info.get("expires_at")
                if expires_at is not None and float(expires_at) < time.time():
                    continue
                if expires_at is not None:
                    datetime.fromtimestamp(float(expires_at), UTC)  # a listing shows it as a date
                metadata = {str(k): str(v) for k, v in dict(info.get("user_metadata") or {}).items()}
                for text in (*metadata, *metadata.values()):
                    text.encode("utf-8")  # a listing writes it out
                infos.append(
                    CheckpointInfo(
                        folder.name,
                        folder,
                        kind,
                        int(info["step"]),
                        float(info["saved_at"]),
                        size,
                        None if expires_at is None else float(expires_at),
                        metadata,
                    )
                )
            except (OSError, KeyError, TypeError, ValueError, OverflowError) as error:
                warnings.warn(f"skipping checkpoint {folder}: {error}", RuntimeWarning, stacklevel=2)
    return sorted(infos, key=lambda info: (info.time, info.name))


def delete(model_dir: Path, name: str, kind: CheckpointKind) -> None:
    """Delete one checkpoint. It is renamed to a leftover name first, so a deletion that is cut short
    never leaves a half folder that looks complete."""
    folder = kind_dir(model_dir, kind) / check_name(name)
    if not folder.is_dir():
        raise CheckpointError(f"this run has no {kind} checkpoint named {name!r} (looked in {folder.parent})")
    doomed = folder.parent / f".{name}.deleting-{secrets.token_hex(4)}"
    folder.rename(doomed)
    shutil.rmtree(doomed)


def _expired(folder: Path, kind: CheckpointKind) -> bool:
    try:
        expires_at = parse_json(folder, INFO_FILE[kind], (folder / INFO_FILE[kind]).read_bytes()).get(
            "expires_at"
        )
    except (OSError, CheckpointError):
        return False
    return expires_at is not None and float(expires_at) < time.time()


def cleanup(model_dir: Path) -> list[Path]:
    """Remove the leftovers of interrupted saves and deletions, and checkpoints whose time to live has
    run out; returns what was removed. An old folder set aside by an interrupted overwrite whose
    replacement never arrived is moved back instead."""
    removed: list[Path] = []
    for kind in KINDS:
        parent = kind_dir(model_dir, kind)
        if parent.is_dir():
            for folder in sorted(parent.iterdir()):
                if not folder.name.startswith(".") and folder.is_dir() and _expired(folder, kind):
                    delete(model_dir, folder.name, kind)
                    removed.append(folder)
    for kind in KINDS:
        parent = kind_dir(model_dir, kind)
        if not parent.is_dir():
            continue
        for path in sorted(parent.iterdir()):
            match = _LEFTOVER.fullmatch(path.name)
            if match is None:
                continue
            target = parent / match["name"]
            if match["what"] == "old" and not target.exists() and (path / MANIFEST).is_file():
                path.rename(target)
                continue
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
            removed.append(path)
    return removed
