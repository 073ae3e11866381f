"""Checkpoints on the tiny model: contents, round trips, atomicity, verification, security, sampler weights."""

from __future__ import annotations

import ast
import json
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import peft
import pytest
import safetensors.torch
import torch

import workbench as wb
from tests.datums import sft_datum
from workbench.storage import checkpoint_store
from workbench.storage.checkpoint_store import manifest_for

PACKAGE = Path(wb.__file__).parent


@pytest.fixture
def sess(tmp_path: Path) -> wb.Session:
    """The tiny model with a policy and a critic, in a model folder of its own."""
    session = wb.Session("tiny", wb.LoraConfig(rank=4), critic=True, seed=0, model_dir=tmp_path / "run-a")
    yield session
    session.close()


def _data(sess: wb.Session) -> list[wb.Datum]:
    return [
        sft_datum(sess.tokenizer, "Question: What is two plus two?", " Answer: four."),
        sft_datum(sess.tokenizer, "The quick brown fox", " jumps over the lazy dog."),
    ]


def _critic_data(sess: wb.Session) -> list[wb.Datum]:
    tokens = sess.tokenizer("The quick brown fox jumps").input_ids
    n = len(tokens) - 1
    return [
        wb.Datum(
            model_input=wb.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={"values": [0.0] * n, "returns": [1.0] * n},
        )
    ]


def _train(sess: wb.Session, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        losses.append(sess.policy.forward_backward(_data(sess), "cross_entropy").result().metrics["loss:sum"])
        sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        if sess.critic is not None:
            sess.critic.forward_backward(_critic_data(sess), "ppo_critic").result()
            sess.critic.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
    return losses


def _params(sess: wb.Session, role: str = "policy") -> dict[str, torch.Tensor]:
    """Copies of a model's trainable tensors (a critic's include its value head)."""
    return sess.engine.inspect(sess.model_id, wb.Role(role)).parameters


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _rewrite(folder: Path, rel: str, data: bytes) -> None:
    """Replace one file and re-sign the manifest: a checkpoint forged by someone who knows the format."""
    (folder / rel).write_bytes(data)
    files = {k: v for k, v in _files(folder).items() if k != "manifest.json"}
    (folder / "manifest.json").write_bytes(manifest_for(files))


# ---------------------------------------------------------------------------------------------- contents


def test_checkpoint_holds_adapters_optimizer_and_state_and_no_base_weights(sess: wb.Session) -> None:
    _train(sess, 2)
    response = sess.policy.save_state("step-2").result()
    assert response.path == f"tinker://{sess.model_id}/weights/step-2"
    path = Path(response.folder)
    assert path == (sess.model_dir / "checkpoints" / "step-2").absolute()
    files = _files(path)
    assert {
        "config.json",
        "state.json",
        "rng.safetensors",
        "manifest.json",
        "policy/adapter_config.json",
        "policy/adapter_model.safetensors",
        "critic/adapter_config.json",
        "critic/adapter_model.safetensors",
        "critic/value_head.safetensors",
        "optimizer/policy.safetensors",
        "optimizer/policy.json",
        "optimizer/critic.safetensors",
        "optimizer/critic.json",
    } == set(files)  # no pending gradient: no gradients/ folder
    for role in ("policy", "critic"):
        tensors = safetensors.torch.load(files[f"{role}/adapter_model.safetensors"])
        assert tensors and all(
            "lora_" in key for key in tensors
        )  # adapters only: no base weight, no embedding
        assert len(tensors) == sum(1 for name in _params(sess, role) if "lora_" in name)
    assert not any(
        name.endswith(("model.safetensors", ".bin", ".pt", ".pkl")) and "adapter" not in name
        for name in files
    )
    base_bytes = sum(
        p.numel() * p.element_size() for p in sess.engine.torch_model.get_base_model().parameters()
    )
    assert sum(len(data) for data in files.values()) < base_bytes / 2
    config = json.loads(files["config.json"])
    assert config["run_id"] == sess.model_dir.name and config["step"] == 2
    assert config["base_model"] == sess.base_info.identity()
    assert config["session"] == sess.config.to_dict()
    manifest = json.loads(files["manifest.json"])
    assert set(manifest["files"]) == set(files) - {"manifest.json"}
    assert all(entry["size"] == len(files[rel]) for rel, entry in manifest["files"].items())
    optimizer = json.loads(files["optimizer/policy.json"])
    assert optimizer["param_groups"][0]["params"] == list(_params(sess))
    assert optimizer["param_groups"][0]["lr"] == 1e-2


def test_package_never_unpickles() -> None:
    """No pickle-based loading anywhere in the package: no pickle-family import, no torch.load."""
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "shelve", "marshal"}
    for source in PACKAGE.rglob("*.py"):
        tree = ast.parse(source.read_text(), filename=str(source))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                assert not {alias.name.split(".")[0] for alias in node.names} & banned_modules, source
            elif isinstance(node, ast.ImportFrom):
                assert (node.module or "").split(".")[0] not in banned_modules, source
            elif isinstance(node, ast.Attribute) and node.attr == "load" and isinstance(node.value, ast.Name):
                assert node.value.id != "torch", f"torch.load in {source}"


