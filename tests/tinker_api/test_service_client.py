"""The Tinker client surface in-process: `wb.ServiceClient`, the clients it makes, and `wb.RestClient`,
used as code written for the `tinker` SDK uses them."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import tinker
import torch

import workbench as wb
from tests.datums import ce_datum, random_tokens, sdk_ce_datum


@pytest.fixture
def service(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> wb.ServiceClient:
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    client = wb.ServiceClient(user_metadata={"recipe": "test"}, base_url="http://unused", api_key="tml-x")
    yield client
    client.close("success")


def _data(seed: int = 0, count: int = 3) -> list[wb.Datum]:
    rng = random.Random(seed)
    return [ce_datum(random_tokens(rng, 10, 900)) for _ in range(count)]


def _train(client: wb.TrainingClient, steps: int = 1) -> None:
    for _ in range(steps):
        client.forward_backward(_data(), "cross_entropy")
        client.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()


def test_create_returns_an_awaitable_future_of_the_client(service: wb.ServiceClient) -> None:
    future = service.create_lora_training_client("tiny", rank=4, seed=1, user_metadata={"renderer_name": "x"})
    assert isinstance(future, wb.APIFuture)
    assert future.model_id.startswith("tiny-")  # attribute access reaches the client (and waits for it)

    async def main() -> tuple[wb.TrainingClient, wb.TrainingClient]:
        awaited = await future
        made = await service.create_lora_training_client_async("tiny", rank=4)
        return awaited, made

    awaited, made = asyncio.run(main())
    assert awaited is future.result() and isinstance(made, wb.TrainingClient)
    assert made.engine is awaited.engine  # one engine per base model
    # the built-in model's folder names the same engine as its alias
    folder = awaited.get_info().model_data.tokenizer_id
    same = service.create_lora_training_client(folder, rank=2).result()
    assert same.engine is awaited.engine


def test_get_info_has_the_sdks_shape(service: wb.ServiceClient) -> None:
    client = service.create_lora_training_client("tiny", rank=4).result()
    info = client.get_info()
    assert info.model_data.model_name == "tiny" and info.model_name == "tiny"
    assert Path(info.model_data.tokenizer_id, "tokenizer.json").is_file()
    assert info.lora_rank == 4 and info.is_lora and info.model_id == client.model_id
    assert info.optimizer_config.type == "adamw"
    assert asyncio.run(client.get_info_async()) == info


def test_async_twins_behave_as_the_sdks(service: wb.ServiceClient) -> None:
    client = service.create_lora_training_client("tiny", rank=4).result()

    async def main() -> tuple[float, bool, list[int]]:
        future = await client.forward_backward_async(_data(), "cross_entropy")  # the SDK's double await
        loss = (await future).metrics["loss:sum"]
        optim = await (await client.optim_step_async(tinker.AdamParams(learning_rate=1e-2)))
        sampler = await client.save_weights_and_get_sampling_client_async()
        response = await sampler.sample_async(
            tinker.ModelInput.from_ints([5, 6, 7]), 1, tinker.SamplingParams(max_tokens=3, seed=0)
        )
        return loss, optim.applied, response.sequences[0].tokens

    loss, applied, tokens = asyncio.run(main())
    assert loss > 0 and applied and len(tokens) <= 3


def test_optim_step_metrics_do_not_collide_with_the_callers(service: wb.ServiceClient) -> None:
    client = service.create_lora_training_client("tiny", rank=4).result()
    client.forward_backward(_data(), "cross_entropy")
    response = client.optim_step(adam_params=tinker.AdamParams(learning_rate=1e-2)).result()
    assert set(response.metrics) == {"grad_norm"} and response.applied
    with pytest.raises(ValueError, match="not both"):
        client.optim_step(tinker.AdamParams(), adam_params=tinker.AdamParams())


def test_sample_responses_carry_sequence_ids_and_cache_hits(service: wb.ServiceClient) -> None:
    client = service.create_lora_training_client("tiny", rank=4).result()
    sampler = client.save_weights_and_get_sampling_client().result()
    responses = [
        sampler.sample(tinker.ModelInput.from_ints([5, 6, 7]), 3, tinker.SamplingParams(max_tokens=2))
        for _ in range(2)
    ]
    ids = [s.sequence_id for r in responses for s in r.result().sequences]
    assert len(set(ids)) == 6 and all(ids)
    assert all(r.result().prompt_cache_hit_tokens == 0 for r in responses)
    last_two = sampler.sample(
        tinker.ModelInput.from_ints([5, 6, 7, 8, 9]),
        1,
        tinker.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        prompt_logprobs_last_n=2,
    ).result()
    full = sampler.compute_logprobs(tinker.ModelInput.from_ints([5, 6, 7, 8, 9])).result()
    assert last_two.prompt_logprobs[:3] == [None, None, None]
    assert last_two.prompt_logprobs[3:] == pytest.approx(full[3:], abs=1e-6)
    assert sampler.compute_logprobs([5, 6, 7, 8, 9], prompt_logprobs_last_n=1).result()[:4] == [None] * 4


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (
            lambda s, t: s.create_lora_training_client("tiny", optimizer=tinker.DimuonOptimizerConfig()),
            "only AdamW",
        ),
        (
            lambda s, t: t.save_weights_and_get_sampling_client(kind="bogus"),
            "Input should be 'snapshot' or 'inflight'",
        ),
        (lambda s, t: s.create_sampling_client(), "Either model_path or base_model"),
        (
            lambda s, t: (
                t.save_weights_and_get_sampling_client()
                .result()
                .sample([1, 2], 1, tinker.SamplingParams(max_tokens=1), topk_sample_logprobs=-5)
            ),
            "topk_sample_logprobs must be an integer in",
        ),
        (
            lambda s, t: (
                t.save_weights_and_get_sampling_client()
                .result()
                .sample([1, 2], 1, tinker.SamplingParams(max_tokens=1), prompt_logprobs_last_n=1)
            ),
            "needs include_prompt_logprobs=True",
        ),
    ],
)
def test_arguments_that_would_change_results_are_refused(service: wb.ServiceClient, call, message) -> None:
    client = service.create_lora_training_client("tiny", rank=4).result()
    before = client.engine.state_digest()
    with pytest.raises(ValueError, match=message):
        call(service, client)
    assert client.engine.state_digest() == before


def test_unknown_constructor_arguments_warn_as_the_sdk() -> None:
    with pytest.warns(FutureWarning, match="ignores unsupported arguments: colour"):
        wb.ServiceClient(colour="blue").close("success")


def test_load_state_is_weights_only_and_with_optimizer_is_everything(service: wb.ServiceClient) -> None:
    client = service.create_lora_training_client("tiny", rank=4).result()
    _train(client, 2)
    saved = client.save_state("two").result().path
    _train(client, 1)
    after_three = client.engine.inspect(client.model_id)
    client.load_state(saved).result()
    assert client.step == 3  # the step counter counts on; the optimizer's moments start afresh
    client.load_state_with_optimizer(saved).result()
    assert client.step == 2
    loaded = client.engine.inspect(client.model_id)
    assert any(not torch.equal(loaded.parameters[k], after_three.parameters[k]) for k in loaded.parameters)


def _sdk_data(seed: int = 0, count: int = 3) -> list[tinker.Datum]:
    """`_data` built with the SDK's own types, which every client (in-process or over HTTP) takes."""
    rng = random.Random(seed)
    return [sdk_ce_datum(random_tokens(rng, 10, 900)) for _ in range(count)]


