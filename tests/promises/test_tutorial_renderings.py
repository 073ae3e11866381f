"""docs/tutorials/: an executed rendering of every tutorial (`make docs-tutorials`), each still the
rendering of its notebook as committed (its stamped cell digest equals the notebook's), with the
outputs a run leaves (nbconvert stops at a cell that raises, so a rendering is of a whole run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.tutorial_renderings import cells_digest, stamped_digest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("notebook", NOTEBOOKS, ids=lambda p: p.stem)
def test_each_tutorial_has_a_current_executed_rendering(notebook: Path) -> None:
    rendering = ROOT / "docs" / "tutorials" / f"{notebook.stem}.html"
    assert rendering.is_file(), f"{rendering.name} is missing: make docs-tutorials TUTORIALS={notebook.stem}"
    assert stamped_digest(rendering) == cells_digest(notebook), (
        f"{rendering.name} renders an older {notebook.name}: make docs-tutorials TUTORIALS={notebook.stem}"
    )
    assert "jp-OutputArea-output" in rendering.read_text(encoding="utf-8")  # executed: outputs are there
