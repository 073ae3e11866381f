"""The executed renderings of the tutorials in `docs/tutorials/` (`make docs-tutorials`): each one an HTML
page nbconvert wrote from a run of the notebook, stamped with a digest of the notebook's cells, so a
test can tell a rendering that no longer matches its notebook (`tests/promises/test_tutorial_renderings.py`).

The digest is SHA-256 over each cell's type and source, in order: outputs, execution counts and metadata
are left out, since the committed notebooks carry none and a rendering carries them all.

    python -m tests.tutorial_renderings stamp docs/tutorials 01_quickstart 02_supervised_finetuning
"""

from __future__ import annotations

import hashlib
import re
import sys
from pathlib import Path

import nbformat

STAMP = "<!-- workbench tutorial cells sha256: {digest} -->\n"
STAMP_PATTERN = re.compile(r"<!-- workbench tutorial cells sha256: ([0-9a-f]{64}) -->")


def cells_digest(notebook: Path) -> str:
    """SHA-256 over the notebook's cell types and sources, in order."""
    digest = hashlib.sha256()
    for cell in nbformat.read(notebook, as_version=4).cells:
        digest.update(cell.cell_type.encode() + b"\0" + cell.source.encode() + b"\0")
    return digest.hexdigest()


def stamped_digest(rendering: Path) -> str | None:
    """The digest a rendering was stamped with, None if it carries none."""
    found = STAMP_PATTERN.search(rendering.read_text(encoding="utf-8"))
    return None if found is None else found.group(1)


def stamp(rendering: Path, notebook: Path) -> None:
    """Append the notebook's digest to its rendering (once)."""
    text = STAMP_PATTERN.sub("", rendering.read_text(encoding="utf-8"))
    rendering.write_text(
        text.rstrip("\n") + "\n" + STAMP.format(digest=cells_digest(notebook)), encoding="utf-8"
    )


def main(arguments: list[str]) -> None:
    command, folder, *names = arguments
    if command != "stamp":
        raise SystemExit(f"unknown command {command!r}: stamp is the one")
    notebooks = Path(__file__).resolve().parents[1] / "notebooks"
    for name in names:
        stamp(Path(folder) / f"{name}.html", notebooks / f"{name}.ipynb")


if __name__ == "__main__":
    main(sys.argv[1:])
