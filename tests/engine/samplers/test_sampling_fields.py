"""Every field of the SDK 0.38 `SampleRequest` (top-K prompt and sample logprobs, target ids' prompt
logprobs, dense and sparse, prompt draws, `prompt_logprobs_last_n`) against brute-force values from the
tiny model's full log-softmax, in-process and over HTTP with the real SDK; and the temperature rule of
sampled logprobs, with the pairwise check of tinker-cookbook's `validate_temperature_logprobs`. Each runs
on both sampling engines (the `sampler` fixture: HF, and vLLM where it is installed), on one session per
engine; the checks of bad input before any sampling, of the wire format, and of the HF sampler's
rescoring helper run once."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator

import numpy as np
import pytest
import tinker
import torch
from tinker import types

import workbench as wb
from tests.datums import ce_datum
from workbench.engine.model import logprobs as logprobs_module
from workbench.engine.samplers.requests import prepare_request
from workbench.engine.samplers.sample_request import SampleRequest

PROMPT = [5, 17, 42, 99, 100, 7, 8, 250, 31, 64]
# Logprobs against the brute-force log-softmax, in float32. Measured on one CPU with the trained adapter:
# the HF sampler within 7e-6, vLLM's kernels within 3e-5; other CPUs (SIMD width, threads) round otherwise.
ATOL = 1e-4
# What the module's session is trained on (one step), so that its adapter is not LoRA's zero start.
TRAINED = torch.randint(300, 900, (40,), generator=torch.Generator().manual_seed(0)).tolist()


@pytest.fixture(scope="module")
def sess(sampler: str, sampled_model: str) -> Iterator[wb.Session]:
    """One session per sampling engine for the whole module (no test here changes its weights): the
    tiny model sampling with HF, or its 32-dimension-head twin sampling with vLLM; trained one step
    first, so that the adapter every number depends on is not the zero one LoRA starts from."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("TINKER_API_KEY", "tml-local")
        session = wb.Session(sampled_model, wb.LoraConfig(rank=4), seed=0, wandb=False, sampler=sampler)
        session.policy.forward_backward([ce_datum(TRAINED)], "cross_entropy").result()
        session.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result()
        moved = full_logprobs(session, PROMPT) - full_logprobs(session, PROMPT, base=True)
        assert float(moved.abs().max()) > 100 * ATOL  # numbers that ignored the adapter would fail here
        yield session
        session.close()


def full_logprobs(
    sess: wb.Session, tokens: list[int], temperature: float = 1.0, *, base: bool = False
) -> torch.Tensor:
    """(len(tokens), V): row i is log_softmax(logits / τ) of the distribution that predicts token i + 1,
    under the policy's weights (or, with `base`, the base model's: peft's adapters off)."""
    model = sess.engine.torch_model
    with torch.no_grad(), model.disable_adapter() if base else contextlib.nullcontext():
        logits = model(input_ids=torch.tensor([tokens])).logits[0].float()
    return torch.log_softmax(logits / temperature, dim=-1)


def check_topk(entries, expected_T_V: torch.Tensor, k: int) -> None:
    """Top-k rows as (id, logprob) lists against the brute-force distributions, row for row."""
    assert len(entries) == expected_T_V.shape[0]
    for row, expected_V in zip(entries, expected_T_V, strict=True):
        ids = [token for token, _ in row]
        values = torch.tensor([value for _, value in row])
        assert len(row) == k
        torch.testing.assert_close(values, expected_V[ids], atol=ATOL, rtol=0)
        # they are the k largest: nothing outside beats the smallest inside
        outside = torch.ones_like(expected_V, dtype=torch.bool)
        outside[ids] = False
        if outside.any():
            assert float(expected_V[outside].max()) <= float(values.min()) + ATOL
        assert values.tolist() == sorted(values.tolist(), reverse=True)


# ---------------------------------------------------------------------------------------------- in-process