def test_no_secrets_in_checkpoints_or_history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "sentinel-wandb-key-3f9a1c")
    monkeypatch.setenv("HF_TOKEN", "hf_sentinelTokenB7e2")
    with wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=tmp_path / "run") as session:
        _train(session, 1)
        session.policy.save_state("s").result()
        session.policy.save_weights_for_sampler("s").result()
    files = [p for p in (tmp_path / "run").rglob("*") if p.is_file()]
    assert any(p.name == "history.jsonl" for p in files) and any(
        p.name == "adapter_model.safetensors" for p in files
    )
    for path in files:
        data = path.read_bytes()
        assert b"sentinel-wandb-key-3f9a1c" not in data and b"hf_sentinelTokenB7e2" not in data, path


# ---------------------------------------------------------------------------------------------- round trips


def test_from_checkpoint_restores_everything_exactly(sess: wb.Session, tmp_path: Path) -> None:
    _train(sess, 2)
    sess.policy.forward_backward(_data(sess), "cross_entropy").result()  # a pending gradient is saved too
    path = sess.policy.save_state("mid").result().folder  # a run outside the runs root: named by its folder
    random_draws = (random.random(), float(np.random.rand()), float(torch.rand(1)))
    # what the resumed session must reproduce, taken before the original closes (a live session's run
    # folder cannot be taken by another)
    digest, config, model_dir = sess.state_digest(), sess.config, sess.model_dir.absolute()
    critic_params = {k: v.clone() for k, v in _params(sess, "critic").items()}
    prompt = sess.tokenizer("The quick brown fox").input_ids
    unseeded = wb.SamplingParams(max_tokens=8, temperature=1.0)
    ours = sess.sampling_client().sample(prompt, 2, unseeded).result()
    sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
    digest_after_step = sess.state_digest()
    sess.close()
    with wb.Session.from_checkpoint(path, device="cpu") as resumed:
        # weights, grads, AdamW state, counters, versions, and the sampling generator's state
        assert resumed.state_digest() == digest
        assert resumed.config == config
        assert resumed.model_dir.absolute() == model_dir  # the same model folder, so the same W&B run
        assert resumed.policy.weights_version == 2
        assert resumed.critic is not None and resumed.critic.step == 2
        assert _equal(_params(resumed, "critic"), critic_params)
        assert torch.equal(
            _params(resumed, "critic")["value_head.linear.weight"], critic_params["value_head.linear.weight"]
        )
        assert (random.random(), float(np.random.rand()), float(torch.rand(1))) == random_draws
        # the sampling generator continues where it was: unseeded samples draw the same seeds
        theirs = resumed.sampling_client().sample(prompt, 2, unseeded).result()
        assert [s.tokens for s in theirs.sequences] == [s.tokens for s in ours.sequences]
        resumed.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        assert resumed.state_digest() == digest_after_step


