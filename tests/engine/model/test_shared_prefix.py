"""shared_prefix.py and prefix_attention.py: which datums share a prefix, and a shared-prefix pass gives
what the plain pass gives (losses, `loss_fn_outputs`, every LoRA gradient) for every loss, the critic,
the reference, custom losses, soft targets, with streams, micro-batches and activation checkpointing,
on every attention variant (GQA, sliding windows, sinks, latent attention), experts, and in bf16.

Sharing is decided by a measured cost (`PREFIX_PASS_OVERHEAD_TOKENS`); the tests inject it: 0 makes
every common prefix shared, infinity none, and the same call runs both ways on the same weights."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import workbench as wb
from tests.datums import random_tokens
from workbench.engine.model import shared_prefix
from workbench.engine.model.shared_prefix import (
    PrefixGroup,
    find_groups,
    plan_shared_passes,
    spread_shared_passes,
)

VOCAB = 200  # token ids below the tiny model's vocabulary
RELATIVE = 1e-5


# ---------------------------------------------------------------------------------------------- the rule


def _tensors(sequences: list[list[int]]) -> list[torch.Tensor]:
    return [torch.tensor(tokens) for tokens in sequences]


def test_completions_of_a_prompt_form_one_group_each() -> None:
    rng = random.Random(0)
    prompts = [random_tokens(rng, 40, VOCAB) for _ in range(3)]
    sequences, expected = [], []
    for prompt in prompts:
        start = len(sequences)
        sequences += [prompt + random_tokens(rng, rng.randint(3, 9), VOCAB) for _ in range(4)]
        expected.append(list(range(start, start + 4)))
    order = list(range(len(sequences)))
    rng.shuffle(order)
    shuffled = [sequences[i] for i in order]
    groups = find_groups(_tensors(shuffled), overhead_tokens=10)
    found = sorted(sorted(order[i] for i in group.indices) for group in groups)
    assert found == expected
    for group in groups:
        assert group.prefix_length >= 40  # the prompt, and any completion tokens that happen to agree


def test_sharing_is_chosen_by_the_injected_cost() -> None:
    rng = random.Random(1)
    prompt = random_tokens(rng, 30, VOCAB)
    sequences = [prompt + random_tokens(rng, 5, VOCAB) for _ in range(3)]
    # two extra datums save 2 × 30 = 60 tokens: shared below that cost, not above it
    assert [g.indices for g in find_groups(_tensors(sequences), overhead_tokens=59)] == [[0, 1, 2]]
    assert find_groups(_tensors(sequences), overhead_tokens=61) == []
    assert find_groups(_tensors(sequences), overhead_tokens=math.inf) == []


def test_two_long_prompts_beat_one_short_common_header() -> None:
    rng = random.Random(2)
    header = random_tokens(rng, 10, VOCAB)
    prompts = [header + random_tokens(rng, 100, VOCAB) for _ in range(2)]
    sequences = [prompt + random_tokens(rng, 4, VOCAB) for prompt in prompts for _ in range(8)]
    groups = find_groups(_tensors(sequences), overhead_tokens=20)
    assert sorted(group.indices for group in groups) == [list(range(8)), list(range(8, 16))]


def test_a_prefix_stops_short_of_the_shortest_datum_and_unrelated_datums_share_nothing() -> None:
    rng = random.Random(3)
    base = random_tokens(rng, 20, VOCAB)
    groups = find_groups(_tensors([base, [*base, 1, 2], base[:15]]), overhead_tokens=0)
    assert groups == [PrefixGroup([0, 1, 2], 14)]
    unrelated = [[k, *random_tokens(rng, 30, VOCAB)] for k in range(6)]
    assert find_groups(_tensors(unrelated), overhead_tokens=0) == []


def _few_shot_batch(rng: random.Random) -> list[list[int]]:
    """A group-RL batch whose prompts share a header: 8 problems' prompts (a 60-token header, the same
    for all, as a system prompt with worked examples is, then a 10-token question), 4 completions of 8
    to 15 tokens each."""
    header = random_tokens(rng, 60, VOCAB)
    sequences: list[list[int]] = []
    for _ in range(8):
        prompt = header + random_tokens(rng, 10, VOCAB)
        sequences += [prompt + random_tokens(rng, rng.randint(8, 15), VOCAB) for _ in range(4)]
    return sequences


def test_on_streams_no_group_holds_the_whole_call() -> None:
    """One run over the header saves the most tokens (31 x 60), but it is one pass, on one stream; on
    two streams the groups are capped at the call's tokens per stream and both streams get work."""
    sequences = _few_shot_batch(random.Random(4))
    tokens, lengths = _tensors(sequences), [len(sequence) for sequence in sequences]
    one_stream = shared_prefix.groups_for_streams(tokens, overhead_tokens=16, streams=1)
    assert one_stream == find_groups(tokens, overhead_tokens=16)
    assert [len(group.indices) for group in one_stream] == [32]
    whole_call = shared_prefix.group_tokens(one_stream[0], lengths)
    two_streams = shared_prefix.groups_for_streams(tokens, overhead_tokens=16, streams=2)
    grouped = [shared_prefix.group_tokens(group, lengths) for group in two_streams]
    assert len(two_streams) >= 2
    assert max(grouped) <= (whole_call + 16) / 2  # the single run's tokens per stream
    assert (sum(grouped) + 16 * len(two_streams)) / 2 < 0.7 * whole_call  # the streams' time, about
    assert all(group.prefix_length >= 60 for group in two_streams)  # the header at least