@pytest.mark.parametrize("k", [1, 7, "V"])
def test_topk_prompt_logprobs_are_the_k_most_likely_tokens_at_every_prompt_position(
    sess: wb.Session, k, monkeypatch: pytest.MonkeyPatch
) -> None:
    vocab = sess.base_info.vocab_size
    k = vocab if k == "V" else k
    monkeypatch.setattr(logprobs_module, "CHUNK_LOGITS_ELEMENTS", 3 * vocab)  # 3 positions a chunk
    response = (
        sess.sampling_client()
        .sample(PROMPT, 1, wb.SamplingParams(max_tokens=1), True, topk_prompt_logprobs=k)
        .result()
    )
    topk = response.topk_prompt_logprobs
    assert topk is not None and len(topk) == len(PROMPT) and topk[0] is None
    check_topk(topk[1:], full_logprobs(sess, PROMPT[:-1]), k)


def test_prompt_logprobs_last_n_applies_to_the_topk_rows(sess: wb.Session) -> None:
    response = (
        sess.sampling_client()
        .sample(
            PROMPT, 1, wb.SamplingParams(max_tokens=1), True, topk_prompt_logprobs=3, prompt_logprobs_last_n=4
        )
        .result()
    )
    assert response.topk_prompt_logprobs[:-4] == [None] * (len(PROMPT) - 4)
    assert response.prompt_logprobs[:-4] == [None] * (len(PROMPT) - 4)
    check_topk(response.topk_prompt_logprobs[-4:], full_logprobs(sess, PROMPT[:-1])[-4:], 3)


@pytest.mark.parametrize("k", [4, "V"])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 0.0])
def test_topk_sample_logprobs_score_every_generated_position(sess: wb.Session, temperature: float, k) -> None:
    k = sess.base_info.vocab_size if k == "V" else k
    response = (
        sess.sampling_client()
        .sample(
            PROMPT,
            2,
            wb.SamplingParams(max_tokens=5, temperature=temperature, seed=3),
            topk_sample_logprobs=k,
        )
        .result()
    )
    assert len(response.sequences) == 2
    for sequence in response.sequences:
        full = PROMPT + sequence.tokens
        # the temperature rule: the distribution the token was drawn from (the model's own when greedy)
        expected_T_V = full_logprobs(sess, full[:-1], temperature or 1.0)[len(PROMPT) - 1 :]
        check_topk(sequence.topk_logprobs, expected_T_V, k)
        chosen = expected_T_V.gather(-1, torch.tensor(sequence.tokens)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(sequence.logprobs), chosen, atol=ATOL, rtol=0)


def target_ids() -> torch.Tensor:
    ids = torch.full((len(PROMPT) - 1, 3), -1)
    ids[0, 0], ids[2, 1], ids[2, 2], ids[8, 0], ids[5, 2] = 3, 10, 900, 11, PROMPT[6]
    return ids


def check_targets(sess: wb.Session, answer: np.ndarray, ids: torch.Tensor, *, base: bool = False) -> None:
    expected = full_logprobs(sess, PROMPT[:-1], base=base).gather(-1, ids.clamp_min(0))
    expected = torch.where(ids >= 0, expected, torch.zeros_like(expected))
    assert answer.shape == tuple(ids.shape) and answer.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(answer), expected, atol=ATOL, rtol=0)
    assert (answer[ids.numpy() < 0] == 0.0).all()


@pytest.mark.parametrize("layout", ["dense", "sdk_sparse"])
def test_target_prompt_logprobs_score_the_requested_ids(sess: wb.Session, layout: str) -> None:
    ids = target_ids()
    request = ids if layout == "dense" else types.TensorData.from_torch_sparse(ids, pad_value=-1)
    if layout == "sdk_sparse":
        assert request.sparse_crow_indices is not None
    response = (
        sess.sampling_client()
        .sample(PROMPT, 1, wb.SamplingParams(max_tokens=1), target_prompt_logprobs=request)
        .result()
    )
    check_targets(sess, response.target_prompt_logprobs.to_numpy(), ids)
    # the prompt's own tokens score exactly what prompt_logprobs does (ids[5, 2] = PROMPT[6] among
    # them): one response's prompt numbers come from one pass, whichever engine samples
    own_ids = torch.cat([ids, torch.tensor(PROMPT[1:])[:, None]], dim=1)
    with_prompt = (
        sess.sampling_client()
        .sample(PROMPT, 1, wb.SamplingParams(max_tokens=1), True, target_prompt_logprobs=own_ids)
        .result()
    )
    answer = with_prompt.target_prompt_logprobs.to_numpy()
    check_targets(sess, answer, own_ids)
    prompt_logprobs = np.array(with_prompt.prompt_logprobs[1:], dtype=np.float32)
    assert np.array_equal(answer[:, -1], prompt_logprobs) and answer[5, 2] == prompt_logprobs[5]