def test_from_checkpoint_outside_its_model_folder_continues_the_saved_model_id(
    sess: wb.Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = Path(sess.policy.save_state("c").result().folder)
    moved = shutil.copytree(path, tmp_path / "elsewhere" / "c")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    with wb.Session.from_checkpoint(moved) as resumed:
        assert resumed.model_dir == tmp_path / "runs" / sess.model_dir.name
    with wb.Session.from_checkpoint(moved, model_dir=tmp_path / "chosen", wandb=False) as resumed:
        assert resumed.model_dir == tmp_path / "chosen"


def test_load_state_with_optimizer_into_a_live_session(sess: wb.Session) -> None:
    _train(sess, 2)
    sess.policy.forward_backward(_data(sess), "cross_entropy").result()
    sess.policy.save_state("mid").result()
    saved_policy, saved_critic = _params(sess), _params(sess, "critic")
    sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
    after_step = _params(sess)
    _train(sess, 2)
    assert sess.policy.weights_version == 5

    response = sess.critic.load_state_with_optimizer("mid").result()  # either client loads the whole run
    assert response.path == f"tinker://{sess.model_id}/weights/mid"
    assert _equal(_params(sess), saved_policy)
    assert _equal(_params(sess, "critic"), saved_critic)  # the value head included
    assert sess.policy.step == 2 and sess.critic.step == 2
    assert sess.engine.inspect(sess.model_id, wb.Role.POLICY).pending_backward_calls == 1
    assert sess.engine.model_status(sess.model_id).pending_backward_calls == 1
    assert sess.policy.weights_version == 6 and sess.critic.weights_version == 5  # max(saved, current) + 1
    sess.policy.optim_step(
        wb.AdamParams(learning_rate=1e-2)
    ).result()  # the restored pending gradient and AdamW state
    assert _equal(_params(sess), after_step)


def test_load_state_restores_the_weights_and_starts_the_optimizer_afresh(sess: wb.Session) -> None:
    """Tinker's `load_state` ("weights only, optimizer resets"): the weights (the critic's value head
    included) come back; the AdamW state of policy and critic is a new model's, the accumulated gradient is
    dropped, and the step counters count on."""
    _train(sess, 2)
    sess.policy.save_state("mid").result()
    saved_policy, saved_critic = _params(sess), _params(sess, "critic")
    _train(sess, 2)
    sess.policy.forward_backward(_data(sess), "cross_entropy").result()  # a pending gradient: dropped
    assert not _equal(_params(sess), saved_policy)

    response = sess.policy.load_state(f"tinker://{sess.model_id}/weights/mid").result()
    assert response.path == f"tinker://{sess.model_id}/weights/mid"
    assert _equal(_params(sess), saved_policy)
    assert _equal(_params(sess, "critic"), saved_critic)
    assert sess.policy.step == 4 and sess.critic.step == 4
    assert sess.policy.weights_version == 5 and sess.critic.weights_version == 5  # max(saved, current) + 1
    policy_now = sess.engine.inspect(sess.model_id, wb.Role.POLICY)
    assert policy_now.pending_backward_calls == 0
    assert all(g is None for g in policy_now.gradients.values())
    after = _files(Path(sess.policy.save_state("after").result().folder))
    assert not any(rel.startswith("gradients/") for rel in after)
    for role in ("policy", "critic"):
        moments = safetensors.torch.load(after[f"optimizer/{role}.safetensors"])
        assert moments == {}, (role, sorted(moments)[:3])  # no Adam moment, as in a new model
        (group,) = json.loads(after[f"optimizer/{role}.json"])["param_groups"]
        defaults = wb.AdamParams()
        assert (group["lr"], group["weight_decay"]) == (defaults.learning_rate, defaults.weight_decay)
    response = sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
    assert not response.applied and "no gradient accumulated" in response.skipped_reason


def test_load_state_errors_leave_the_session_unchanged(sess: wb.Session, tmp_path: Path) -> None:
    _train(sess, 1)
    before = sess.state_digest()
    for load in (sess.policy.load_state, sess.policy.load_state_with_optimizer, sess.load_state):
        with pytest.raises(wb.CheckpointError, match="Can't find a valid checkpoint"):
            wait(load(tmp_path / "nowhere"))
        with pytest.raises(wb.CheckpointError, match="Can't find a valid checkpoint"):
            wait(load("no-such-name"))
        with pytest.raises(wb.CheckpointError, match="Can't find a valid checkpoint"):
            wait(load(f"tinker://{sess.model_id}/weights/no-such-name"))
        (tmp_path / "empty").mkdir(exist_ok=True)
        with pytest.raises(wb.CheckpointError, match="No valid checkpoint found"):
            wait(load(tmp_path / "empty"))
        sampler = sess.policy.save_weights_for_sampler("w", overwrite=True).result()
        with pytest.raises(wb.CheckpointError, match="not a state checkpoint"):
            wait(load(sampler.path))
        with pytest.raises(wb.CheckpointError, match="not a state checkpoint"):
            wait(load(sampler.folder))
        assert sess.state_digest() == before


def test_mismatched_checkpoints_are_refused_naming_both_values(sess: wb.Session, tmp_path: Path) -> None:
    path = (
        sess.policy.save_state("c").result().folder
    )  # another engine finds a run outside the runs root by its folder
    with wb.Session("tiny", wb.LoraConfig(rank=8), critic=True, model_dir=tmp_path / "r8") as other:
        before = other.state_digest()
        with pytest.raises(
            wb.CheckpointError, match=r"policy adapter differs: checkpoint rank 4.*session rank 8"
        ):
            other.policy.load_state(path).result()
        assert other.state_digest() == before
    with (
        wb.Session(
            "tiny", wb.LoraConfig(rank=4, train_unembed=False), critic=True, model_dir=tmp_path / "t"
        ) as other,
        pytest.raises(wb.CheckpointError, match="lm_head"),
    ):
        other.policy.load_state(path).result()
    with wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=tmp_path / "nc") as other:
        before = other.state_digest()
        with pytest.raises(wb.CheckpointError, match="has a critic and this session has none"):
            other.policy.load_state(path).result()
        assert other.state_digest() == before
    with (
        wb.Session(
            str(_tiny_variant(tmp_path)), wb.LoraConfig(rank=4), critic=True, model_dir=tmp_path / "v"
        ) as other,
        pytest.raises(wb.CheckpointError, match=r"different base model \(.*name: checkpoint 'tiny', session"),
    ):
        other.policy.load_state(path).result()


