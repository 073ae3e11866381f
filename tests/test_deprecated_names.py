"""Names that were renamed still work, with a DeprecationWarning, for code written against them."""

# this file is about the old names
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

import workbench as wb
from workbench.cli import _parser
from workbench.engine.local import checkpoint_files

OLD_CHECKPOINT = Path(__file__).parent / "assets" / "checkpoint-0.1.0"


@pytest.mark.parametrize(
    ("module", "old", "new"),
    [
        ("workbench.engine.interface", "RunStatus", "ModelStatus"),
        ("workbench.engine.config", "SessionConfig", "ModelConfig"),
    ],
)
def test_an_old_class_name_warns_and_is_the_new_class(module: str, old: str, new: str) -> None:
    loaded = importlib.import_module(module)
    with pytest.warns(DeprecationWarning, match=f"{old} is now {new}"):
        assert getattr(loaded, old) is getattr(loaded, new)
    assert old in wb.__all__ and new in wb.__all__


def test_run_dir_is_the_old_name_of_model_dir(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match="run_dir argument is now model_dir"):
        sess = wb.Session("tiny", wb.LoraConfig(rank=2), run_dir=tmp_path / "old", wandb=False)
    with sess:
        assert sess.model_dir == (tmp_path / "old").absolute()
        with pytest.warns(DeprecationWarning, match="Session.run_dir is now Session.model_dir"):
            assert sess.run_dir == sess.model_dir
        with pytest.warns(DeprecationWarning, match="run_dir is now model_dir"):
            assert sess.engine.model_status(sess.model_id).run_dir == sess.model_dir
    with pytest.raises(TypeError, match="not both"):
        wb.Session("tiny", model_dir=tmp_path / "a", run_dir=tmp_path / "b", wandb=False)


def test_the_serve_command_still_takes_run_dir() -> None:
    parser = _parser()
    assert parser.parse_args(["serve", "--run-dir", "x"]).model_dir == "x"
    assert parser.parse_args(["serve", "--model-dir", "y"]).model_dir == "y"


def test_a_saved_states_run_id_is_the_old_name_of_its_model_id() -> None:
    saved = checkpoint_files.read(OLD_CHECKPOINT)  # its config.json names the model under "run_id"
    with pytest.warns(DeprecationWarning, match="SavedState.run_id is now SavedState.model_id"):
        assert saved.run_id == saved.model_id == "run"
