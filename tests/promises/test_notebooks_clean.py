"""The committed tutorials carry no outputs, execution counts or widget state (CI executes them fresh)."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_the_tutorials_are_there() -> None:
    names = [p.name for p in NOTEBOOKS]
    assert names == [
        "01_quickstart.ipynb",
        "02_supervised_finetuning.ipynb",
        "03_sampling_and_logprobs.ipynb",
        "04_rl_with_importance_sampling.ipynb",
        "05_ppo_with_critic.ipynb",
        "06_checkpoints_and_resume.ipynb",
        "07_custom_losses.ipynb",
        "08_tinker_cookbook.ipynb",
        "09_serving_tinker.ipynb",
        "10_remote_engine.ipynb",
        "11_distillation.ipynb",
        "12_evaluating_with_lm_eval.ipynb",
        "13_rl_with_an_llm_grader.ipynb",
        "14_sweeps.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_is_committed_clean(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    nbformat.validate(notebook)
    assert "widgets" not in notebook.metadata, "widget state is saved in the notebook metadata"
    for index, cell in enumerate(notebook.cells):
        if cell.cell_type != "code":
            continue
        assert cell.outputs == [], f"cell {index} has saved outputs"
        assert cell.execution_count is None, f"cell {index} has an execution count"
    assert any("assert" in cell.source for cell in notebook.cells if cell.cell_type == "code"), (
        "the lesson's claim is not asserted"
    )
