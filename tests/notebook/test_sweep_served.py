"""A sweep on a served session: its members are ordinary models to the unmodified `tinker` SDK, listed,
sampled from their saved sampler weights and checkpointed by `tinker://` path, while the sweep waits
paused; a member's checkpoint loaded by a client trains on exactly as the member does."""

from __future__ import annotations

from pathlib import Path

import pytest
import tinker
import torch
from tinker import types

import workbench as wb
from tests.datums import sft_datum
from tests.notebook.test_run_checkpoints import sft_step

WAIT_S = 60.0
STEPS = 3
PROMPT = "User: question 9. Assistant:"


def _sdk_datum(datum: wb.Datum) -> types.Datum:
    """`datum` built with the SDK's own types, as a client sends it."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(datum.model_input.to_ints()),
        loss_fn_inputs={key: value.data for key, value in datum.loss_fn_inputs.items()},
    )


def _next_datum(member: wb.Member) -> wb.Datum:
    """The datum `sft_step` trains at the member's next step."""
    cursor = member.loop_state["cursor"]
    return sft_datum(member.tokenizer, f"User: question {cursor}.", f" Assistant: answer {cursor * 7}.")


def _state_bytes(folder: Path) -> dict[str, bytes]:
    """A state checkpoint's adapter and optimizer files (what training changes)."""
    names = ["policy/adapter_model.safetensors", "optimizer/policy.safetensors", "optimizer/policy.json"]
    return {name: (folder / name).read_bytes() for name in names}


@pytest.fixture
def sess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> wb.Session:
    """A tiny session in a models root of the test's own, so the listings show this test's models."""
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    session = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, threads=1, wandb=False)
    yield session
    session.close()


def test_a_sweeps_members_are_listed_sampled_and_checkpointed_over_rest(sess: wb.Session) -> None:
    srv = sess.serve()
    sweep = sess.sweep(sft_step, wb.grid(learning_rate=[1e-2, 3e-3]), STEPS)
    for member in sweep.members:
        member.pause()
    assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
    first, second = sweep.members
    for member in sweep.members:  # at least one step each, so the two differ
        while member.i < 1:
            member.step_once()
            assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
    prompt = wb.ModelInput.from_ints(sess.tokenizer(PROMPT).input_ids)
    with tinker.ServiceClient(base_url=srv.url) as client:
        rest = tinker.RestClient(base_url=srv.url)
        listed = {run.training_run_id for run in rest.list_training_runs().result().training_runs}
        assert listed == {sess.model_id, first.model_id, second.model_id}
        described = rest.get_training_run(first.model_id).result()
        assert described.lora_rank == 4 and described.base_model == "tiny"

        # sampling: a member's saved sampler weights, by their tinker:// path
        weights = first.policy.save_weights_for_sampler("w").result().path
        assert weights == f"tinker://{first.model_id}/sampler_weights/w"
        assert weights in [c.tinker_path for c in rest.list_checkpoints(first.model_id).result().checkpoints]
        remote = client.create_sampling_client(model_path=weights).result()
        params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
        sdk_prompt = types.ModelInput.from_ints(prompt.to_ints())
        drawn = remote.sample(sdk_prompt, 2, params).result()
        local = first.sampling_client().sample(
            prompt, 2, wb.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
        )
        assert [s.tokens for s in drawn.sequences] == [s.tokens for s in local.result().sequences]
        sequence = types.ModelInput.from_ints(prompt.to_ints() + drawn.sequences[0].tokens)
        over_rest = torch.tensor(remote.compute_logprobs(sequence).result()[1:])
        mine = torch.tensor(first.sampling_client().compute_logprobs(sequence).result()[1:])
        theirs = torch.tensor(second.sampling_client().compute_logprobs(sequence).result()[1:])
        torch.testing.assert_close(over_rest, mine, rtol=0, atol=1e-6)
        assert (over_rest - theirs).abs().max() > 1e-4  # the first member's weights, not the second's

        # checkpoints: a client continues a member's state, and a member loads a client's
        saved = first.policy.save_state("s").result().path
        assert saved == f"tinker://{first.model_id}/weights/s"
        twin = client.create_training_client_from_state_with_optimizer(saved).result()
        datum, lr = _next_datum(first), first.adam_params.learning_rate
        twin.forward_backward([_sdk_datum(datum)], "cross_entropy").result()
        twin.optim_step(types.AdamParams(learning_rate=lr)).result()
        twin_saved = twin.save_state("after").result().path
        first.step_once()  # the member's own next step: the same datum at the same learning rate
        assert sweep.wait(WAIT_S) is wb.RunState.PAUSED
        own = first.policy.save_state("after").result().path
        assert _state_bytes(sess.engine.checkpoint_folder(twin_saved)) == _state_bytes(
            sess.engine.checkpoint_folder(own)
        )
        second.policy.load_state_with_optimizer(twin_saved).result()
        assert _state_bytes(
            sess.engine.checkpoint_folder(second.policy.save_state("loaded").result().path)
        ) == (_state_bytes(sess.engine.checkpoint_folder(own)))
    sweep.resume()
    assert sweep.wait(WAIT_S) is wb.RunState.FINISHED
    assert [m.i for m in sweep.members] == [STEPS, STEPS]