def test_one_long_group_stays_one_group_on_streams() -> None:
    """Capping a group at half the call's tokens would leave nothing worth sharing: the plan keeps it."""
    rng = random.Random(5)
    prompt = random_tokens(rng, 400, VOCAB)
    sequences = [prompt + random_tokens(rng, 30, VOCAB) for _ in range(8)]
    groups = shared_prefix.groups_for_streams(_tensors(sequences), overhead_tokens=48, streams=2)
    assert groups == [PrefixGroup(list(range(8)), 400)]


def test_no_group_computes_more_than_the_cap() -> None:
    rng = random.Random(6)
    prompt = random_tokens(rng, 100, VOCAB)
    sequences = [prompt + random_tokens(rng, 10, VOCAB) for _ in range(8)]
    lengths = [len(sequence) for sequence in sequences]
    for cap in (130, 150, 200, 500):
        groups = find_groups(_tensors(sequences), overhead_tokens=0, largest_group_tokens=cap)
        assert groups and all(shared_prefix.group_tokens(group, lengths) <= cap for group in groups)
    assert find_groups(_tensors(sequences), overhead_tokens=0, largest_group_tokens=119) == []


def test_passes_hold_whole_groups_within_the_budget() -> None:
    groups = [PrefixGroup([4 * g + k for k in range(4)], 50 + g) for g in range(6)]
    lengths = [50 + g + 10 for g in range(6) for _ in range(4)]
    passes = plan_shared_passes(groups, lengths, token_budget=250)
    assert sorted(i for p in passes for group in p for i in group.indices) == list(range(24))
    for pass_groups in passes:
        assert shared_prefix.computed_tokens(pass_groups, lengths) <= 250 or len(pass_groups) == 1
    assert len(passes) == 3  # 2 groups of (55 + 4 × 10) computed tokens each fit 250


def test_on_streams_the_groups_spread_evenly_over_the_passes() -> None:
    """Six equal groups on two streams: packed to a 512-token budget they make passes of 4 and 2 groups
    (one stream idle half the call); spread, 3 and 3."""
    groups = [PrefixGroup([4 * g + k for k in range(4)], 40) for g in range(6)]
    lengths = [56] * 24  # each group computes 40 + 4 × 16 = 104 tokens
    packed = plan_shared_passes(groups, lengths, token_budget=512)
    assert [len(p) for p in packed] == [4, 2]
    spread = spread_shared_passes(groups, lengths, count=2, token_budget=1024)
    assert [len(p) for p in spread] == [3, 3]
    assert sorted(i for p in spread for group in p for i in group.indices) == list(range(24))


def test_spread_passes_put_the_largest_group_first_and_respect_the_budget() -> None:
    sizes = [8, 5, 4, 3, 2, 2]  # datums per group, each datum 10 tokens after a 20-token prefix
    groups, lengths, first = [], [], 0
    for size in sizes:
        groups.append(PrefixGroup(list(range(first, first + size)), 20))
        lengths += [30] * size
        first += size
    tokens = [shared_prefix.group_tokens(group, lengths) for group in groups]  # 100, 70, 60, 50, 40, 40
    spread = spread_shared_passes(groups, lengths, count=2, token_budget=1000)
    loads = [sum(shared_prefix.group_tokens(g, lengths) for g in p) for p in spread]
    assert sorted(loads, reverse=True) == loads and max(loads) - min(loads) <= max(tokens) - min(tokens)
    assert sum(loads) == sum(tokens)
    assert loads == [190, 170]  # 100 + 50 + 40 against 70 + 60 + 40: packed to 1000, all in one
    # more passes than groups leaves none empty; a budget only the largest group breaks puts it alone
    assert len(spread_shared_passes(groups[:2], lengths, count=4, token_budget=1000)) == 2
    tight = spread_shared_passes(groups, lengths, count=2, token_budget=90)
    assert [groups[0]] in tight
    assert all(shared_prefix.computed_tokens(p, lengths) <= 90 or len(p) == 1 for p in tight)