def _train_sdk(client: wb.TrainingClient | tinker.TrainingClient, steps: int) -> None:
    for _ in range(steps):
        client.forward_backward(_sdk_data(), "cross_entropy").result()
        client.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()


def check_a_weights_only_load_starts_the_optimizer_afresh(
    service: wb.ServiceClient | tinker.ServiceClient,
) -> None:
    """SDK 0.38's `load_state`: "only the model weights, not optimizer state ... (weights only, optimizer
    resets)". A client that trained on, with a gradient pending, then loads a checkpoint, steps exactly as a
    client made from that checkpoint with `create_training_client_from_state` (the weights before the step
    are equal, so any Adam moment or pending gradient kept would show in the step). Shared by the
    in-process, HTTP and remote-session tests."""
    saver = service.create_lora_training_client("tiny", rank=4, seed=0).result()
    _train_sdk(saver, 2)
    path = saver.save_state("two").result().path
    loader = service.create_lora_training_client("tiny", rank=4, seed=1).result()
    _train_sdk(loader, 3)
    loader.forward_backward(_sdk_data(seed=7), "cross_entropy").result()  # pending: dropped by the load
    loader.load_state(path).result()
    fresh = service.create_training_client_from_state(path).result()
    check = _sdk_data(seed=3)
    losses = {}
    for name, client in (("loaded", loader), ("fresh", fresh)):
        before = client.forward(check, "cross_entropy").result().metrics["loss:sum"]
        client.forward_backward(_sdk_data(), "cross_entropy").result()
        client.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
        losses[name] = (before, client.forward(check, "cross_entropy").result().metrics["loss:sum"])
    assert losses["loaded"][0] == losses["fresh"][0]  # the same weights before the step
    assert losses["loaded"][1] == pytest.approx(losses["fresh"][1], rel=1e-6, abs=1e-6), losses