def test_prompt_alt_tokens_are_draws_at_the_temperature_with_their_logprobs(sess: wb.Session) -> None:
    client = sess.sampling_client()
    k = 64
    for temperature in (1.0, 0.3):
        params = wb.SamplingParams(max_tokens=1, temperature=temperature, seed=11)
        alt = client.sample(PROMPT, 1, params, prompt_alt_tokens_k=k).result().prompt_alt_tokens
        tokens, logprobs = alt.tokens.to_torch(), alt.logprobs.to_torch()
        assert list(tokens.shape) == list(logprobs.shape) == [len(PROMPT) - 1, k]
        tempered = full_logprobs(sess, PROMPT[:-1], temperature)
        torch.testing.assert_close(logprobs, tempered.gather(-1, tokens), atol=ATOL, rtol=0)
        again = client.sample(PROMPT, 1, params, prompt_alt_tokens_k=k).result().prompt_alt_tokens
        assert torch.equal(again.tokens.to_torch(), tokens)  # a seeded request draws the same tokens
    # at a low temperature the draws concentrate where the tempered distribution does
    sharp = client.sample(
        PROMPT, 1, wb.SamplingParams(max_tokens=1, temperature=0.05, seed=1), prompt_alt_tokens_k=400
    ).result()
    tokens = sharp.prompt_alt_tokens.tokens.to_torch()
    probs = full_logprobs(sess, PROMPT[:-1], 0.05).exp()
    for row in range(tokens.shape[0]):
        top = int(probs[row].argmax())
        share = float((tokens[row] == top).float().mean())
        assert share == pytest.approx(float(probs[row, top]), abs=0.1)
    greedy = client.sample(
        PROMPT, 1, wb.SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=3
    ).result()
    argmax = full_logprobs(sess, PROMPT[:-1]).argmax(-1)
    assert torch.equal(greedy.prompt_alt_tokens.tokens.to_torch(), argmax[:, None].expand(-1, 3))


BAD = [
    ({"topk_prompt_logprobs": -1}, r"topk_prompt_logprobs must be an integer in \[0, \d+\]"),
    ({"topk_sample_logprobs": 10**6}, r"topk_sample_logprobs must be an integer in \[0, \d+\]"),
    ({"prompt_alt_tokens_k": 2.5}, r"prompt_alt_tokens_k must be an integer"),
    (
        {"target_prompt_logprobs": torch.zeros(3, 2, dtype=torch.long)},
        r"shape \[len\(prompt\) - 1, K\] = \[9, K\]",
    ),
    ({"target_prompt_logprobs": torch.full((9, 2), -1)}, r"names no token id"),
    (
        {"target_prompt_logprobs": torch.full((9, 2), -1).index_fill(0, torch.tensor([4]), 10**6)},
        r"target_prompt_logprobs\[4\]\[0\] = 1000000 is neither -1",
    ),
    ({"target_prompt_logprobs": torch.zeros(9, 2)}, r"integer token ids"),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[m for _, m in BAD])
def test_bad_sampling_fields_raise_and_change_nothing(tiny_no_wandb: wb.Session, fields, message) -> None:
    """Refused in the caller's thread, before any engine samples: once, on the HF sampler's session."""
    client = tiny_no_wandb.sampling_client()
    before = tiny_no_wandb.state_digest()
    with pytest.raises(ValueError, match=message):
        client.sample(PROMPT, 1, wb.SamplingParams(max_tokens=1), **fields)
    assert tiny_no_wandb.state_digest() == before


# ---------------------------------------------------------------------------------------------- temperature