# ---------------------------------------------------------------------------------------------- the engine


def _random_groups(rng: random.Random, max_group: int = 16, max_prefix: int = 480) -> list[list[int]]:
    """Random prefix groups (G = 1..max_group, prefix 1..max_prefix, ragged suffixes) and two unrelated
    datums, in a shuffled submission order (480: the tiny model's context is 512 tokens)."""
    sequences: list[list[int]] = []
    for _ in range(rng.randint(1, 3)):
        prefix = random_tokens(rng, rng.randint(1, max_prefix), VOCAB)
        sequences += [
            prefix + random_tokens(rng, rng.randint(2, 24), VOCAB) for _ in range(rng.randint(1, max_group))
        ]
    sequences += [random_tokens(rng, rng.randint(2, 60), VOCAB) for _ in range(2)]
    rng.shuffle(sequences)
    return sequences


def _values(rng: random.Random, n: int, low: float, high: float) -> list[float]:
    return [rng.uniform(low, high) for _ in range(n)]


def _datum(rng: random.Random, tokens: list[int], loss: str) -> wb.Datum:
    """A datum for `loss` with random inputs at every position, the prefix's included."""
    n = len(tokens) - 1
    inputs: dict[str, Any] = {"target_tokens": tokens[1:]}
    if loss == "cross_entropy":
        inputs["weights"] = _values(rng, n, 0.0, 2.0)
    elif loss == "soft_cross_entropy":
        inputs["target_tokens"] = torch.tensor([[rng.randrange(VOCAB) for _ in range(3)] for _ in range(n)])
        inputs["weights"] = torch.tensor([_values(rng, 3, 0.0, 1.0) for _ in range(n)])
    elif loss == "ppo_critic":
        inputs.update(values=_values(rng, n, -1, 1), returns=_values(rng, n, -1, 1))
        inputs["weights"] = _values(rng, n, 0.0, 1.0)
    else:
        inputs.update(logprobs=_values(rng, n, -8.0, -1.0), advantages=_values(rng, n, -1.0, 1.0))
        if loss == "gspo":
            inputs["sequence_ratio_mask"] = [float(rng.random() < 0.7) for _ in range(n - 1)] + [1.0]
    return wb.Datum(model_input=wb.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)


@pytest.fixture(scope="module")
def trained() -> Iterator[wb.Session]:
    """A tiny session with a critic, trained a little (so no LoRA B and no value head weight is zero)."""
    rng = random.Random(10)
    with wb.Session("tiny", wb.LoraConfig(rank=4), critic=True, seed=0, wandb=False) as sess:
        data = [_datum(rng, random_tokens(rng, 30, VOCAB), "cross_entropy") for _ in range(4)]
        sess.policy.forward_backward(data, "cross_entropy").result()
        sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        critic_data = [_datum(rng, random_tokens(rng, 30, VOCAB), "ppo_critic") for _ in range(4)]
        for _ in range(2):  # the value head, then the adapter's B through it
            sess.critic.forward_backward(critic_data, "ppo_critic").result()
            sess.critic.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        yield sess


def _both_ways(
    sess: wb.Session, role: wb.Role, call: Callable[[], Any], monkeypatch: pytest.MonkeyPatch
) -> list[tuple[Any, dict[str, torch.Tensor], dict[str, Any]]]:
    """`call` without sharing, then with every common prefix shared: its output, the gradient it
    left (cleared after by a zero-learning-rate step) and its history row."""
    results = []
    for overhead in (math.inf, 0.0):
        monkeypatch.setattr(shared_prefix, "PREFIX_PASS_OVERHEAD_TOKENS", overhead)
        output = call()
        gradients = {
            name: grad.clone()
            for name, grad in sess.engine.inspect(sess.model_id, role).gradients.items()
            if grad is not None
        }
        row = dict(sess.history.rows[-1])
        if gradients:
            client = sess.critic if role is wb.Role.CRITIC else sess.policy
            client.optim_step(wb.AdamParams(learning_rate=0.0)).result()
        results.append((output, gradients, row))
    return results


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=RELATIVE, atol=RELATIVE * scale, msg=what)


