"""Checkpoints across processes: a resumed run is bit-identical to the uninterrupted one, and a save
killed mid-write leaves the previous checkpoint intact."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import workbench as wb
from tests.checkpoint_child import continue_run, train_step

CHILD = Path(__file__).resolve().parents[2] / "checkpoint_child.py"


def _child(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, str(CHILD), *args], env=env, capture_output=True, text=True, timeout=300
    )


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """N steps, save, K steps (this process) == load in a fresh process, K steps: same losses, same
    adapter tensors bit for bit, same sampled tokens at temperature 1, same global RNG draws. The fresh
    process finds the checkpoint by its tinker:// path (the run lives under the runs root it shares)."""
    n_steps, k_steps = 3, 3
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=7) as sess:
        for _ in range(n_steps):
            train_step(sess)
        path = sess.policy.save_state("mid").result().path
        assert (
            path == f"tinker://{sess.model_id}/weights/mid"
            and sess.model_dir == tmp_path / "runs" / sess.model_id
        )
        continue_run(sess, k_steps, tmp_path / "uninterrupted")
    done = _child("resume", path, str(tmp_path / "resumed"), str(k_steps))
    assert done.returncode == 0, done.stderr[-3000:]

    expected = json.loads((tmp_path / "uninterrupted" / "result.json").read_text())
    resumed = json.loads((tmp_path / "resumed" / "result.json").read_text())
    assert resumed == expected
    assert expected["step"] == n_steps + k_steps and len(set(map(tuple, expected["tokens"]))) > 1
    a = safetensors.torch.load_file(tmp_path / "uninterrupted" / "adapter.safetensors")
    b = safetensors.torch.load_file(tmp_path / "resumed" / "adapter.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_save_killed_mid_write_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    model_dir = tmp_path / "run"
    killed = _child("killed-save", str(model_dir))
    assert killed.returncode == -9, killed.stderr[-3000:]
    names = sorted(p.name for p in (model_dir / "checkpoints").iterdir())
    assert len(names) == 2 and names[0].startswith(".b.tmp-") and names[1] == "a"
    with wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=model_dir) as sess:
        assert [info.name for info in sess.list_checkpoints()] == ["a"]
        sess.load_state("a")
        assert sess.step == 1
        assert [p.name for p in sess.cleanup_checkpoints()] == [names[0]]
        assert sorted(p.name for p in (model_dir / "checkpoints").iterdir()) == ["a"]
