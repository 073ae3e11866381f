"""The engine tests' shared fixtures."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import workbench as wb


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[wb.Session, wb.Session]]:
    """(two ranks, one device), each with the same rank-4 LoRA, seed 0, no W&B run: a module that
    compares several devices against one makes the pair once."""
    one = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False)
    try:
        two = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, devices=2)
    except BaseException:
        one.close()
        raise
    yield two, one
    two.close()
    one.close()