def test_sampled_logprobs_are_the_tempered_distribution_by_the_pairwise_check(sess: wb.Session) -> None:
    """tinker-cookbook's `validate_temperature_logprobs`: for tokens i, j sampled at the same position,
    log p_τ(i) − log p_τ(j) = (log p_1(i) − log p_1(j)) / τ, with log p_1 from `compute_logprobs`."""
    client = sess.sampling_client()
    for temperature in (0.5, 1.5):
        seen: dict[int, float] = {}
        for seed in range(24):
            params = wb.SamplingParams(max_tokens=1, temperature=temperature, seed=seed)
            sequence = client.sample(PROMPT, 1, params).result().sequences[0]
            seen.setdefault(sequence.tokens[0], sequence.logprobs[0])
        assert len(seen) >= 4
        base = {token: client.compute_logprobs([*PROMPT, token]).result()[-1] for token in seen}
        errors = [
            abs((seen[i] - seen[j]) - (base[i] - base[j]) / temperature)
            for i, j in itertools.combinations(sorted(seen), 2)
        ]
        assert max(errors) < 1e-4
        # and not the untempered logprobs (what forward and compute_logprobs report)
        assert max(abs(seen[t] - base[t]) for t in seen) > 1e-2


def test_the_probe_refuses_temperatures_whose_logprobs_forward_does_not_compute(sess: wb.Session) -> None:
    from workbench.notebook.probes import check_logprob_agreement

    report = check_logprob_agreement(sess, [PROMPT], sampling_params=wb.SamplingParams(max_tokens=4, seed=0))
    assert report.max_abs_diff < 1e-4
    with pytest.raises(ValueError, match="temperature 1"):
        check_logprob_agreement(
            sess, [PROMPT], sampling_params=wb.SamplingParams(max_tokens=4, temperature=0.7)
        )


# ---------------------------------------------------------------------------------------------- over HTTP


def test_every_field_over_http_with_the_sdk(sess: wb.Session) -> None:
    """The SDK's sampling client of the base model (adapters off), every field in one request."""
    server = sess.serve()
    service = tinker.ServiceClient(base_url=server.url)
    try:
        sampling_client = service.create_sampling_client(base_model=sess.engine.config.base_model).result()
        prompt = types.ModelInput.from_ints(PROMPT)
        ids = target_ids()
        for layout, request in (
            ("dense", types.TensorData.from_torch(ids)),
            ("sparse", types.TensorData.from_torch_sparse(ids, pad_value=-1)),
        ):
            response = sampling_client.sample(
                prompt,
                2,
                types.SamplingParams(max_tokens=4, temperature=0.5, seed=5),
                include_prompt_logprobs=True,
                topk_prompt_logprobs=6,
                topk_sample_logprobs=3,
                target_prompt_logprobs=request,
                prompt_alt_tokens_k=5,
                prompt_logprobs_last_n=7,
            ).result()
            full = full_logprobs(sess, PROMPT[:-1], base=True)
            topk = response.topk_prompt_logprobs
            assert topk[:3] == [None, None, None]
            check_topk(topk[3:], full[2:], 6)
            assert response.topk_prompt_logprobs_np.token_ids.shape == (len(PROMPT), 6)
            answer = response.target_prompt_logprobs
            assert (answer.sparse_crow_indices is not None) == (layout == "sparse")
            check_targets(sess, answer.to_numpy(), ids, base=True)
            alt = response.prompt_alt_tokens
            tokens = torch.from_numpy(alt.tokens.to_numpy())
            assert list(tokens.shape) == [len(PROMPT) - 1, 5]
            torch.testing.assert_close(
                torch.from_numpy(alt.logprobs.to_numpy()),
                full_logprobs(sess, PROMPT[:-1], 0.5, base=True).gather(-1, tokens),
                atol=ATOL,
                rtol=0,
            )
            for sequence in response.sequences:
                expected = full_logprobs(sess, (PROMPT + sequence.tokens)[:-1], 0.5, base=True)[
                    len(PROMPT) - 1 :
                ]
                check_topk(sequence.topk_logprobs, expected, 3)
            # the same request in-process gives the same numbers (same seed, same engine)
            local = sess.engine.sample(
                sess.engine.pin_sampler(None),
                SampleRequest(
                    PROMPT,
                    2,
                    wb.SamplingParams(max_tokens=4, temperature=0.5, seed=5),
                    True,
                    prompt_logprobs_last_n=7,
                    topk_sample_logprobs=3,
                ),
            ).result()
            for remote_sequence, local_sequence in zip(response.sequences, local.sequences, strict=True):
                assert remote_sequence.tokens == local_sequence.tokens
                assert remote_sequence.logprobs == pytest.approx(local_sequence.logprobs, abs=1e-6)
        with pytest.raises(Exception, match="topk_prompt_logprobs must be an integer"):
            sampling_client.sample(
                prompt, 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=10**6
            ).result()
    finally:
        service.close("success").result()
        server.stop()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"data": [1, 2], "dtype": "float32", "shape": [1, 2]}, "int64 tensor"),
        ({"data": [1, 2, 3], "dtype": "int64", "shape": [2, 2]}, "3 values do not fill shape"),
        ({"data": [1], "dtype": "int64", "shape": [2]}, "must be 2-D"),
        (
            {
                "data": [4],
                "dtype": "int64",
                "shape": [2, 2],
                "sparse_crow_indices": [0, 1, 1],
                "sparse_col_indices": [2],
            },
            "sparse indices do not match",
        ),
        (
            {
                "data": [4],
                "dtype": "int64",
                "shape": [2, 2],
                "sparse_crow_indices": [0, 2, 1],
                "sparse_col_indices": [0],
            },
            "sparse indices do not match",
        ),
        ({"data": [4], "dtype": "int64", "shape": [2, 2], "sparse_crow_indices": [0, 1, 1]}, "come together"),
        ({"data": ["a"], "dtype": "int64", "shape": [1, 1]}, "lists of integers"),
    ],
)
def test_malformed_target_tensors_on_the_wire_are_refused(body, message) -> None:
    from workbench.server import wire
    from workbench.server.errors import RequestError

    with pytest.raises(RequestError, match=message):
        wire.target_ids(body)


