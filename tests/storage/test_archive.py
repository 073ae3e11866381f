"""Checkpoint archives: a round trip between machines, and hostile archives refused before any write."""

from __future__ import annotations

import io
import re
import tarfile
from pathlib import Path

import pytest

import workbench as wb


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("archive")
    with wb.Session("tiny", wb.LoraConfig(rank=2), model_dir=root / "run") as sess:
        return Path(sess.policy.save_state("step-0").result().folder)


@pytest.mark.parametrize("suffix", [".tar", ".tar.gz", ".tgz"])
def test_export_then_import_gives_the_same_checkpoint(checkpoint: Path, tmp_path: Path, suffix: str) -> None:
    tar_path = wb.export_archive(checkpoint, tmp_path / f"run{suffix}")
    if suffix != ".tar":
        assert tar_path.read_bytes()[:2] == b"\x1f\x8b"  # gzip
    folder = wb.import_archive(tar_path, tmp_path / "dest")
    assert folder == tmp_path / "dest" / "step-0"
    files = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*"))
    assert sorted(p.relative_to(folder) for p in folder.rglob("*")) == files
    assert all(
        (folder / rel).read_bytes() == (checkpoint / rel).read_bytes()
        for rel in files
        if (checkpoint / rel).is_file()
    )
    assert [p.name for p in (tmp_path / "dest").iterdir()] == ["step-0"]  # no temporary folder left
    with pytest.raises(wb.CheckpointError, match="already exists"):
        wb.import_archive(tar_path, tmp_path / "dest")
    with wb.Session.from_checkpoint(folder, model_dir=tmp_path / "resumed") as resumed:
        assert resumed.step == 0
    with pytest.raises(ValueError, match=r"\.tar, \.tar\.gz or \.tgz"):
        wb.export_archive(checkpoint, tmp_path / "run.zip")


def _archive(tmp_path: Path, *members: tuple[tarfile.TarInfo, bytes | None]) -> Path:
    path = tmp_path / "hostile.tar"
    with tarfile.open(path, "w") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _special(name: str, kind: bytes, link: str = "") -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = link
    return info, None


@pytest.mark.parametrize(
    ("members", "message"),
    [
        ([_file("/etc/evil")], "absolute path"),
        ([_file("ckpt/../../evil")], r"'\.\.'"),
        ([_file("ckpt/a"), _special("ckpt/link", tarfile.SYMTYPE, "/etc/passwd")], "is a link"),
        ([_file("ckpt/a"), _special("ckpt/hard", tarfile.LNKTYPE, "ckpt/a")], "is a link"),
        ([_special("ckpt/dev", tarfile.CHRTYPE)], "not a regular file"),
        ([_special("ckpt/blk", tarfile.BLKTYPE)], "not a regular file"),
        ([_special("ckpt/fifo", tarfile.FIFOTYPE)], "not a regular file"),
        ([_file("one/a"), _file("two/b")], "holds one folder"),
    ],
)
def test_hostile_archives_are_refused_before_any_write(tmp_path: Path, members: list, message: str) -> None:
    path = _archive(tmp_path, *members)
    dest = tmp_path / "dest"
    with pytest.raises(wb.UnsafeArchiveError, match=message):
        wb.import_archive(path, dest)
    assert not dest.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hostile.tar"]


def test_an_archive_that_fails_its_manifest_leaves_nothing(checkpoint: Path, tmp_path: Path) -> None:
    path = tmp_path / "tampered.tar"
    with tarfile.open(path, "w") as tar:
        for file in sorted(checkpoint.rglob("*")):
            arcname = f"step-0/{file.relative_to(checkpoint).as_posix()}"
            if file.name == "adapter_model.safetensors":
                data = file.read_bytes()
                data = data[:-1] + bytes([data[-1] ^ 1])
                info = tar.gettarinfo(file, arcname)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.add(file, arcname, recursive=False)
    with pytest.raises(
        wb.CorruptCheckpointError, match=re.escape("policy/adapter_model.safetensors is corrupted")
    ):
        wb.import_archive(path, tmp_path / "dest")
    assert list((tmp_path / "dest").iterdir()) == []
