"""Bad input raises a clear ValueError naming the datum and field, and changes nothing."""

from __future__ import annotations

import json

import pytest

import workbench as wb
from tests.datums import ce_datum, ce_inputs

GOOD = [5, 17, 42, 99, 100, 7]


def _raw(model_input=GOOD[:-1], **inputs) -> dict:
    """A datum as a plain dict, so that what `wb.Datum(...)` would refuse at once reaches the call."""
    return {"model_input": model_input, "loss_fn_inputs": ce_inputs(GOOD, **inputs)}


def _rl(**overrides) -> wb.Datum:
    """An RL datum on GOOD: sampler logprob -1 and advantage 0.5 at every position, no weights."""
    n = len(GOOD) - 1
    return ce_datum(GOOD, **{"weights": None, "logprobs": [-1.0] * n, "advantages": [0.5] * n, **overrides})


CASES = [
    (
        "token id out of range",
        lambda v: [ce_datum(GOOD), ce_datum([1, 2, v, 4])],
        "cross_entropy",
        None,
        r"datum 1: model_input: token id \d+ at position 2 is outside the vocabulary",
    ),
    (
        "negative token id",
        lambda v: [ce_datum([1, -3, 2])],
        "cross_entropy",
        None,
        r"datum 0: model_input: token id -3 at position 1",
    ),
    (
        "target out of range",
        lambda v: [ce_datum(GOOD, target_tokens=[1, 2, 3, v, 5])],
        "cross_entropy",
        None,
        r"datum 0: loss_fn_inputs\['target_tokens'\]: token id \d+ at position 3",
    ),
    (
        "non-integer target",
        lambda v: [_raw(target_tokens=[1, 2.5, 3, 4, 5])],
        "cross_entropy",
        None,
        r"datum 0: loss_fn_inputs\['target_tokens'\]: token ids must be integers, got 2.5 at position 1",
    ),
    (
        "integral float targets",
        lambda v: [ce_datum(GOOD), _raw(target_tokens=[6.0, 7.0, 8.0, 9.0, 10.0])],
        "cross_entropy",
        None,
        r"datum 1: loss_fn_inputs\['target_tokens'\]: token ids must be integers, got 6.0 at position 0",
    ),
    (
        "bool targets",
        lambda v: [_raw(target_tokens=[True, False, True, True, True])],
        "cross_entropy",
        None,
        r"datum 0: loss_fn_inputs\['target_tokens'\]: token ids must be integers, got True at position 0",
    ),
    (
        "non-integer token",
        lambda v: [
            {"model_input": {"chunks": [{"tokens": [1, 2.5]}]}, "loss_fn_inputs": {"target_tokens": [1, 2]}}
        ],
        "cross_entropy",
        None,
        r"datum 0: model_input: chunk 0: token ids must be integers, got 2.5 at position 1",
    ),
    (
        "bool token",
        lambda v: [_raw(model_input=[True, 17, 42, 99, 100])],
        "cross_entropy",
        None,
        r"datum 0: model_input: token ids must be integers, got True at position 0",
    ),
    (
        "chunk without tokens",
        lambda v: [_raw(model_input={"chunks": [{}]})],
        "cross_entropy",
        None,
        r"datum 0: model_input: chunk 0 must be a dict with 'tokens'",
    ),
    (
        "chunk that is not a dict",
        lambda v: [_raw(model_input={"chunks": [5]})],
        "cross_entropy",
        None,
        r"datum 0: model_input: chunk 0 must be a dict with 'tokens' \(a list of token ids\), got 5",
    ),
    (
        "loss_fn_config that is not a dict",
        lambda v: [_rl()],
        "ppo",
        [1, 2],
        r"loss_fn_config must be a dict of \{name: number\} or None, got \[1, 2\]",
    ),
    (
        "clip threshold beyond float32",
        lambda v: [_rl()],
        "ppo",
        {"clip_high_threshold": 1e308},
        r"loss_fn_config\['clip_high_threshold'\] must be a finite number that fits in float32",
    ),
    (
        "misaligned weights",
        lambda v: [ce_datum(GOOD, weights=[1.0, 1.0])],
        "cross_entropy",
        None,
        r"datum 0: loss_fn_inputs\['weights'\] has shape \[2\], but model_input has 5 tokens",
    ),
    (
        "misaligned targets",
        lambda v: [ce_datum(GOOD), ce_datum(GOOD, target_tokens=[1, 2, 3, 4, 5, 6])],
        "cross_entropy",
        None,
        r"datum 1: loss_fn_inputs\['target_tokens'\] has shape \[6\]",
    ),
    (
        "missing advantages",
        lambda v: [_rl(advantages=None)],
        "ppo",
        None,
        r"datum 0: loss_fn_inputs is missing \['advantages'\]; this loss needs \['advantages', 'logprobs', 'target_tokens'\]",
    ),
    (
        "missing targets",
        lambda v: [ce_datum(GOOD, target_tokens=None)],
        "cross_entropy",
        None,
        r"datum 0: loss_fn_inputs is missing \['target_tokens'\]",
    ),
    (
        "unknown input key",
        lambda v: [_rl(mask=[1.0] * 5)],
        "ppo",
        None,
        r"datum 0: loss_fn_inputs has unknown key\(s\) \['mask'\]",
    ),
    ("unknown loss", lambda v: [ce_datum(GOOD)], "crossentropy", None, r"unknown loss 'crossentropy'"),
    (
        "unknown config key",
        lambda v: [_rl()],
        "ppo",
        {"clip": 0.2},
        r"unknown loss_fn_config key 'clip' for 'ppo'",
    ),
    ("empty batch", lambda v: [], "cross_entropy", None, r"data is empty"),
    (
        "empty model input",
        lambda v: [wb.Datum(model_input=wb.ModelInput.empty(), loss_fn_inputs={})],
        "cross_entropy",
        None,
        r"datum 0: model_input is empty",
    ),
    (
        "a single datum instead of a list",
        lambda v: ce_datum(GOOD),
        "cross_entropy",
        None,
        r"data must be a list of datums",
    ),
    (
        "too long",
        lambda v: [ce_datum(list(range(1, 10)) * 60)],
        "cross_entropy",
        None,
        r"datum 0: model_input has 539 tokens, more than the model's context of 512",
    ),
    (
        "NaN advantage",
        lambda v: [_rl(), _rl(advantages=[0.1, float("nan"), 0.0, 0.0, 0.0])],
        "ppo",
        None,
        r"datum 1: loss_fn_inputs\['advantages'\] has a non-finite value nan at position 1",
    ),
    (
        "inf logprob",
        lambda v: [_rl(logprobs=[-1.0, -1.0, float("-inf"), -1.0, -1.0])],
        "importance_sampling",
        None,
        r"datum 0: loss_fn_inputs\['logprobs'\] has a non-finite value -inf at position 2",
    ),
    (
        "critic loss on the policy",
        lambda v: [ce_datum(GOOD)],
        "ppo_critic",
        None,
        r"'ppo_critic' is the critic's loss",
    ),
    (
        "not a datum",
        lambda v: ["hello"],
        "cross_entropy",
        None,
        r"datum 0: a datum must be a Datum or a dict",
    ),
]