def test_sparse_target_tensors_on_the_wire_keep_their_layout() -> None:
    from workbench.server import wire

    ids = target_ids()
    sdk_sparse = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    dense, layout = wire.target_ids(
        {
            "data": list(sdk_sparse.data),
            "dtype": "int64",
            "shape": sdk_sparse.shape,
            "sparse_crow_indices": sdk_sparse.sparse_crow_indices,
            "sparse_col_indices": sdk_sparse.sparse_col_indices,
        }
    )
    assert np.array_equal(dense, ids.numpy()) and layout is not None


def test_sequences_rescored_by_the_training_model_follow_the_temperature_rule(
    tiny_no_wandb: wb.Session,
) -> None:
    """What the vLLM path does at a temperature other than 1 (vLLM reports raw logprobs): score the
    sampled tokens again with the training model; here checked against the HF sampler's own numbers."""
    sess = tiny_no_wandb

    state = sess.engine._state
    params = wb.SamplingParams(max_tokens=6, temperature=0.6, seed=2)
    sampled = sess.sampling_client().sample(PROMPT, 1, params, topk_sample_logprobs=5).result()
    request = prepare_request(
        SampleRequest(PROMPT, 1, params, topk_sample_logprobs=5),
        tokenizer=state.tokenizer,
        base_info=sess.base_info,
        max_samples_per_request=8,
    )
    sequence = sampled.sequences[0]
    raw = wb.SampledSequence(sequence.tokens, [0.0] * len(sequence.tokens), sequence.stop_reason)
    rescored = state.hf_sampler.rescore_sequence(request, raw)
    assert rescored.logprobs == pytest.approx(sequence.logprobs, abs=2e-5)
    for ours, theirs in zip(rescored.topk_logprobs, sequence.topk_logprobs, strict=True):
        assert [t for t, _ in ours] == [t for t, _ in theirs]
        assert [v for _, v in ours] == pytest.approx([v for _, v in theirs], abs=2e-5)