def _assert_same(plain: tuple, shared: tuple) -> None:
    (out_plain, grads_plain, row_plain), (out_shared, grads_shared, row_shared) = plain, shared
    assert row_shared["computed_tokens:sum"] < row_plain["computed_tokens:sum"]
    assert row_shared["submitted_tokens:sum"] == row_plain["submitted_tokens:sum"]
    assert row_plain["computed_tokens:sum"] == row_plain["submitted_tokens:sum"]
    assert out_shared.metrics.keys() == out_plain.metrics.keys()
    for name, value in out_plain.metrics.items():
        # a position counts as clipped where (clip(V) − R)² > (V − R)²; unclipped, the two differ only by
        # the rounding of V_old + (V − V_old), so last-bit differences in V flip some of those positions
        tolerance = 0.01 if name == "value_clip_fraction:mean" else 1e-6
        assert out_shared.metrics[name] == pytest.approx(value, rel=RELATIVE, abs=tolerance), name
    for d, (a, b) in enumerate(zip(out_shared.loss_fn_outputs, out_plain.loss_fn_outputs, strict=True)):
        assert a.keys() == b.keys()
        for key in b:
            _close(a[key].to_torch(), b[key].to_torch(), f"datum {d} {key}")
    assert grads_shared.keys() == grads_plain.keys()
    assert grads_plain, "the call trained nothing"
    for name, grad in grads_plain.items():
        assert grad.abs().max() > 0, name
        _close(grads_shared[name], grad, name)


POLICY_LOSSES = [
    "cross_entropy",
    "soft_cross_entropy",
    "importance_sampling",
    "ppo",
    "cispo",
    "dro",
    "gspo",
    "dppo",
]


def _in_parts(sess: wb.Session, monkeypatch: pytest.MonkeyPatch) -> None:
    """Give the session's model a full-activation limit F of 120 tokens, so that a training pass of one
    group over F / 2 = 60 computed tokens runs in parts (`prefix_parts`), most of the random groups'."""
    monkeypatch.setattr(sess.engine._state.model, "full_activation_limit", 120)


