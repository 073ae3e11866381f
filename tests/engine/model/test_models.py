"""Built-in models and LoRA placement."""

from __future__ import annotations

import hashlib
import json
import threading

import pytest
import torch
import transformers

import workbench as wb
from workbench.engine.local import engine as engine_module
from workbench.engine.model.base_model import lora_target_modules
from workbench.engine.model.builtin_models import (
    TINY_VERSION,
    TINY_WRITERS,
    _build_tiny,
    _folder_for,
    tiny_base_model_dir,
    tiny_record,
    writer_versions,
)


def _folder_digest(folder) -> dict[str, str]:
    return {
        p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()
    }


def test_tiny_builds_identically_and_has_about_200k_parameters(tmp_path) -> None:
    _build_tiny(tmp_path)
    cached = tiny_base_model_dir()
    record = json.loads((cached / "workbench_model.json").read_text())
    assert record == tiny_record() and record["written_by"]["transformers"] == transformers.__version__
    assert _folder_digest(tmp_path) == {
        name: digest for name, digest in _folder_digest(cached).items() if name != "workbench_model.json"
    }
    with wb.Session("tiny", wb.LoraConfig(rank=1)) as sess:
        count = sum(
            p.numel()
            for n, p in sess.engine.torch_model.get_base_model().named_parameters()
            if "lora_" not in n
        )
        assert 150_000 <= count <= 250_000
        assert sess.tokenizer.chat_template is not None
        text = "Hello world, 17 + 25 = 42"
        assert sess.tokenizer.decode(sess.tokenizer(text).input_ids) == text


def _write_other_environments_tiny(folder, transformers_version: str) -> None:
    """A tiny folder as another environment wrote it: its own config and record, no weights we wrote."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(
        json.dumps({"model_type": "llama", "transformers_version": transformers_version})
    )
    written_by = {**writer_versions(TINY_WRITERS), "transformers": transformers_version}
    record = {"alias": "tiny", "version": TINY_VERSION, "written_by": written_by}
    (folder / "workbench_model.json").write_text(json.dumps(record))


def test_a_cached_tiny_written_by_another_environment_is_rebuilt_not_trusted(tmp_path, monkeypatch) -> None:
    """What `~/.cache/workbench` held on a fresh clone (a tiny folder from transformers 5.24 against the
    lock's 5.23): under this environment's name it is rebuilt, under its own name it is left alone."""
    expected = _folder_digest(tiny_base_model_dir())
    monkeypatch.setenv("WORKBENCH_CACHE", str(tmp_path / "cache"))
    ours = _folder_for(f"tiny-v{TINY_VERSION}", writer_versions(TINY_WRITERS))
    theirs = _folder_for(f"tiny-v{TINY_VERSION}", {**writer_versions(TINY_WRITERS), "transformers": "0.0.1"})
    _write_other_environments_tiny(ours, "0.0.1")
    _write_other_environments_tiny(theirs, "0.0.1")
    theirs_before = _folder_digest(theirs)

    assert tiny_base_model_dir() == ours
    assert _folder_digest(ours) == expected
    assert json.loads((ours / "workbench_model.json").read_text()) == tiny_record()
    assert _folder_digest(theirs) == theirs_before
    assert sorted(path.name for path in ours.parent.iterdir() if not path.name.endswith(".lock")) == sorted(
        [ours.name, theirs.name]
    ), "the stale folder and the build's temporary folder are removed"


@pytest.mark.parametrize(
    ("lora", "expected"),
    [
        (
            wb.LoraConfig(rank=2),
            {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"},
        ),
        (
            wb.LoraConfig(rank=2, train_mlp=False, train_unembed=False),
            {"q_proj", "k_proj", "v_proj", "o_proj"},
        ),
        (wb.LoraConfig(rank=2, train_attn=False, train_unembed=False), {"gate_proj", "up_proj", "down_proj"}),
        (wb.LoraConfig(rank=2, train_attn=False, train_mlp=False), {"lm_head"}),
    ],
)
def test_lora_targets_follow_the_config(lora: wb.LoraConfig, expected: set[str]) -> None:
    with wb.Session("tiny", lora) as sess:
        assert set(lora_target_modules(sess.base_info.linear_layers, lora)) == expected
        adapted = {
            n.split(".lora_")[0].split(".")[-1]
            for n, _ in sess.engine.torch_model.named_parameters()
            if "lora_" in n
        }
        assert adapted == expected


def test_rank_alpha_and_seed() -> None:
    with (
        wb.Session("tiny", wb.LoraConfig(rank=3, alpha=6.0, seed=7)) as a,
        wb.Session("tiny", wb.LoraConfig(rank=3, alpha=6.0, seed=7)) as b,
    ):
        pa = a.engine.inspect(a.model_id, wb.Role.POLICY).parameters
        pb = b.engine.inspect(b.model_id, wb.Role.POLICY).parameters
        assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)
        some_a = next(p for n, p in pa.items() if "lora_A" in n)
        assert some_a.shape[0] == 3
        layer = a.engine.torch_model.get_base_model().model.layers[0].self_attn.q_proj
        assert layer.scaling[a.engine.model_status(a.model_id).adapter] == pytest.approx(2.0)
        # B starts at zero: the adapted model starts equal to the base
        assert all(float(p.detach().abs().sum()) == 0.0 for n, p in pa.items() if "lora_B" in n)
    with wb.Session("tiny", wb.LoraConfig(rank=3, seed=8)) as c:
        pc = c.engine.inspect(c.model_id, wb.Role.POLICY).parameters
        assert any(not torch.equal(pa[n], pc[n]) for n in pa)


def test_default_device_and_dtype_on_cpu() -> None:
    with wb.Session("tiny", wb.LoraConfig(rank=1)) as sess:
        if not torch.cuda.is_available():
            assert sess.config.device == "cpu" and sess.config.dtype == "float32"
    with wb.Session("tiny", wb.LoraConfig(rank=1), dtype="bfloat16", device="cpu") as sess:
        assert next(sess.engine.torch_model.parameters()).dtype == torch.bfloat16


def _worker_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "workbench-worker"]


def test_the_model_is_loaded_on_the_sessions_worker_thread(monkeypatch) -> None:
    """Loading runs parallel kernels; on the caller's thread they would give it an OpenMP pool of its
    own, which slows every later kernel on the worker (see `Engine.__init__`)."""
    loaded_on: list[threading.Thread] = []
    real = engine_module.load_base_model

    def recording(*args, **kwargs):
        loaded_on.append(threading.current_thread())
        return real(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_base_model", recording)
    before = set(_worker_threads())
    with wb.Session("tiny", wb.LoraConfig(rank=1)):
        (worker,) = set(_worker_threads()) - before
        assert loaded_on == [worker]


def test_unknown_model_names_fail_clearly(tmp_path) -> None:
    empty = tmp_path / "not-a-model"
    empty.mkdir()
    before = set(_worker_threads())
    with pytest.raises(ValueError, match="not a model folder"):
        wb.Session(str(empty))
    for thread in set(_worker_threads()) - before:  # the failed load's worker stops
        thread.join(timeout=10)
        assert not thread.is_alive()
    with pytest.raises(ValueError, match="unknown dtype"):
        wb.Session("tiny", dtype="float8")
