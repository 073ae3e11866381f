"""Tinker's API invariants on two ranks: the one-device tests' own bodies, run on `devices=2`.

The tests bound below are those of the modules they come from (loss formulas, split invariance, the
optimizer's fields, failures undone, soft targets, loads and RNG states, seeded and pinned samplers),
collected here a second time, unchanged. What differs is the session they get: every
`wb.Session("tiny", ...)` a test or its fixture makes (`tiny`, the checkpoint tests' `sess`) is a new
model on one two-rank engine the module shares (starting a rank takes seconds, a model a fraction of
one), and closing it first checks that both ranks hold the same model, bit for bit, after everything
the test did. A test's own one-device arithmetic (a hand-written AdamW, a plain transformers forward,
the full-vocabulary cross-entropy, the same datums in other calls) is then what two ranks are held to;
`tests/engine/test_devices.py` compares two ranks with one device call by call.

Left out: tests that watch the engine's internals on rank 0 alone (hooks counting passes, a patched
loss table), that need engine settings of their own (a micro-batch budget, threads), that compare two
models' digests or checkpoint names (the adapters of models on one engine are named apart), and the
slower repeats of what is kept, so that the module stays within seconds past its engine's start.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import torch

import workbench as wb
from tests import test_soft_targets as soft_targets
from tests.datums import ce_datum, ragged_ce_batch, random_tokens
from tests.engine.local import test_checkpoints as checkpoints
from tests.engine.local import test_training as training
from tests.engine.samplers import test_sampler_contract as sampler_contract
from workbench.engine.local.data_parallel import split_by_tokens
from workbench.engine.local.engine import Engine
from workbench.engine.model.batching import PreparedDatum
from workbench.sdk_conversion import to_lora_config
from workbench.storage.model_folders import models_root, new_model_id

RELATIVE = 1e-5


class ModelOnSharedRanks(wb.Session):
    """A session for one new model on an engine that outlives it (the module's two ranks): `close`
    checks that both ranks hold the same model (each role's weights, gradient, optimizer state and
    counters; the sampling generator is rank 0's alone), then deletes it and leaves the engine."""

    def __init__(
        self,
        engine: Engine,
        lora: wb.LoraConfig | Mapping[str, Any] | None,
        critic: bool | wb.LoraConfig,
        seed: int,
        model_dir: str | Path | None,
    ) -> None:
        folder = (
            Path(model_dir) if model_dir is not None else models_root() / new_model_id("tiny")
        ).absolute()
        lora_config = to_lora_config(lora if lora is not None else wb.LoraConfig())
        model_id = engine.create_model(
            lora_config, seed=seed, model_id=folder.name, model_dir=folder
        ).result()
        if critic is not False:
            engine.create_critic(model_id, None if critic is True else to_lora_config(critic)).result()
        self._attach(engine, model_id, wandb=False)
        self._model_closed = False

    @property
    def closed(self) -> bool:
        return self._model_closed or self.engine.closed

    def close(self) -> None:
        if self.closed:
            return
        self._model_closed = True
        roles = [wb.Role.POLICY] if self.critic is None else [wb.Role.POLICY, wb.Role.CRITIC]
        digests = {role: self.engine.rank_digests(self.model_id, role) for role in roles}
        self.engine.history.sinks.remove(self._history_sink)
        self._history_sink.close()
        self.engine.delete_model(self.model_id).result()
        for role, (own, other) in digests.items():
            assert own == other, f"the two ranks' {role.value} models differ"


@pytest.fixture(scope="module")
def ranks() -> Iterator[Engine]:
    """The module's engine: tiny on two CPU ranks, seed 0 (as `wb.Session("tiny", seed=0)` makes)."""
    engine = Engine("tiny", seed=0, devices=2)
    yield engine
    engine.close()


@pytest.fixture(autouse=True)
def sessions_on_two_ranks(ranks: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    """`wb.Session(...)` makes a new model on the module's two ranks; an argument that would need an
    engine of its own (a micro-batch budget, threads, another base) is refused (TypeError)."""

    def on_two_ranks(
        base_model: str = "tiny",
        lora: wb.LoraConfig | Mapping[str, Any] | None = None,
        *,
        critic: bool | wb.LoraConfig = False,
        seed: int = 0,
        model_dir: str | Path | None = None,
        wandb: object = None,
        **engine_settings: object,
    ) -> ModelOnSharedRanks:
        if base_model != "tiny" or seed != 0 or engine_settings:
            raise TypeError(f"the module's two ranks run tiny with seed 0 and no {sorted(engine_settings)}")
        return ModelOnSharedRanks(ranks, lora, critic, seed, model_dir)

    monkeypatch.setattr(wb, "Session", on_two_ranks)


@pytest.fixture
def backend() -> str:
    """The sampler contract's backend: the engine's own, HF's."""
    return "hf"


sess = checkpoints.sess


def test_the_sessions_here_are_models_on_two_ranks(tiny: wb.Session, sess: wb.Session, ranks: Engine) -> None:
    """The fixtures the tests below take, and the sessions their bodies make, are the module's models."""
    assert ranks.devices == ["cpu", "cpu"] and len(ranks.rank_pids) == 1 and ranks.config.sampler == "hf"
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0) as made:
        assert tiny.engine is sess.engine is made.engine is ranks
        assert sess.critic is not None and made.model_id in ranks.model_ids()
    assert made.model_id not in ranks.model_ids()
    with pytest.raises(TypeError, match="tiny with seed 0"):
        wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, max_tokens_per_microbatch=64)


def test_a_datums_outputs_do_not_depend_on_the_call_it_is_in(tiny: wb.Session) -> None:
    """Per-datum independence across ranks: each datum's logprobs and loss in a call of ragged datums
    and a shared-prefix group among them (split over the two ranks by tokens, the group whole on one,
    in one shared-prefix pass) equal those of the datum alone (on rank 0, a plain pass) and of the call
    in reverse order (another split), in datum order."""
    rng = random.Random(12)
    prompt = random_tokens(rng, 24, 900)
    group = [ce_datum(prompt + random_tokens(rng, rng.randint(3, 6), 900)) for _ in range(3)]
    loose = ragged_ce_batch(seed=11, count=4, min_len=3, max_len=30, vocab=900)
    data = [loose[0], group[0], loose[1], group[1], loose[2], group[2], loose[3]]
    tokens = [PreparedDatum(torch.tensor(datum.model_input.to_ints()), {}) for datum in data]
    shards = split_by_tokens(tokens, 2)
    assert all(shards) and any({1, 3, 5} <= set(shard) for shard in shards), shards
    whole = tiny.policy.forward(data, "cross_entropy").result()
    backwards = tiny.policy.forward(data[::-1], "cross_entropy").result()
    for index, datum in enumerate(data):
        alone = tiny.policy.forward([datum], "cross_entropy").result().loss_fn_outputs[0]
        for other in (alone, backwards.loss_fn_outputs[len(data) - 1 - index]):
            for name in ("logprobs", "elementwise_loss"):
                mine, theirs = whole.loss_fn_outputs[index][name].to_torch(), other[name].to_torch()
                scale = max(float(theirs.abs().max()), 1e-6)
                assert float((mine - theirs).abs().max()) <= RELATIVE * scale, (index, name)
    assert whole.metrics["loss:sum"] == pytest.approx(backwards.metrics["loss:sum"], rel=RELATIVE)


# loss formulas, split invariance, the optimizer, failures undone on both ranks
test_forward_backward_outputs_align_with_targets = training.test_forward_backward_outputs_align_with_targets
test_logprobs_match_a_plain_transformers_forward = training.test_logprobs_match_a_plain_transformers_forward
test_forward_changes_nothing = training.test_forward_changes_nothing
test_rl_losses_run_and_report_diagnostics = training.test_rl_losses_run_and_report_diagnostics
test_gspo_and_dppo_run_on_the_engine = training.test_gspo_and_dppo_run_on_the_engine
test_gradient_accumulation_equals_one_big_batch = training.test_gradient_accumulation_equals_one_big_batch
test_optim_step_honours_every_adam_field_on_every_call = (
    training.test_optim_step_honours_every_adam_field_on_every_call
)
test_finite_gradients_whose_float32_norm_overflows_are_kept_and_clipped = (
    training.test_finite_gradients_whose_float32_norm_overflows_are_kept_and_clipped
)
test_a_step_that_would_leave_nan_weights_is_undone = (
    training.test_a_step_that_would_leave_nan_weights_is_undone
)
test_failure_inside_an_operation_leaves_the_accumulated_gradient = (
    training.test_failure_inside_an_operation_leaves_the_accumulated_gradient
)

# soft targets: (N, K) target_tokens and weights
test_with_every_token_as_a_target_it_is_the_full_vocabulary_cross_entropy = (
    soft_targets.test_with_every_token_as_a_target_it_is_the_full_vocabulary_cross_entropy
)
test_soft_targets_train_as_their_hard_targets_accumulated = (
    soft_targets.test_soft_targets_train_as_their_hard_targets_accumulated
)
test_custom_losses_get_n_by_k_logprobs = soft_targets.test_custom_losses_get_n_by_k_logprobs

# a state's RNGs saved and loaded
test_rng_states_round_trip_and_a_missing_cuda_state_is_loud = (
    checkpoints.test_rng_states_round_trip_and_a_missing_cuda_state_is_loud
)

# seeds and pinned samplers
test_seeded_samples_are_reproducible_and_seeds_differ = (
    sampler_contract.test_seeded_samples_are_reproducible_and_seeds_differ
)
test_a_response_reports_the_pinned_version_and_samples_its_weights = (
    sampler_contract.test_a_response_reports_the_pinned_version_and_samples_its_weights
)
test_logprobs_agree_with_the_training_models_forward = (
    sampler_contract.test_logprobs_agree_with_the_training_models_forward
)
