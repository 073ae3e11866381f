"""workbench/__init__.py: the public names are declared once, each imports, and `import workbench` stays
light until a name is used."""

from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import workbench as wb


def test_every_public_name_imports_from_the_module_that_declares_it() -> None:
    declared = [name for names in wb._PUBLIC.values() for name in names]
    assert len(declared) == len(set(declared)), "a public name is declared twice"
    assert sorted([*declared, *wb._PUBLIC_MODULES]) == wb.__all__
    for module, names in wb._PUBLIC.items():
        for name in names:
            value = getattr(wb, name)
            assert value is getattr(sys.modules[module], name), (module, name)
    assert set(wb.__all__) <= set(dir(wb))


def test_every_public_class_and_function_is_declared_under_the_module_that_defines_it() -> None:
    """A name declared under a module that only imports it (a class moved, its entry left behind)
    still imports, so only its `__module__` shows the drift."""
    misplaced = {
        name: (module, value.__module__)
        for module, names in wb._PUBLIC.items()
        for name in names
        if isinstance(value := getattr(importlib.import_module(module), name), type)
        or inspect.isfunction(value)
        if value.__module__ != module
    }
    assert not misplaced, misplaced


def test_import_workbench_loads_no_heavy_library() -> None:
    code = (
        "import sys, workbench\n"
        "heavy = [m for m in ('torch', 'transformers', 'peft', 'ipywidgets', 'matplotlib', 'wandb') "
        "if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "workbench.LoraConfig\n"
        "assert 'ipywidgets' not in sys.modules and 'wandb' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
