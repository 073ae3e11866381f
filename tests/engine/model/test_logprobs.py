"""Target logprobs from hidden states, chunk by chunk: the same numbers and gradients as the full
log-softmax, without keeping anything of size positions × vocabulary for backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM

import workbench as wb
from tests.datums import unweighted_datum
from workbench.engine.model import logprobs
from workbench.engine.model.base_model import load_tokenizer, logits_from_hidden_states
from workbench.engine.model.logprobs import language_model_logprobs, target_logprobs


def _reference(hidden_B_T_H: torch.Tensor, layer: nn.Module, targets_B_T: torch.Tensor):
    logprobs_B_T_V = torch.log_softmax(layer(hidden_B_T_H).float(), dim=-1)
    entropy_B_T = -(logprobs_B_T_V.exp() * logprobs_B_T_V).sum(-1)
    return logprobs_B_T_V.gather(-1, targets_B_T[..., None])[..., 0], entropy_B_T


@pytest.mark.parametrize("kept", [0, 10, 24])  # every position recomputed, some, none
def test_chunked_logprobs_equal_the_full_log_softmax_with_gradients(
    kept: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    vocab, hidden = 50, 8
    monkeypatch.setattr(logprobs, "CHUNK_LOGITS_ELEMENTS", 7 * vocab)  # 7 positions a chunk: 3 and a rest
    torch.manual_seed(0)
    layer = nn.Linear(hidden, vocab)
    hidden_B_T_H = torch.randn(2, 12, hidden, requires_grad=True)
    targets_B_T = torch.randint(0, vocab, (2, 12))
    upstream_B_T = torch.randn(2, 12)

    ours, entropy = target_logprobs(
        hidden_B_T_H, layer, targets_B_T, vocab_size=vocab, kept_positions=kept, with_entropy=True
    )
    (ours * upstream_B_T).sum().backward()
    grads = [hidden_B_T_H.grad, layer.weight.grad, layer.bias.grad]
    for tensor in (hidden_B_T_H, layer.weight, layer.bias):
        tensor.grad = None
    expected, expected_entropy = _reference(hidden_B_T_H, layer, targets_B_T)
    (expected * upstream_B_T).sum().backward()

    torch.testing.assert_close(ours, expected, rtol=0, atol=1e-6)
    assert entropy is not None and not entropy.requires_grad
    torch.testing.assert_close(entropy, expected_entropy, rtol=0, atol=1e-5)
    for got, want in zip(grads, [hidden_B_T_H.grad, layer.weight.grad, layer.bias.grad], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kept", [0, 24])  # every trained position recomputed, none
def test_untrained_positions_run_the_output_layer_without_autograd_and_change_nothing(
    kept: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    vocab, hidden = 50, 8
    monkeypatch.setattr(logprobs, "CHUNK_LOGITS_ELEMENTS", 7 * vocab)
    torch.manual_seed(0)
    layer = nn.Linear(hidden, vocab)
    hidden_B_T_H = torch.randn(2, 12, hidden, requires_grad=True)
    targets_B_T = torch.randint(0, vocab, (2, 12))
    trained_B_T = torch.zeros(2, 12, dtype=torch.bool)
    trained_B_T[0, 7:] = True  # a prompt of 7 positions, then a completion
    trained_B_T[1, 3:9] = True
    upstream_B_T = torch.randn(2, 12) * trained_B_T  # the loss's gradient: 0 where nothing trains
    rows_with_autograd: list[int] = []
    layer.register_forward_hook(
        lambda _module, args, _out: (
            rows_with_autograd.append(args[0].shape[0]) if torch.is_grad_enabled() else None
        )
    )

    results, computed = [], []
    for trained in (None, trained_B_T):
        rows_with_autograd.clear()
        ours, entropy = target_logprobs(
            hidden_B_T_H,
            layer,
            targets_B_T,
            vocab_size=vocab,
            kept_positions=kept,
            with_entropy=True,
            trained_B_T=trained,
        )
        (ours * upstream_B_T).sum().backward()
        results.append((ours.detach(), entropy, [hidden_B_T_H.grad, layer.weight.grad, layer.bias.grad]))
        computed.append(sum(rows_with_autograd))
        for tensor in (hidden_B_T_H, layer.weight, layer.bias):
            tensor.grad = None
    # the layer ran with autograd (in forward, or in backward's recomputation) on the trained rows alone
    assert computed == [2 * 12, int(trained_B_T.sum())]
    (all_logprobs, all_entropy, all_grads), (logprobs_B_T, entropy_B_T, grads) = results
    torch.testing.assert_close(logprobs_B_T, all_logprobs, rtol=0, atol=1e-6)
    assert entropy_B_T is not None and all_entropy is not None
    torch.testing.assert_close(entropy_B_T, all_entropy, rtol=0, atol=1e-6)
    for got, want in zip(grads, all_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_no_position_by_vocabulary_tensor_is_kept_for_backward(tiny: wb.Session) -> None:
    model = tiny.engine.torch_model
    vocab = tiny.base_info.vocab_size
    tokens_1_T = torch.randint(3, vocab, (1, 65))
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: list[tuple[int, ...]] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.untyped_storage().data_ptr() not in parameters:
            kept.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logprobs_1_T, _ = language_model_logprobs(
            model,
            tokens_1_T[:, :-1],
            torch.ones_like(tokens_1_T[:, :-1]),
            tokens_1_T[:, 1:],
            vocab_size=vocab,
            logits_from_hidden_states=True,
            kept_positions=0,
            with_entropy=False,
        )
    assert logprobs_1_T.requires_grad
    assert kept, "nothing was saved for backward"
    largest = max(torch.Size(shape).numel() for shape in kept)
    assert largest < 64 * vocab, f"a tensor of {largest} elements (64 positions × V = {64 * vocab}) was kept"


def _softcapped_model() -> Gemma2ForCausalLM:
    """A small random Gemma 2: its logits are 30·tanh(output / 30), not the output layer's result."""
    config = Gemma2Config(
        vocab_size=934,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=None,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return Gemma2ForCausalLM(config).eval()


def test_logits_from_hidden_states_holds_for_llama_and_not_for_a_soft_cap(tiny: wb.Session) -> None:
    assert tiny.base_info.logits_from_hidden_states
    assert not logits_from_hidden_states(_softcapped_model())


def test_a_soft_capped_model_trains_on_its_real_logits(tmp_path) -> None:
    model = _softcapped_model()
    with torch.no_grad():  # large logits, so that the soft cap changes them visibly
        model.lm_head.weight.mul_(40.0)
    folder = tmp_path / "gemma2"
    model.save_pretrained(folder)
    load_tokenizer("tiny").save_pretrained(folder)
    tokens = list(range(5, 45))
    with wb.Session(str(folder), wb.LoraConfig(rank=4), seed=0) as sess:
        assert not sess.base_info.logits_from_hidden_states
        datum = unweighted_datum(tokens)
        got = sess.policy.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        with torch.no_grad():
            logits_T_V = model(input_ids=torch.tensor([tokens[:-1]])).logits[0]
            uncapped_T_V = model.lm_head(model.get_decoder()(torch.tensor([tokens[:-1]])).last_hidden_state)[
                0
            ]
        want = torch.log_softmax(logits_T_V, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        uncapped = torch.log_softmax(uncapped_T_V, -1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
        assert (want - uncapped).abs().max() > 0.1  # the cap matters for these tokens
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
        sess.policy.forward_backward([datum], "cross_entropy").result()
        assert sess.policy.optim_step().result().applied