def wait(result: object) -> object:
    """The result of a load: a client's future, or `Session.load_state`'s response."""
    return result.result() if isinstance(result, wb.APIFuture) else result


def _tiny_variant(tmp_path: Path, tie: bool = False) -> Path:
    """A model with the tiny model's tokenizer and shapes, built from config (untrained)."""
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    from workbench.engine.model.builtin_models import tiny_base_model_dir

    folder = tmp_path / ("tiny-tied" if tie else "tiny-variant")
    if not folder.exists():
        config = AutoConfig.from_pretrained(tiny_base_model_dir())
        config.tie_word_embeddings = tie
        torch.manual_seed(1)
        LlamaForCausalLM(config).save_pretrained(folder)
        AutoTokenizer.from_pretrained(tiny_base_model_dir()).save_pretrained(folder)
    return folder


def test_rng_states_round_trip_and_a_missing_cuda_state_is_loud(sess: wb.Session) -> None:
    """`Session.load_state` restores every RNG: python, numpy, torch, and the engine's sampling generator
    (which seeds unseeded samples)."""
    path = Path(sess.policy.save_state("r").result().folder)
    prompt = sess.tokenizer("The quick brown fox").input_ids
    unseeded = wb.SamplingParams(max_tokens=12, temperature=1.0)

    def draws() -> list[object]:
        sample = sess.sampling_client().sample(prompt, 2, unseeded).result()
        return [
            random.random(),
            float(np.random.rand()),
            float(torch.rand(1)),
            [s.tokens for s in sample.sequences],
        ]

    first = draws()
    assert draws() != first  # every generator moved on
    sess.load_state(path)
    assert draws() == first
    sess.load_state(f"tinker://{sess.model_id}/weights/r")
    assert draws() == first

    rng = safetensors.torch.load((path / "rng.safetensors").read_bytes())
    rng["cuda.0"] = torch.zeros(16, dtype=torch.uint8)
    _rewrite(path, "rng.safetensors", safetensors.torch.save(rng))
    if not torch.cuda.is_available():
        with pytest.warns(RuntimeWarning, match="CUDA RNG states for 1 device"):
            sess.load_state(path)


# ---------------------------------------------------------------------------------------------- atomicity


