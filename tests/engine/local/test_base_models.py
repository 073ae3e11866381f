"""Several base models in one process and one server, within a memory budget: two held side by side, a
third that does not fit refused with a message naming the budget and what holds it (nothing changes),
idle ones freed first; over `TinkerServer` with the unmodified SDK as well as in-process, where a
loopback server loads a base on this machine when a client first names it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
import torch

import workbench as wb
from tests.conftest import build_tiny_twin
from workbench.engine.local.base_models import (
    BaseModels,
    MemoryBudgetError,
    base_model_bytes,
    engine_bytes,
    parse_size,
)
from workbench.engine.model.base_model import loads_without_download
from workbench.engine.samplers.vllm import CPU_KV_CACHE_BYTES, vllm_memory_bytes
from workbench.notebook.panel.status import StatusBar
from workbench.sdk_conversion import to_sdk_datum
from workbench.server import ServerConfig, TinkerServer


@pytest.fixture(scope="module")
def big_twin(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A third base model, larger than the teacher (6 layers)."""
    return build_tiny_twin(tmp_path_factory.mktemp("tiny-big"), layers=6, seed=2)


@pytest.fixture
def sess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[wb.Session]:
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    session = wb.Session("tiny", wb.LoraConfig(rank=4), wandb=False)
    yield session
    session.close()


def _budget_for_two(sess: wb.Session, teacher: str, big: str) -> int:
    """Room for the session's base and the teacher, and half the big one beside them: the big one fits
    only once the teacher is gone."""
    tiny_held = engine_bytes(sess.engine)  # type: ignore[arg-type]
    teacher_need, big_need = (base_model_bytes(name, torch.float32) for name in (teacher, big))
    assert big_need <= teacher_need + big_need // 2  # so the big one fits in the teacher's place
    return tiny_held + teacher_need + big_need // 2


def test_two_base_models_fit_the_budget_and_a_third_is_refused_naming_it(
    sess: wb.Session, tiny_teacher: str, big_twin: str
) -> None:
    assert sess.base_models is not None
    sess.base_models.memory_budget_bytes = _budget_for_two(sess, tiny_teacher, big_twin)
    service = sess.service_client()
    student_of_teacher = service.create_lora_training_client(base_model=tiny_teacher, rank=4).result()
    assert [e.base_info.path for e in sess.base_models.engines()][1:] == [tiny_teacher]
    assert "BaseModels(tiny" in repr(sess) and "of " in repr(sess)  # what is loaded, and the budget
    status = StatusBar(sess)
    status.refresh()
    assert 'data-field="bases"' in status.widget.value and "(budget " in status.widget.value
    assert tiny_teacher in status.widget.value

    with pytest.raises(MemoryBudgetError) as refused:
        service.create_lora_training_client(base_model=big_twin, rank=4)
    message = str(refused.value)
    assert "memory budget of" in message and "'tiny' holds" in message and tiny_teacher in message
    assert len(sess.base_models.engines()) == 2  # nothing changed

    # Its only model gone, the teacher is idle: the big base model takes its place.
    teacher_engine = sess.base_models.engines()[1]
    assert teacher_engine.model_ids() == [student_of_teacher.get_info().model_id]
    teacher_engine.delete_model(teacher_engine.model_ids()[0]).result()
    big = service.create_lora_training_client(base_model=big_twin, rank=4).result()
    assert [e.base_info.path for e in sess.base_models.engines()][1:] == [big_twin]
    assert big.get_tokenizer() is not None


def test_a_base_model_larger_than_the_whole_budget_is_refused_before_loading(
    sess: wb.Session, big_twin: str
) -> None:
    models = BaseModels(sess.engine, memory_budget_bytes=1000)  # type: ignore[arg-type]
    with pytest.raises(MemoryBudgetError, match="more than the whole memory budget"):
        models.engine(big_twin)
    assert len(models.engines()) == 1


