"""External weights: a model's adapter as the files other tools read, encrypted to age recipients on
request (the SDK's `save_weights_external`).

The files are peft's `adapter_config.json` and `adapter_model.safetensors` (what tinker-cookbook's
`weights.build_lora_adapter` / `build_hf_model`, peft and vLLM read), in a checkpoint folder
`<model dir>/external_weights/<name>` beside `external.json` (step, time, expiry, base model) and the
manifest. With `age_encryption_recipients` (age's X25519 `age1...` keys or SSH public keys, at most
`MAX_RECIPIENTS`) each file is encrypted to all of them (age v1, https://age-encryption.org/v1, with
`pyrage`) and stored with the `.age` suffix, so only the holders of the identities can read it: the
cookbook's `weights.download` encrypts to a key it makes for one download and decrypts what it fetches.
`downloadable_files` lists what a client downloads: the adapter's files, never our bookkeeping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyrage

from workbench.storage.checkpoint_store import INFO_FILE, MANIFEST

MAX_RECIPIENTS = 10
AGE_SUFFIX = ".age"
BOOKKEEPING = {INFO_FILE["external"], MANIFEST}


def parse_recipients(recipients: Sequence[str] | None) -> list[Any]:
    """The age recipients a request names, parsed (a clear `ValueError` for a bad one); [] for none."""
    if recipients is None:
        return []
    if isinstance(recipients, str) or not isinstance(recipients, Sequence):
        raise ValueError(f"age_encryption_recipients must be a list of strings, got {recipients!r}")
    if not 1 <= len(recipients) <= MAX_RECIPIENTS:
        raise ValueError(
            f"age_encryption_recipients: give 1 to {MAX_RECIPIENTS} recipients, got {len(recipients)}"
        )
    parsed = []
    for position, text in enumerate(recipients):
        if not isinstance(text, str):
            raise ValueError(f"age_encryption_recipients[{position}] must be a string, got {text!r}")
        try:
            if text.startswith("age1"):
                parsed.append(pyrage.x25519.Recipient.from_str(text))
            else:
                parsed.append(pyrage.ssh.Recipient.from_str(text))
        except (pyrage.RecipientError, ValueError) as error:
            shown = text if len(text) <= 80 else f"{text[:77]}..."
            raise ValueError(
                f"age_encryption_recipients[{position}] {shown!r} is neither an age X25519 key (age1...) nor "
                f"an SSH public key: {error}"
            ) from None
    return parsed


def external_files(adapter_files: Mapping[str, bytes], recipients: Sequence[Any]) -> dict[str, bytes]:
    """The adapter's files as they are stored: as they are, or each encrypted to every recipient and
    named with the `.age` suffix."""
    if not recipients:
        return dict(adapter_files)
    return {name + AGE_SUFFIX: pyrage.encrypt(data, list(recipients)) for name, data in adapter_files.items()}


def downloadable_files(folder: Path) -> list[str]:
    """The files of an external weights folder a client downloads (relative paths, sorted)."""
    return sorted(
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if path.is_file() and path.relative_to(folder).as_posix() not in BOOKKEEPING
    )