@pytest.mark.parametrize("in_parts", [False, True])
@pytest.mark.parametrize("loss", POLICY_LOSSES)
def test_every_policy_loss_gives_the_plain_pass_results(
    trained: wb.Session, loss: str, in_parts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(POLICY_LOSSES.index(loss))
    data = [_datum(rng, tokens, loss) for tokens in _random_groups(rng)]
    if in_parts:
        _in_parts(trained, monkeypatch)
    name = "cross_entropy" if loss == "soft_cross_entropy" else loss
    plain, shared = _both_ways(
        trained, wb.Role.POLICY, lambda: trained.policy.forward_backward(data, name).result(), monkeypatch
    )
    _assert_same(plain, shared)


@pytest.mark.parametrize("in_parts", [False, True])
def test_the_critic_gives_the_plain_pass_results(
    trained: wb.Session, in_parts: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(20)
    data = [_datum(rng, tokens, "ppo_critic") for tokens in _random_groups(rng)]
    if in_parts:
        _in_parts(trained, monkeypatch)
    plain, shared = _both_ways(
        trained,
        wb.Role.CRITIC,
        lambda: trained.critic.forward_backward(data, "ppo_critic").result(),
        monkeypatch,
    )
    _assert_same(plain, shared)


@pytest.mark.parametrize("budget", [None, 200])
def test_a_custom_loss_gives_the_plain_pass_results(
    budget: int | None, trained: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One pass (the loss sees the live graph) and, with a 200-token budget, several (the surrogate)."""
    rng = random.Random(30)
    data = [_datum(rng, tokens, "cross_entropy") for tokens in _random_groups(rng, max_prefix=150)]

    def loss_fn(batch: list[wb.Datum], logprobs_list: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        per_datum = [
            (lp * d.loss_fn_inputs["weights"].to_torch()).mean().exp()
            for d, lp in zip(batch, logprobs_list, strict=True)
        ]
        return torch.stack(per_datum).sum(), {"first": float(per_datum[0].detach())}

    if budget is not None:
        state = trained.engine._state
        monkeypatch.setattr(
            state, "config", dataclasses.replace(state.config, max_tokens_per_microbatch=budget)
        )
    plain, shared = _both_ways(
        trained,
        wb.Role.POLICY,
        lambda: trained.policy.forward_backward_custom(data, loss_fn).result(),
        monkeypatch,
    )
    _assert_same(plain, shared)


def test_forward_and_the_reference_give_the_plain_pass_results(
    trained: wb.Session, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(40)
    data = [_datum(rng, tokens, "importance_sampling") for tokens in _random_groups(rng)]
    for client in (trained.policy, trained.reference):
        plain, shared = _both_ways(
            trained,
            wb.Role.POLICY,
            lambda client=client: client.forward(data, "importance_sampling").result(),
            monkeypatch,
        )
        assert not plain[1] and not shared[1]  # a forward leaves no gradient
        plain = (plain[0], {"-": torch.ones(1)}, plain[2])
        shared = (shared[0], {"-": torch.ones(1)}, shared[2])
        _assert_same(plain, shared)


@pytest.mark.parametrize("threads", [1, 2])
def test_streams_and_activation_checkpointing_give_the_plain_pass_results(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one thread and on two streams, and with a full-activation limit of 300 tokens, so that
    larger passes checkpoint their layers and recompute their logits in backward."""
    rng = random.Random(50 + threads)
    data = [_datum(rng, tokens, "ppo") for tokens in _random_groups(rng, max_group=8, max_prefix=300)]
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, threads=threads) as sess:
        sess.policy.forward_backward(data, "ppo").result()
        sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        sess.engine._state.model.full_activation_limit = 300
        plain, shared = _both_ways(
            sess, wb.Role.POLICY, lambda: sess.policy.forward_backward(data, "ppo").result(), monkeypatch
        )
    _assert_same(plain, shared)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_long_group_trains_in_parts_with_part_of_its_prefix_recomputed(
    threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One group of 8 datums, a 100-token prefix and 10-token suffixes (180 computed tokens), with F = 160:
    over F / 2 = 80, so the pass runs in parts of 2 datums (a quarter of 80 tokens) and checkpoints the
    first of the 2 layers (what the prefix keeps, 100 · (1 − 1/2) tokens' worth, within 80 − 20). The
    first layer's MLP runs for the prefix, again in backward, and for each of the 4 parts; the second's
    for the prefix and each part. The results are the plain pass's."""
    from tests.engine.model.test_activation_checkpointing import _mlp_calls

    rng = random.Random(70 + threads)
    prefix = random_tokens(rng, 100, VOCAB)
    data = [_datum(rng, prefix + random_tokens(rng, 11, VOCAB), "ppo") for _ in range(8)]
    with wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, threads=threads) as sess:
        sess.policy.forward_backward(data, "ppo").result()
        sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        monkeypatch.setattr(sess.engine._state.model, "full_activation_limit", 160)
        monkeypatch.setattr(shared_prefix, "PREFIX_PASS_OVERHEAD_TOKENS", 0.0)
        with _mlp_calls(sess) as calls:
            sess.policy.forward_backward(data, "ppo").result()
        assert calls == [6, 5]
        sess.policy.optim_step(wb.AdamParams(learning_rate=0.0)).result()
        plain, shared = _both_ways(
            sess, wb.Role.POLICY, lambda: sess.policy.forward_backward(data, "ppo").result(), monkeypatch
        )
    _assert_same(plain, shared)


def _trained_a_step_then_both_ways(
    sess: wb.Session, warm: list[wb.Datum], data: list[wb.Datum], monkeypatch: pytest.MonkeyPatch
) -> None:
    """One step on `warm` (so no LoRA B is zero), then `data`'s importance-sampling `forward_backward`
    without and with sharing: the same results."""
    sess.policy.forward_backward(warm, "importance_sampling").result()
    sess.policy.optim_step(wb.AdamParams(learning_rate=1e-3)).result()
    plain, shared = _both_ways(
        sess,
        wb.Role.POLICY,
        lambda: sess.policy.forward_backward(data, "importance_sampling").result(),
        monkeypatch,
    )
    _assert_same(plain, shared)


@pytest.mark.integration
def test_smollm2_gives_the_plain_pass_results(monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2-135M (GQA, 30 layers): two groups of 4 with prefixes up to 512 tokens, importance sampling
    with advantages on the prefix positions too."""
    rng = random.Random(60)
    sequences = []
    for length in (512, rng.randint(1, 511)):
        prefix = random_tokens(rng, length, VOCAB)
        sequences += [prefix + random_tokens(rng, rng.randint(2, 24), VOCAB) for _ in range(4)]
    data = [_datum(rng, tokens, "importance_sampling") for tokens in sequences]
    with wb.Session("smollm2-135m", wb.LoraConfig(rank=8), seed=0, wandb=False) as sess:
        _trained_a_step_then_both_ways(sess, data[:2], data, monkeypatch)


def _two_groups_on_a_twin(
    family: str, dense: bool, folder: Any, monkeypatch: pytest.MonkeyPatch, sliding_window: int | None = None
) -> None:
    """Prefixes of 150 and 110 tokens, 4 datums each, in one pass on the `family` twin: the same results
    as the plain pass."""
    from tests.engine.model.moe_twins import save_twin

    model = save_twin(family, folder, dense=dense, sliding_window=sliding_window)
    rng = random.Random(40)
    sequences = [
        prefix + random_tokens(rng, rng.randint(5, 20), VOCAB)
        for prefix in (random_tokens(rng, 150, VOCAB), random_tokens(rng, 110, VOCAB))
        for _ in range(4)
    ]
    data = [_datum(rng, tokens, "importance_sampling") for tokens in sequences]
    warm = [_datum(rng, random_tokens(rng, 30, VOCAB), "importance_sampling") for _ in range(2)]
    with wb.Session(model, wb.LoraConfig(rank=4), seed=0, wandb=False, sampler="hf") as sess:
        _trained_a_step_then_both_ways(sess, warm, data, monkeypatch)


@pytest.mark.parametrize(
    ("family", "dense"),
    [("mixtral", True), ("gpt_oss", False)],
    ids=["mistral-sliding-window", "gpt-oss-sliding-layers-and-sinks"],
)
def test_sliding_window_attention_gives_the_plain_pass_results_with_prefixes_of_different_lengths(
    family: str, dense: bool, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A window of 24 tokens: each suffix must see the same last 24 keys it sees in its own datum
    (right-padded prefixes shifted the window by the padding, 0.22 nats off on Mistral)."""
    _two_groups_on_a_twin(family, dense, tmp_path / family, monkeypatch, sliding_window=24)


@pytest.mark.parametrize(
    ("family", "dense"),
    [("deepseek_v3", True), ("deepseek_v3", False), ("qwen3_moe", False)],
    ids=["deepseek-v3-latent-attention", "deepseek-v3-experts", "qwen3-moe-experts"],
)
def test_latent_attention_and_experts_give_the_plain_pass_results(
    family: str, dense: bool, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Multi-head latent attention (DeepSeek-V3: keys of 24 dimensions, values of 16, the prefix's cached
    after their projection from the latent) and routed experts with their adapters (each token's
    experts picked from its own hidden state, so a prefix token picks the same in every datum)."""
    _two_groups_on_a_twin(family, dense, tmp_path / family, monkeypatch)


def test_bfloat16_gives_the_plain_pass_results_within_its_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    """In bf16 (8 bits of mantissa) the shared and the plain pass round differently, so they agree
    within bf16's rounding, not 1e-5: measured 5e-4 of the largest value on the outputs and 1.5% of
    the largest gradient; a gradient that missed a suffix's share in the prefix would be off by far more."""
    rng = random.Random(70)
    with wb.Session(
        "tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, dtype="bfloat16", device="cpu"
    ) as sess:
        warm = [_datum(rng, random_tokens(rng, 30, VOCAB), "importance_sampling") for _ in range(2)]
        sess.policy.forward_backward(warm, "importance_sampling").result()
        sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        data = [
            _datum(rng, tokens, "importance_sampling")
            for tokens in _random_groups(rng, max_group=8, max_prefix=200)
        ]
        plain, shared = _both_ways(
            sess,
            wb.Role.POLICY,
            lambda: sess.policy.forward_backward(data, "importance_sampling").result(),
            monkeypatch,
        )
    (out_plain, grads_plain, row_plain), (out_shared, grads_shared, row_shared) = plain, shared
    assert row_shared["computed_tokens:sum"] < row_plain["computed_tokens:sum"]
    for a, b in zip(out_shared.loss_fn_outputs, out_plain.loss_fn_outputs, strict=True):
        for key in b:
            expected = b[key].to_torch().float()
            scale = float(expected.abs().max())
            torch.testing.assert_close(a[key].to_torch().float(), expected, rtol=0, atol=1e-2 * scale)
    assert grads_shared.keys() == grads_plain.keys() and grads_plain
    for name, grad in grads_plain.items():
        scale = float(grad.float().abs().max())
        assert scale > 0, name
        torch.testing.assert_close(
            grads_shared[name].float(), grad.float(), rtol=0, atol=5e-2 * scale, msg=name
        )