def test_a_weights_only_load_starts_the_optimizer_afresh(service: wb.ServiceClient) -> None:
    check_a_weights_only_load_starts_the_optimizer_afresh(service)


def test_a_client_from_a_state_starts_a_new_run(service: wb.ServiceClient) -> None:
    old = service.create_lora_training_client("tiny", rank=4, user_metadata={"who": "old"}).result()
    _train(old, 2)
    path = old.save_state("final").result().path
    fresh = service.create_training_client_from_state(path, user_metadata={"who": "new"}).result()
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert len({old.model_id, fresh.model_id, resumed.model_id}) == 3
    assert (fresh.step, resumed.step) == (0, 2)
    assert torch.equal(*(next(iter(c.engine.inspect(c.model_id).parameters.values())) for c in (old, fresh)))
    # the name the old run used is free in the new runs
    assert fresh.save_state("final").result().path != path
    rest = service.create_rest_client()
    assert rest.get_training_run(fresh.model_id).result().user_metadata == {"who": "new"}
    assert rest.get_training_run(resumed.model_id).result().user_metadata == {}
    with pytest.raises(ValueError, match="was saved on base model 'tiny', not 'smollm2-135m'"):
        service.create_training_client_from_state(path, base_model="smollm2-135m")


def test_a_sampling_client_of_a_saved_path_samples_those_weights(service: wb.ServiceClient) -> None:
    client = service.create_lora_training_client("tiny", rank=4).result()
    _train(client, 2)
    prompt = tinker.ModelInput.from_ints([5, 6, 7, 8, 9, 10])
    at_save = client.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    sampler_path = client.save_weights_for_sampler("w", user_metadata={"k": "v"}).result().path
    state_path = client.save_state("s").result().path
    _train(client, 2)
    live = client.save_weights_and_get_sampling_client().result().compute_logprobs(prompt).result()
    for path in (sampler_path, state_path):
        for sampler in (
            client.create_sampling_client(path).result(),
            service.create_sampling_client(model_path=path).result(),
        ):
            saved = sampler.compute_logprobs(prompt).result()
            assert saved[1:] == pytest.approx(at_save[1:], abs=1e-5)
            assert saved[1:] != pytest.approx(live[1:], abs=1e-3)
    base = service.create_sampling_client(base_model="tiny").result()
    assert base.is_base and base.get_base_model() == "tiny"