def test_existing_names_need_overwrite(sess: wb.Session) -> None:
    sess.policy.save_state("c").result()
    _train(sess, 1)
    with pytest.raises(wb.CheckpointError, match="overwrite=True"):
        sess.policy.save_state("c")
    sess.policy.save_state("c", overwrite=True).result()
    assert [(info.name, info.step) for info in sess.list_checkpoints()] == [("c", 1)]
    for bad in ("../up", ".hidden", "a/b", ""):
        with pytest.raises(wb.CheckpointError, match="invalid checkpoint name"):
            sess.policy.save_state(bad)


@pytest.mark.parametrize("failure", [OSError("disk full"), KeyboardInterrupt()])
@pytest.mark.parametrize("overwrite", [False, True])
def test_a_failed_save_leaves_previous_checkpoints_intact(
    sess: wb.Session, monkeypatch: pytest.MonkeyPatch, failure: BaseException, overwrite: bool
) -> None:
    _train(sess, 1)
    sess.policy.save_state("first").result()
    saved = _files(sess.model_dir / "checkpoints" / "first")
    _train(sess, 1)
    writes = []
    real_write = checkpoint_store.write_file

    def failing_write(path: Path, data: bytes) -> None:
        writes.append(path)
        if len(writes) == 3:
            raise failure
        real_write(path, data)

    monkeypatch.setattr(checkpoint_store, "write_file", failing_write)
    name = "first" if overwrite else "second"
    with pytest.raises(type(failure)):
        sess.policy.save_state(name, overwrite=overwrite).result()
    monkeypatch.setattr(checkpoint_store, "write_file", real_write)
    assert [info.name for info in sess.list_checkpoints()] == ["first"]
    assert _files(sess.model_dir / "checkpoints" / "first") == saved
    assert sorted(p.name for p in (sess.model_dir / "checkpoints").iterdir()) == [
        "first"
    ]  # the temp folder is gone
    sess.load_state("first")
    assert sess.policy.step == 1


def test_leftovers_are_ignored_by_listing_and_removed_by_cleanup(sess: wb.Session) -> None:
    sess.policy.save_state("a").result()
    sess.policy.save_weights_for_sampler("w").result()
    checkpoints = sess.model_dir / "checkpoints"
    (checkpoints / ".b.tmp-0a1b2c3d" / "policy").mkdir(parents=True)
    (checkpoints / ".b.tmp-0a1b2c3d" / "policy" / "adapter_model.safetensors").write_bytes(b"half")
    (checkpoints / "no-manifest").mkdir()
    shutil.copytree(checkpoints / "a", checkpoints / ".a.old-00ff00ff")  # replaced: the new one is in place
    shutil.copytree(checkpoints / "a", checkpoints / ".gone.old-12345678")  # the replacement never arrived
    assert [(i.name, i.kind) for i in sess.list_checkpoints()] == [("a", "state"), ("w", "sampler")]
    removed = sess.cleanup_checkpoints()
    assert sorted(p.name for p in removed) == [".a.old-00ff00ff", ".b.tmp-0a1b2c3d"]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["a", "gone", "no-manifest"]
    assert [i.name for i in sess.list_checkpoints()] == ["a", "gone", "w"]


def test_list_and_delete(sess: wb.Session) -> None:
    sess.policy.save_state("one").result()
    _train(sess, 1)
    sess.policy.save_weights_for_sampler("one").result()
    sess.policy.save_state("two").result()
    infos = sess.list_checkpoints()
    assert [(i.name, i.kind, i.step) for i in infos] == [
        ("one", "state", 0),
        ("one", "sampler", 1),
        ("two", "state", 1),
    ]
    assert infos[0].time <= infos[1].time <= infos[2].time
    assert infos[2].size_bytes == sum(p.stat().st_size for p in infos[2].path.rglob("*") if p.is_file())
    sess.delete_checkpoint("one")
    sess.delete_checkpoint("one", kind="sampler")
    assert [i.name for i in sess.list_checkpoints()] == ["two"]
    with pytest.raises(wb.CheckpointError, match="no state checkpoint named 'one'"):
        sess.delete_checkpoint("one")


