"""The docs that list the code's parts: tests/README.md names every test file, docs/architecture.md's
layer summary states the import contracts of pyproject.toml and its tree names every module, the README's
tree every package, and a package's `__init__.py` that names its modules (its room list) names all of
them. Each list is written by hand, so each is checked here against what it lists; the README is held to
its front-door budget."""

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
    """The test files tests/README.md's tree names, as paths under tests/."""
    tree = _tree((ROOT / "tests/README.md").read_text(), "# Tests")
    return {path for path in tree if path.rsplit("/", 1)[-1].startswith("test_")}


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


README_BUDGET_BYTES = 12 * 1024
ROOM = re.compile(r"`([\w.]+/|[\w.]+\.py)`")


def _tree(text: str, after: str) -> set[str]:
    """The entries of the tree in the first code block after the line `after`, as paths (`engine/local/`,
    `engine/local/sample.py`).

    An entry sits at most one level below the folder above it (two spaces per level) and is followed by
    two spaces or the line's end; deeper lines continue a description."""
    folders: list[str] = []
    listed = set()
    for line in _code_block(text, after):
        entry = TREE_ENTRY.match(line)
        depth = len(entry["indent"]) // 2 if entry else 0
        if entry is None or len(entry["indent"]) % 2 or depth > len(folders):
            continue
        del folders[depth:]
        path = "".join(folders) + entry["name"]
        listed.add(path)
        if entry["name"].endswith("/"):
            folders.append(entry["name"])
    return listed


def _modules_and_packages(root: Path) -> set[str]:
    """Every module (but `__init__.py`) and package under `root`, as paths relative to its parent."""
    return {
        path.relative_to(root.parent).as_posix() + ("/" if path.is_dir() else "")
        for path in [root, *root.rglob("*")]
        if (path.is_dir() and (path / "__init__.py").exists())
        or (path.suffix == ".py" and path.name != "__init__.py")
    }


def test_architecture_tree_names_every_module() -> None:
    listed = {
        entry
        for entry in _tree((ROOT / "docs/architecture.md").read_text(), "## Every module")
        if entry.startswith("workbench/") and not entry.endswith("/__init__.py")
    }
    present = _modules_and_packages(ROOT / "workbench")
    assert not present - listed, f"docs/architecture.md's tree does not name {sorted(present - listed)}"
    assert not listed - present, (
        f"docs/architecture.md's tree names what is not there: {sorted(listed - present)}"
    )


def test_readme_tree_names_every_package() -> None:
    tree = _tree((ROOT / "README.md").read_text(), "## Where things live")
    listed = {entry for entry in tree if entry.startswith("workbench/") and entry.endswith("/")}
    present = {entry for entry in _modules_and_packages(ROOT / "workbench") if entry.endswith("/")}
    assert not present - listed, f"the README's tree does not name {sorted(present - listed)}"
    assert not listed - present, f"the README's tree names what is not there: {sorted(listed - present)}"


def test_readme_fits_its_budget() -> None:
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_BUDGET_BYTES, (
        f"README.md is {size} bytes; move detail into docs/ (budget {README_BUDGET_BYTES})"
    )


def _room_lists() -> dict[Path, set[str]]:
    """The packages under workbench/ whose `__init__.py` docstring names any of its rooms (`name.py` or
    `name/` in backquotes), with the rooms it names."""
    lists = {}
    for init in sorted((ROOT / "workbench").rglob("__init__.py")):
        docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
        if named := set(ROOM.findall(docstring)):
            lists[init.parent] = named
    return lists


def test_every_room_list_names_every_room() -> None:
    lists = _room_lists()
    assert {package.relative_to(ROOT).as_posix() for package in lists} >= {
        "workbench/engine",
        "workbench/engine/local",
        "workbench/engine/remote",
        "workbench/engine/samplers",
        "workbench/server",
    }
    wrong = {}
    for package, named in lists.items():
        rooms = {
            f"{path.name}/" if path.is_dir() else path.name
            for path in package.iterdir()
            if (path.is_dir() and (path / "__init__.py").exists())
            or (path.suffix == ".py" and path.name != "__init__.py")
        }
        if rooms != named:
            wrong[f"{package.relative_to(ROOT)}/__init__.py"] = {
                "not named": sorted(rooms - named),
                "named, not there": sorted(named - rooms),
            }
    assert not wrong, wrong