def test_a_vllm_sampler_counts_as_its_weights_and_kv_cache_on_a_cpu(
    sess: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The formula the budget uses for an engine that samples with vLLM (the engines themselves are
    tested in test_vllm.py); an engine sampling with HF has no vLLM share."""
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    cpu = torch.device("cpu")
    assert vllm_memory_bytes(1000, cpu) == 1000 + CPU_KV_CACHE_BYTES
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # vLLM's own setting, in GiB
    assert vllm_memory_bytes(1000, cpu) == 1000 + 3 * 1024**3
    assert sess.base_models is not None
    assert [h.sampler_bytes for h in sess.base_models.holdings()] == [0]


def test_sizes_read_with_units() -> None:
    assert parse_size("70GiB") == 70 * 1024**3
    assert parse_size("500 MB") == 500 * 10**6
    assert parse_size("2e9") == 2 * 10**9
    for bad in ("lots", "-1GB", "12 parsecs", ""):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_a_server_holds_two_base_models_and_refuses_a_third_that_does_not_fit(
    sess: wb.Session, tiny_teacher: str, big_twin: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    assert sess.base_models is not None
    sess.base_models.memory_budget_bytes = _budget_for_two(sess, tiny_teacher, big_twin)
    config = ServerConfig(allowed_base_models=(tiny_teacher, big_twin))
    with (
        TinkerServer(sess.base_models, config) as server,
        tinker.ServiceClient(base_url=server.url) as client,
    ):
        listed = tinker.RestClient(base_url=server.url).get_server_capabilities().result().supported_models
        assert [m.model_name for m in listed] == ["tiny", tiny_teacher, big_twin]

        teacher = client.create_lora_training_client(base_model=tiny_teacher, rank=4).result()
        datum = wb.chat_datum(
            teacher.get_tokenizer(),
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        )
        teacher.forward_backward([to_sdk_datum(datum)], "cross_entropy").result()
        sampler = client.create_sampling_client(base_model="tiny")
        prompt = tinker.ModelInput.from_ints([1, 2, 3])
        assert sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=2)).result().sequences

        with pytest.raises(tinker.BadRequestError) as refused:
            client.create_lora_training_client(base_model=big_twin, rank=4).result()
        message = str(refused.value)
        assert "memory budget of" in message and "'tiny' holds" in message
        assert len(sess.base_models.engines()) == 2

        with pytest.raises(tinker.BadRequestError, match="this server serves"):
            client.create_sampling_client(base_model="Qwen/Qwen3-8B").sample(
                prompt, 1, tinker.SamplingParams()
            )


def test_session_connect_drives_the_second_base_model_of_a_server(
    sess: wb.Session, tiny_teacher: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    assert sess.base_models is not None
    sess.base_models.engine(tiny_teacher)
    server = sess.serve()
    remote = wb.Session.connect(server.url, base_model=tiny_teacher, lora=wb.LoraConfig(rank=4), wandb=False)
    try:
        datum = wb.chat_datum(
            remote.tokenizer, [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]
        )
        loss = remote.policy.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"]
        remote.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        teacher_engine = sess.base_models.engines()[1]
        assert len(teacher_engine.model_ids()) == 1 and loss > 0  # the model lives on the teacher's base
        saved = remote.policy.save_state("one").result().path
        listed = tinker.RestClient(base_url=server.url).list_checkpoints(saved.split("/")[2]).result()
        assert [c.tinker_path for c in listed.checkpoints] == [saved]
        run = tinker.RestClient(base_url=server.url).get_training_run(saved.split("/")[2]).result()
        assert run.base_model == tiny_teacher
    finally:
        remote.close()


def test_a_loopback_server_loads_a_local_base_on_first_use_and_names_the_flags_for_others(
    sess: wb.Session, tiny_teacher: str, big_twin: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Started with no allowed base model, a server on 127.0.0.1 loads a second base that is a model
    folder here when an SDK client first names it, for sampling and for training; a name that would need
    a download, a folder without a model and one over the memory budget are refused with the flags that
    would serve them, and nothing is loaded."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    assert sess.base_models is not None
    not_a_model = tmp_path / "not-a-model"
    not_a_model.mkdir()
    prompt = tinker.ModelInput.from_ints([1, 2, 3])
    with (
        TinkerServer(sess.base_models, ServerConfig()) as server,
        tinker.ServiceClient(base_url=server.url) as client,
    ):
        for unservable in ("Qwen/Qwen3-8B", str(not_a_model), str(tmp_path / "missing")):
            with pytest.raises(tinker.BadRequestError) as refused:
                client.create_sampling_client(base_model=unservable).result()
            message = str(refused.value)
            assert f"not {unservable!r}" in message, message
            assert f"--allow-base-model {unservable}" in message and f"--base-model {unservable}" in message
            assert len(sess.base_models.engines()) == 1

        sampler = client.create_sampling_client(base_model=tiny_teacher).result()
        assert sampler.sample(prompt, 1, tinker.SamplingParams(max_tokens=2)).result().sequences
        assert [e.base_info.path for e in sess.base_models.engines()][1:] == [tiny_teacher]
        student = client.create_lora_training_client(base_model=tiny_teacher, rank=4).result()
        datum = wb.chat_datum(
            student.get_tokenizer(),
            [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
        )
        loss = student.forward_backward([to_sdk_datum(datum)], "cross_entropy").result().metrics["loss:sum"]
        assert loss > 0 and len(sess.base_models.engines()[1].model_ids()) == 1

        sess.base_models.memory_budget_bytes = sess.base_models.held_bytes() + 1024
        with pytest.raises(tinker.BadRequestError) as refused:
            client.create_lora_training_client(base_model=big_twin, rank=4).result()
        assert "memory budget of" in str(refused.value) and "--memory-budget" in str(refused.value)
        assert [e.base_info.path for e in sess.base_models.engines()][1:] == [tiny_teacher]


def test_an_hf_id_in_the_local_hf_cache_loads_without_a_download(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`loads_without_download`: the built-ins, a model folder, and an HF id whose config is in the HF
    cache; not an id the cache lacks, a folder without a model, nor a malformed name."""
    import huggingface_hub

    snapshot = tmp_path / "hub" / "models--acme--chat" / "snapshots" / "0123abcd"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (tmp_path / "hub" / "models--acme--chat" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--chat" / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert loads_without_download("acme/chat") and loads_without_download("tiny")
    assert loads_without_download(str(snapshot))
    for elsewhere in ("acme/other", str(tmp_path), "a/b/c/../d", ""):
        assert not loads_without_download(elsewhere), elsewhere