@pytest.mark.parametrize(("case", "build", "loss", "config", "message"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("method", ["forward_backward", "forward"])
def test_bad_input_raises_and_changes_nothing(
    tiny: wb.Session, case, build, loss, config, message, method
) -> None:
    tiny.policy.forward_backward([ce_datum(GOOD)], "cross_entropy").result()  # some accumulated gradient
    tiny.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
    tiny.policy.forward_backward([ce_datum(GOOD)], "cross_entropy").result()
    before = tiny.state_digest()
    history_before = len(tiny.history)
    data = build(tiny.base_info.vocab_size)
    with pytest.raises(ValueError, match=message):
        getattr(tiny.policy, method)(data, loss, config)
    assert tiny.state_digest() == before
    assert len(tiny.history) == history_before
    # the session is still usable
    assert tiny.policy.optim_step().result().applied


def test_bad_adam_params_raise_before_queueing(tiny: wb.Session) -> None:
    tiny.policy.forward_backward([ce_datum(GOOD)], "cross_entropy").result()
    before = tiny.state_digest()
    for bad in (
        {"learning_rate": -1.0},
        {"learning_rate": 1e30},
        {"beta1": 1.0},
        {"eps": 0.0},
        {"eps": 1e-46},
        {"grad_clip_norm": float("nan")},
        {"lr": 1e-3},
    ):
        with pytest.raises(ValueError):
            tiny.policy.optim_step(bad)
    assert tiny.state_digest() == before


def test_custom_loss_must_return_a_differentiable_scalar(tiny: wb.Session) -> None:
    data = [ce_datum(GOOD)]
    before = tiny.state_digest()
    with pytest.raises(ValueError, match="must return \\(loss, metrics\\)"):
        tiny.policy.forward_backward_custom(data, lambda d, lp: lp[0].sum()).result()
    with pytest.raises(ValueError, match="does not depend on the logprobs"):
        tiny.policy.forward_backward_custom(data, lambda d, lp: (lp[0].detach().sum(), {})).result()
    with pytest.raises(ValueError, match="needs a function"):
        tiny.policy.forward_backward_custom(data, "cross_entropy")
    assert tiny.state_digest() == before


def test_a_checkpoints_lifetime_and_metadata_are_checked_before_saving(tiny: wb.Session) -> None:
    before = tiny.state_digest()
    for bad, message in (
        ({"ttl_seconds": 10**30}, "ttl_seconds must be"),
        ({"ttl_seconds": 1.5}, "ttl_seconds must be"),
        ({"user_metadata": {"k": "\ud800"}}, r"user_metadata\['k'\]"),
        ({"user_metadata": {"\udfff": "v"}}, "user_metadata"),
    ):
        with pytest.raises(ValueError, match=message):
            tiny.policy.save_state("c", **bad)
        with pytest.raises(ValueError, match=message):
            tiny.policy.save_weights_for_sampler("c", **bad)
    with pytest.raises(ValueError, match="user_metadata"):
        tiny.engine.create_model(wb.LoraConfig(rank=4), user_metadata={"k": "\ud800"})
    assert tiny.state_digest() == before and tiny.list_checkpoints() == []


def test_one_unreadable_checkpoint_does_not_break_the_listing(tiny: wb.Session) -> None:
    tiny.policy.save_state("good").result()
    bad = tiny.policy.save_state("bad").result()
    info_file = tiny.model_dir / "checkpoints" / "bad" / "config.json"
    info = json.loads(info_file.read_text())
    for broken in ({"expires_at": 1e300}, {"user_metadata": {"k": "\ud800"}}):
        info_file.write_text(json.dumps({**info, **broken}))
        with pytest.warns(RuntimeWarning, match="skipping checkpoint"):
            assert [c.name for c in tiny.list_checkpoints()] == ["good"]
    assert bad.path


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"rank": 2**40}, "rank must be a positive integer up to 1024"),
        ({"rank": 0}, "rank must be a positive integer"),
        ({"seed": 10**300}, "seed must be None or an integer"),
        ({"train_mlp": "yes"}, "train_mlp must be True or False"),
    ],
)
def test_lora_settings_are_bounded(arguments: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wb.LoraConfig(**arguments)


def test_wrong_types_raise_a_value_error_naming_the_field_before_queueing(tiny: wb.Session) -> None:
    tiny.policy.forward_backward([ce_datum(GOOD)], "cross_entropy").result()
    saved = tiny.policy.save_state("good").result().path
    before = tiny.state_digest()
    sampler = tiny.sampling_client()
    params = wb.SamplingParams(max_tokens=2)
    service = tiny.service_client()
    for call, field in (
        (lambda: tiny.policy.optim_step(5), "adam_params"),
        (lambda: tiny.policy.optim_step({"learning_rate": None}), "learning_rate"),
        (lambda: sampler.sample(None, 1, params), "model_input"),
        (lambda: sampler.sample(GOOD, 1, 5), "sampling_params"),
        (lambda: sampler.sample(GOOD, 1, params, include_prompt_logprobs="yes"), "include_prompt_logprobs"),
        (lambda: sampler.compute_logprobs(None), "model_input"),
        (
            lambda: tiny.policy.forward_backward(
                [wb.Datum(model_input=5, loss_fn_inputs={})], "cross_entropy"
            ),
            "model_input",
        ),
        (lambda: tiny.policy.load_state(None), "path"),
        (lambda: tiny.policy.load_state(5), "path"),
        (lambda: service.create_sampling_client(5), "model_path"),
        (lambda: tiny.policy.save_state("good", overwrite="yes"), "overwrite"),
        (lambda: tiny.policy.save_state("good", overwrite=1), "overwrite"),
    ):
        with pytest.raises(ValueError, match=field):
            call()
    assert tiny.state_digest() == before
    assert tiny.policy.load_state(saved).result()  # the checkpoint was not overwritten
    with pytest.raises(ValueError, match="learning_rate"):
        wb.AdamParams(learning_rate=None)


def test_a_base_model_that_is_neither_a_folder_nor_known_is_named_as_such() -> None:
    with pytest.raises(ValueError, match="no such model folder"):
        wb.Session("/nonexistent", wandb=False)
    with pytest.raises(ValueError, match="no such model folder"):
        wb.Session("./no/such/model", wandb=False)


def test_a_live_sessions_run_folder_cannot_be_taken_by_another(tiny: wb.Session) -> None:
    model_dir = tiny.model_dir
    run_info = (model_dir / "run.json").read_bytes()
    with pytest.raises(ValueError, match="in use"):
        wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=model_dir, wandb=False)
    assert (model_dir / "run.json").read_bytes() == run_info
    tiny.close()
    again = wb.Session("tiny", wb.LoraConfig(rank=4), model_dir=model_dir, wandb=False)  # free once closed
    again.close()
