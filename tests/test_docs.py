"""The docs that list the code's parts: tests/README.md names every test file, docs/architecture.md's
layer summary states the import contracts of pyproject.toml, and `workbench/engine/__init__.py` names
every room of the engine. Each list is written by hand, so each is checked here against what it lists."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE_ENTRY = re.compile(r"(?P<indent> *)(?P<name>[\w.]+/|[\w.]+\.py)(?: |$)")


def _code_block(text: str, after: str) -> list[str]:
    """The lines of the first fenced code block after the line `after`."""
    lines = text.splitlines()
    start = lines.index("```", lines.index(after)) + 1
    return lines[start : lines.index("```", start)]


def _readme_test_files() -> set[str]:
    """The test files tests/README.md's tree names, as paths under tests/.

    An entry sits at most one level below the folder above it (two spaces per level); the deeper lines
    continue a description."""
    folders: list[str] = []
    listed = set()
    for line in _code_block((ROOT / "tests/README.md").read_text(), "# Tests"):
        entry = TREE_ENTRY.match(line)
        if entry is None or len(entry["indent"]) % 2 or len(entry["indent"]) // 2 > len(folders):
            continue
        del folders[len(entry["indent"]) // 2 :]
        if entry["name"].endswith("/"):
            folders.append(entry["name"])
        elif entry["name"].startswith("test_"):
            listed.add("".join(folders) + entry["name"])
    return listed


def test_tests_readme_names_every_test_file() -> None:
    present = {path.relative_to(ROOT / "tests").as_posix() for path in (ROOT / "tests").rglob("test_*.py")}
    listed = _readme_test_files()
    assert not present - listed, f"test files missing from tests/README.md: {sorted(present - listed)}"
    assert not listed - present, f"tests/README.md lists files that do not exist: {sorted(listed - present)}"


def _layer(text: str) -> str:
    """A layer written one way: its modules in order of name, joined by its separator (`|`: independent,
    `:`: may import each other)."""
    separator = ":" if ":" in text else "|"
    return f" {separator} ".join(sorted(name.strip() for name in text.split(separator)))


def _contract_layers() -> dict[str, list[str]]:
    """Each layers contract of pyproject.toml, by container as the summary names it (`workbench` for the
    package, the rest relative to it)."""
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = {}
    for contract in (contract for contract in contracts if contract["type"] == "layers"):
        for container in contract["containers"]:
            name = "workbench" if container == "workbench" else container.removeprefix("workbench.")
            layers[name] = [_layer(layer) for layer in contract["layers"]]
    return layers


def _summary_layers() -> dict[str, list[str]]:
    """docs/architecture.md's layer summary, read as the contracts are written.

    A line starting with a name begins a container; its text runs to the first gap of two spaces (what
    follows describes it). A line starting with `>` continues with a lower layer, one starting with `|`
    or `:` continues the layer before, and any other line starts the next layer down."""
    text = (ROOT / "docs/architecture.md").read_text()
    texts: dict[str, list[str]] = {}
    container = ""
    for line in _code_block(text, "## Layers, checked"):
        if not line.strip():
            continue
        if not line.startswith(" "):
            container, line = line.split(maxsplit=1)
            texts[container] = []
        part = re.split(r" {2,}", line.strip())[0]
        continues = part.startswith((">", "|", ":")) or not texts[container]
        texts[container].append(part if continues else "> " + part)
    return {name: [_layer(layer) for layer in " ".join(parts).split(">")] for name, parts in texts.items()}


def test_architecture_layer_summary_states_the_import_contracts() -> None:
    contracts, summary = _contract_layers(), _summary_layers()
    assert sorted(summary) == sorted(contracts), "docs/architecture.md's layer summary names other containers"
    differing = {
        container: {"docs/architecture.md": summary[container], "pyproject.toml": layers}
        for container, layers in contracts.items()
        if summary[container] != layers
    }
    assert not differing, differing


def test_engine_room_list_names_every_room() -> None:
    engine = ROOT / "workbench/engine"
    rooms = {
        f"{path.name}/" if path.is_dir() else path.name
        for path in engine.iterdir()
        if (path.is_dir() and (path / "__init__.py").exists())
        or (path.suffix == ".py" and path.name != "__init__.py")
    }
    docstring = ast.get_docstring(ast.parse((engine / "__init__.py").read_text())) or ""
    named = set(re.findall(r"`([\w.]+/|[\w.]+\.py)`", docstring))
    assert not rooms - named, f"workbench/engine/__init__.py does not name {sorted(rooms - named)}"
    assert not named - rooms, f"workbench/engine/__init__.py names what is not there: {sorted(named - rooms)}"
