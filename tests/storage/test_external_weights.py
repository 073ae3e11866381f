"""storage/external_weights.py: age recipients parsed (a clear error for a bad one), files encrypted to
every recipient and named `.age`, and only the adapter's files offered for download."""

from __future__ import annotations

from pathlib import Path

import pyrage
import pytest

from workbench.storage import checkpoint_store
from workbench.storage.external_weights import (
    MAX_RECIPIENTS,
    downloadable_files,
    external_files,
    parse_recipients,
)

FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"\x00weights"}


def test_files_are_encrypted_to_every_recipient_and_only_they_can_read_them() -> None:
    alice, bob, eve = (pyrage.x25519.Identity.generate() for _ in range(3))
    recipients = parse_recipients([str(alice.to_public()), str(bob.to_public())])
    sealed = external_files(FILES, recipients)
    assert sorted(sealed) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
    for identity in (alice, bob):
        assert (
            pyrage.decrypt(sealed["adapter_model.safetensors.age"], [identity])
            == FILES["adapter_model.safetensors"]
        )
    with pytest.raises(pyrage.DecryptError):
        pyrage.decrypt(sealed["adapter_config.json.age"], [eve])
    assert external_files(FILES, parse_recipients(None)) == FILES  # none asked: the files as they are


@pytest.mark.parametrize(
    ("recipients", "message"),
    [
        ("age1abc", "a list of strings"),
        ([], "give 1 to"),
        (["x"] * (MAX_RECIPIENTS + 1), "give 1 to"),
        ([7], "must be a string"),
        (["age1notakey"], "neither an age X25519 key"),
        (["ssh-ed25519 AAAA"], "neither an age X25519 key"),
    ],
)
def test_a_bad_recipient_is_refused_by_position(recipients: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_recipients(recipients)  # type: ignore[arg-type]


def test_downloads_are_the_adapter_files_alone(tmp_path: Path) -> None:
    folder = checkpoint_store.write_atomically(
        tmp_path / "external_weights" / "final",
        {**FILES, checkpoint_store.INFO_FILE["external"]: b"{}"},
        overwrite=False,
    )
    assert downloadable_files(folder) == sorted(FILES)