def test_saves_are_wandb_events_and_a_resumed_session_continues_the_wandb_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    offline = {"mode": "offline"}
    with wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=tmp_path / "run-w", wandb=offline) as session:
        assert session.wandb_run is not None
        _train(session, 1)
        saved = session.policy.save_state("e").result()
        assert dict(session.wandb_run._run.summary["event/checkpoint"]) == {
            "name": "e",
            "kind": "state",
            "path": saved.path,
            "step": 1,
        }
        path = saved.folder
        sampler = session.policy.save_weights_for_sampler("e").result()
        assert dict(session.wandb_run._run.summary["event/checkpoint"]) == {
            "name": "e",
            "kind": "sampler",
            "path": sampler.path,
            "step": 1,
        }
    with wb.Session.from_checkpoint(path, wandb=offline) as resumed:
        assert resumed.wandb_run is not None and resumed.wandb_run.run_id == "run-w"


# ---------------------------------------------------------------------------------------------- verification


def test_every_truncated_or_flipped_file_is_named_and_nothing_changes(
    sess: wb.Session, tmp_path: Path
) -> None:
    _train(sess, 1)
    sess.policy.forward_backward(_data(sess), "cross_entropy").result()
    path = Path(sess.policy.save_state("c").result().folder)
    before = sess.state_digest()
    for rel, data in _files(path).items():
        if rel == "manifest.json":
            continue
        for damage, expected in (
            (data[: len(data) // 2], "truncated or altered"),
            (bytes([data[0] ^ 1]) + data[1:], "sha256"),
        ):
            copy = tmp_path / "damaged" / "c"
            shutil.rmtree(copy.parent, ignore_errors=True)
            shutil.copytree(path, copy)
            (copy / rel).write_bytes(damage)
            with pytest.raises(wb.CorruptCheckpointError, match=re.escape(rel)) as info:
                sess.policy.load_state(copy).result()
            assert expected in str(info.value)
    assert sess.state_digest() == before


def test_missing_and_extra_files_and_newer_formats_are_refused(sess: wb.Session, tmp_path: Path) -> None:
    path = Path(sess.policy.save_state("c").result().folder)
    copy = shutil.copytree(path, tmp_path / "x" / "c")
    (copy / "critic" / "value_head.safetensors").unlink()
    with pytest.raises(
        wb.CorruptCheckpointError,
        match=re.escape("critic/value_head.safetensors is listed in the manifest but missing"),
    ):
        sess.policy.load_state(copy).result()
    copy = shutil.copytree(path, tmp_path / "y" / "c")
    (copy / "notes.txt").write_text("hi")
    with pytest.raises(wb.CorruptCheckpointError, match=re.escape("not in its manifest: notes.txt")):
        sess.policy.load_state(copy).result()
    copy = shutil.copytree(path, tmp_path / "z" / "c")
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(wb.CheckpointError, match="format 99"):
        sess.policy.load_state(copy).result()


def test_forged_files_fail_safely(sess: wb.Session, tmp_path: Path) -> None:
    """A checkpoint whose manifest was re-signed by an attacker: a safetensors file with an absurd header
    fails fast, and a pickle placed in it is never unpickled."""
    path = Path(sess.policy.save_state("c").result().folder)
    sentinel = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (Path.touch, (sentinel,))

    forged = shutil.copytree(path, tmp_path / "forged" / "c")
    (forged / "optimizer" / "policy.pt").write_bytes(pickle.dumps(Exploit()))
    _rewrite(forged, "optimizer/policy.safetensors", (2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(
        wb.CorruptCheckpointError,
        match=re.escape("optimizer/policy.safetensors is not a readable safetensors file"),
    ):
        sess.policy.load_state(forged).result()
    assert not sentinel.exists()
    forged = shutil.copytree(path, tmp_path / "forged-rng" / "c")
    state = json.loads((forged / "state.json").read_text())
    state["rng"]["python"][1] = state["rng"]["python"][1][:10]
    _rewrite(forged, "state.json", json.dumps(state).encode())
    with pytest.raises(wb.CorruptCheckpointError, match="unusable RNG state"):
        sess.policy.load_state(forged).result()


# ---------------------------------------------------------------------------------------------- sampler weights


def _policy_logits(sess: wb.Session, tokens: list[int]) -> torch.Tensor:
    """The policy's logits for every position, from the module the engine runs with the policy's adapter
    active, checked against the logprobs the policy's own forward reports."""
    model = sess.engine.torch_model
    model.set_adapter(sess.engine.model_status(sess.model_id).adapter)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([tokens])).logits[0]
    datum = wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )
    reported = (
        sess.policy.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    )
    expected = torch.log_softmax(logits[:-1].float(), -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    torch.testing.assert_close(reported, expected, atol=1e-5, rtol=0)
    return logits


def test_sampler_weights_load_with_peft_alone(sess: wb.Session) -> None:
    _train(sess, 2)
    response = sess.policy.save_weights_for_sampler("s").result()
    assert response.path == f"tinker://{sess.model_id}/sampler_weights/s"
    path = Path(response.folder)
    assert path == (sess.model_dir / "sampler_weights" / "s").absolute()
    assert sorted(p.name for p in path.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "manifest.json",
        "sampler.json",
    ]
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == sess.base_info.path and config["r"] == 4
    tokens = sess.tokenizer("The quick brown fox jumps").input_ids
    loaded = peft.AutoPeftModelForCausalLM.from_pretrained(str(path))
    with torch.no_grad():
        theirs = loaded(input_ids=torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(theirs, _policy_logits(sess, tokens), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="only the policy"):
        sess.critic.save_weights_for_sampler("c")
    with pytest.raises(wb.CheckpointError, match="overwrite=True"):
        sess.policy.save_weights_for_sampler("s")
    _train(sess, 1)
    sess.policy.save_weights_for_sampler("s", overwrite=True).result()
    assert json.loads((path / "sampler.json").read_text())["step"] == 3


# ---------------------------------------------------------------------------------------------- merged export


def test_export_merged_matches_the_policy_and_leaves_the_session_alone(
    sess: wb.Session, tmp_path: Path
) -> None:
    from transformers import AutoModelForCausalLM

    _train(sess, 2)
    tokens = sess.tokenizer("The quick brown fox jumps").input_ids
    expected, before = _policy_logits(sess, tokens), sess.state_digest()
    out = sess.export_merged(tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=torch.tensor([tokens])).logits[0], expected, atol=1e-5, rtol=0
        )
    assert sess.state_digest() == before and torch.equal(_policy_logits(sess, tokens), expected)
    assert (out / "tokenizer.json").is_file()
    with pytest.raises(wb.CheckpointError, match="already exists"):
        sess.export_merged(out)


def test_export_merged_unties_an_adapted_output_layer(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    with wb.Session(
        str(_tiny_variant(tmp_path, tie=True)), wb.LoraConfig(rank=4), model_dir=tmp_path / "run"
    ) as session:
        base = session.engine.torch_model.get_base_model()
        assert base.get_output_embeddings().weight is base.get_input_embeddings().weight
        _train(session, 2)
        tokens = session.tokenizer("The quick brown fox jumps").input_ids
        expected = _policy_logits(session, tokens)
        out = session.export_merged(tmp_path / "merged")
        assert (
            base.get_output_embeddings().base_layer.weight is base.get_input_embeddings().weight
        )  # session still tied
    merged = AutoModelForCausalLM.from_pretrained(out)
    assert merged.config.tie_word_embeddings is False
    assert not torch.equal(merged.get_output_embeddings().weight, merged.get_input_embeddings().weight)
    with torch.no_grad():
        torch.testing.assert_close(
            merged(input_ids=torch.tensor([tokens])).logits[0], expected, atol=1e-5, rtol=0
        )


def test_a_sampling_client_keeps_its_weights_across_a_load(sess: wb.Session) -> None:
    prompt = sess.tokenizer("The quick brown fox jumps").input_ids
    sess.policy.save_state("start").result()
    start_logprobs = sess.sampling_client().compute_logprobs(prompt).result()
    _train(sess, 2)
    pinned = sess.sampling_client()
    trained_logprobs = pinned.compute_logprobs(prompt).result()
    sess.policy.load_state("start").result()
    assert pinned.weights_version == 2 and sess.policy.weights_version == 3
    assert pinned.compute_logprobs(prompt).result() == trained_logprobs  # still version 2's weights
    assert sess.sampling_client().compute_logprobs(prompt).result() == start_logprobs
