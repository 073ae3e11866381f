"""workbench/__init__.py: the public names are declared once, each imports, and `import workbench` stays
light until a name is used."""

from __future__ import annotations

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
