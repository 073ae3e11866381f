"""What a model folder says of how its model was trained and what its user noted about it.

Two small JSON files beside `run.json` (which says what the model is):

- `settings.json`: the training settings last used, per role (`policy`, `critic`): the `AdamParams`
  of its latest `optim_step` and the loss (name and config) of its latest `forward_backward`. The
  engine writes it when a setting changes (a learning-rate schedule: at every step; a fixed recipe:
  once), so a finished run says what it trained with without its notebook. Written atomically (a
  reader sees the old file or the new one) but not fsynced: it describes, nothing is restored from it.
- `notes.json`: the user's `notes` (free text) and `tags` (short labels), W&B's words for them, set
  with `sess.describe(notes=..., tags=...)`.

Both are read by the runs view (`workbench.storage.run_listing`), cheaply: no model is loaded.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

SETTINGS_FILE = "settings.json"
NOTES_FILE = "notes.json"


def _write_json(path: Path, value: Any) -> None:
    temporary = path.parent / f".{path.name}.tmp-{secrets.token_hex(4)}"
    temporary.write_text(json.dumps(value, indent=2) + "\n", encoding="utf-8")
    os.replace(temporary, path)


def _read_json(path: Path) -> dict[str, Any]:
    """The file's object; {} when it is missing or not a JSON object (a description is never a reason
    for a listing to fail)."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


class RunSettings:
    """The settings a model trains with, written to its folder's `settings.json` when one changes."""

    def __init__(self, model_dir: Path) -> None:
        self.path = model_dir / SETTINGS_FILE
        self._lock = threading.Lock()  # training calls of several client threads note their settings
        self._settings: dict[str, dict[str, Any]] = read_settings(model_dir)

    def note(self, role: str, key: str, value: Mapping[str, Any]) -> None:
        """Say that `role` trains with `value` for `key` (`"adam_params"`, `"loss"`); the file is
        rewritten only when that changes it."""
        value = dict(value)
        with self._lock:
            if self._settings.get(role, {}).get(key) == value:
                return
            self._settings.setdefault(role, {})[key] = value
            if self.path.parent.is_dir():
                _write_json(self.path, self._settings)


def read_settings(model_dir: Path) -> dict[str, dict[str, Any]]:
    """`settings.json` of a model folder: `{role: {"adam_params": {...}, "loss": {...}}}`, {} if none."""
    return _read_json(model_dir / SETTINGS_FILE)


def write_notes(model_dir: Path, notes: str, tags: Sequence[str]) -> None:
    """Write the folder's `notes.json`."""
    if not isinstance(notes, str):
        raise ValueError(f"notes must be a string, got {notes!r}")
    if isinstance(tags, str) or not all(isinstance(tag, str) and tag for tag in tags):
        raise ValueError(f"tags must be a list of non-empty strings, got {tags!r}")
    _write_json(model_dir / NOTES_FILE, {"notes": notes, "tags": list(dict.fromkeys(tags))})


def read_notes(model_dir: Path) -> tuple[str, list[str]]:
    """The folder's notes and tags ("" and [] when it has none)."""
    found = _read_json(model_dir / NOTES_FILE)
    notes = found.get("notes")
    tags = found.get("tags")
    return (
        notes if isinstance(notes, str) else "",
        [tag for tag in tags if isinstance(tag, str)] if isinstance(tags, list) else [],
    )