def test_checkpoints_through_the_rest_client(service: wb.ServiceClient) -> None:
    client = service.create_lora_training_client(
        "tiny", rank=4, user_metadata={"renderer_name": "r"}
    ).result()
    _train(client)
    kept = client.save_state("kept", user_metadata={"note": "a"}).result().path
    brief = client.save_state("brief", ttl_seconds=3600).result().path
    sampler = client.save_weights_for_sampler("kept").result().path
    rest = service.create_rest_client()
    listed = rest.list_checkpoints(client.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type) for c in listed] == [
        ("weights/kept", "training"),
        ("weights/brief", "training"),
        ("sampler_weights/kept", "sampler"),
    ]
    assert listed[0].user_metadata == {"note": "a"} and listed[0].expires_at is None
    assert listed[1].expires_at is not None and listed[0].tinker_path == kept
    run = rest.get_training_run_by_tinker_path(sampler).result()
    assert (run.user_metadata, run.lora_rank, run.base_model) == ({"renderer_name": "r"}, 4, "tiny")
    assert run.last_checkpoint.tinker_path == brief and run.last_sampler_checkpoint.tinker_path == sampler
    info = rest.get_weights_info_by_tinker_path(kept).result()
    assert (info.lora_rank, info.train_unembed, info.is_lora) == (4, True, True)
    rest.delete_checkpoint_from_tinker_path(brief).result()
    rest.delete_checkpoint(client.model_id, "sampler_weights/kept").result()
    assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints] == [kept]
    runs = rest.list_training_runs().result()
    assert client.model_id in [r.training_run_id for r in runs.training_runs] and runs.cursor.total_count >= 1


def test_finished_runs_are_found_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    with wb.ServiceClient() as first:
        client = first.create_lora_training_client("tiny", rank=4, user_metadata={"a": "b"}).result()
        _train(client)
        path = client.save_state("s").result().path
        model_id = client.model_id
    assert client.engine.closed
    later = wb.ServiceClient()
    rest = later.create_rest_client()
    assert rest.get_training_run(model_id).result().user_metadata == {"a": "b"}
    assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == [path]
    resumed = later.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.step == 1
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert rest.list_checkpoints(model_id).result().checkpoints == []
    with pytest.raises(ValueError, match="no training run 'nope'"):
        rest.get_training_run("nope")
    later.close("success")
    with pytest.raises(RuntimeError, match="closed"):
        later.create_lora_training_client("tiny")


def test_service_clients_open_no_wandb_run(no_wandb_credentials: Path) -> None:
    import wandb

    with wb.ServiceClient() as service:
        client = service.create_lora_training_client("tiny", rank=4).result()
        _train(client)
        client.save_state("s").result()
        assert wandb.run is None
        assert not list(Path(client.engine.model_status(client.model_id).model_dir).rglob("*wandb*"))


def test_a_sessions_service_client_trains_next_to_it_and_leaves_it_open(tiny: wb.Session) -> None:
    with tiny.service_client(base_url="http://unused") as service:
        client = service.create_lora_training_client(tiny.engine.base_info.path, rank=4).result()
        assert client.engine is tiny.engine and client.model_id != tiny.model_id
        _train(client)
    assert not tiny.closed and client.model_id in tiny.engine.model_ids()
    assert any(row["op"] == "optim_step" and row["model"] == "policy_2" for row in tiny.history)


def test_an_unseeded_training_client_takes_its_sessions_seed() -> None:
    """Code written for the SDK rarely passes `seed`: on a session's service client the adapter then
    starts from the session's seed (as `workbench serve` does), so a seeded notebook repeats itself."""
    outputs = []
    for _ in range(2):
        sess = wb.Session("tiny", wb.LoraConfig(rank=4), seed=3, wandb=False)
        client = sess.service_client().create_lora_training_client("tiny", rank=4).result()
        data = [ce_datum([5, 6, 7, 8, 9])]
        client.forward_backward(data, "cross_entropy").result()
        client.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        out = client.forward(data, "cross_entropy").result()
        outputs.append(out.loss_fn_outputs[0]["logprobs"].tolist())
        sess.close()
    assert outputs[0] == outputs[1]
