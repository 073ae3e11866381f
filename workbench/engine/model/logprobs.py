"""Per-token log-probabilities of the targets, computed from a decoder's final hidden states without the
full-vocabulary logits; and, for sampling requests, the other scores of a prompt's positions (top-K
tokens, requested ids, draws) computed the same chunked way (`score_positions`).

Shared by training (the loss inputs) and sampling (prompt logprobs), so that both compute the same
number the same way: the output layer's logits in fp32, `log_softmax`, then a gather of the target ids.

Notation: N positions (a micro-batch's B × T flattened), H hidden size, V vocabulary, C positions in a
chunk, K targets per position (soft targets: `target_tokens` of shape (N, K); one target: no K axis).

A (B, T, V) logit tensor is the largest thing a training step makes (T = 2048 and V = 151,936: 1.2 GB
per sequence in fp32, again for its `log_softmax` and again for the gradient), and almost all of it is
thrown away: a loss reads one logprob per position. So the output layer runs over C positions at a time,
with C chosen to keep each chunk's (C, V) logits near `CHUNK_LOGITS_ELEMENTS`, and only the targets'
logprobs leave the chunk. For backward, the first `kept_positions` positions keep their chunk's
log-softmax (as a plain autograd graph does); the others keep nothing and recompute their logits in
backward, chunk by chunk, from the hidden states (Chen et al. 2016, https://arxiv.org/abs/1604.06174,
applied to the output layer): one more pass of the output layer's matmul for those positions, and none
of their (C, V) tensors held. The output layer is whatever module the model has there (a peft-adapted
one included), so an adapter on it trains as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Elements of one chunk's (C, V) logits: 16M fp32 values, 64 MiB; C = 341 positions for V = 49,152.
CHUNK_LOGITS_ELEMENTS = 1 << 24

OutputLayer = Callable[[Tensor], Tensor]
"""The model's output layer: (…, H) hidden states to (…, V) logits."""


def chunk_positions(vocab_size: int) -> int:
    """C, the positions per chunk for a vocabulary of `vocab_size`."""
    return max(1, CHUNK_LOGITS_ELEMENTS // vocab_size)


def _chunk_logprobs(
    output_layer: OutputLayer, hidden_C_H: Tensor, targets_C: Tensor, with_entropy: bool
) -> tuple[Tensor, Tensor | None]:
    """The targets' logprobs (with autograd when it is on) and, when asked, the detached entropy.

    `targets_C` is (C,) or (C, K); the logprobs have its shape."""
    logprobs_C_V = torch.log_softmax(output_layer(hidden_C_H).float(), dim=-1)
    targets_C_K = targets_C if targets_C.dim() == 2 else targets_C.unsqueeze(-1)
    logprobs_C = logprobs_C_V.gather(-1, targets_C_K).reshape(targets_C.shape)
    if not with_entropy:
        return logprobs_C, None
    with torch.no_grad():
        entropy_C = -torch.einsum("cv,cv->c", logprobs_C_V.exp(), logprobs_C_V)
    return logprobs_C, entropy_C


class _RecomputedTargetLogprobs(torch.autograd.Function):
    """log p(target) for N positions from their hidden states, keeping only the hidden states (and the
    targets) for backward, where each chunk's logits are computed again.

    The output layer's trainable parameters are inputs of the function, so autograd hands their
    gradients back through it like any other input's.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        hidden_N_H: Tensor,
        targets_N: Tensor,
        output_layer: OutputLayer,
        chunk: int,
        with_entropy: bool,
        *params: nn.Parameter,
    ) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(hidden_N_H, targets_N, *params)
        ctx.output_layer = output_layer  # type: ignore[attr-defined]
        ctx.chunk = chunk  # type: ignore[attr-defined]
        pieces = [
            _chunk_logprobs(output_layer, hidden_C_H, targets_C, with_entropy)
            for hidden_C_H, targets_C in zip(hidden_N_H.split(chunk), targets_N.split(chunk), strict=True)
        ]
        logprobs_N = torch.cat([logprobs_C for logprobs_C, _ in pieces])
        entropy_N = (
            torch.cat([entropy_C for _, entropy_C in pieces]) if with_entropy else logprobs_N.new_empty(0)
        )
        ctx.mark_non_differentiable(entropy_N)
        return logprobs_N, entropy_N

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, grad_logprobs_N: Tensor, _grad_entropy_N: Tensor
    ) -> tuple[Tensor | None, ...]:
        hidden_N_H, targets_N, *params = ctx.saved_tensors  # type: ignore[attr-defined]
        output_layer: OutputLayer = ctx.output_layer  # type: ignore[attr-defined]
        chunk: int = ctx.chunk  # type: ignore[attr-defined]
        wants_hidden = ctx.needs_input_grad[0]
        param_needs = ctx.needs_input_grad[5:]
        trained = [param for param, needs in zip(params, param_needs, strict=True) if needs]
        grad_hidden_N_H = torch.empty_like(hidden_N_H) if wants_hidden else None
        grad_trained = [torch.zeros_like(param) for param in trained]
        for start in range(0, hidden_N_H.shape[0], chunk):
            stop = start + chunk
            hidden_C_H = hidden_N_H[start:stop].detach().requires_grad_(wants_hidden)
            with torch.enable_grad():
                logprobs_C, _ = _chunk_logprobs(output_layer, hidden_C_H, targets_N[start:stop], False)
            inputs = ([hidden_C_H] if wants_hidden else []) + trained
            grads = list(
                torch.autograd.grad(logprobs_C, inputs, grad_logprobs_N[start:stop], allow_unused=True)
            )
            if wants_hidden:
                assert grad_hidden_N_H is not None
                grad_hidden_N_H[start:stop] = grads.pop(0)
            for total, grad in zip(grad_trained, grads, strict=True):
                if grad is not None:
                    total += grad
        trained_grads = iter(grad_trained)
        param_grads = [next(trained_grads) if needs else None for needs in param_needs]
        return grad_hidden_N_H, None, None, None, None, *param_grads


def target_logprobs(
    hidden_B_T_H: Tensor,
    output_layer: nn.Module,
    targets_B_T: Tensor,
    *,
    vocab_size: int,
    kept_positions: int,
    with_entropy: bool,
    trained_B_T: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """log p(target_t | prefix) for every position from the final hidden states, and, when asked, the
    entropy of each next-token distribution, H_t = −Σ_v p_v log p_v.

    `targets_B_T` is (B, T) or, for K targets per position, (B, T, K); the logprobs have its shape.

    The logprobs carry gradients (to the hidden states and the output layer's trainable parameters)
    when grad mode is on; the entropy is a diagnostic and does not. It costs a pass over each chunk's
    distribution (a few percent of a training step), so only the losses that report it ask.
    `vocab_size` (the width of the output layer's result) sets the chunk length; the first
    `kept_positions` of the B × T positions keep their log-softmax for backward, the others recompute it
    there. Without grad mode nothing is kept either way.

    `trained_B_T` (bool), where given, marks the positions whose logprob the loss can give a gradient;
    the others (a prompt's, whose advantage or weight is 0) are computed without autograd. Their
    gradient would be exactly 0, so the result and its gradient are the same, and the output layer's
    backward (a matmul as large as its forward, and the log-softmax's) runs only where it counts: a
    group RL datum's prompt positions are half of its positions or more.
    """
    batch, length, hidden_size = hidden_B_T_H.shape
    hidden_N_H = hidden_B_T_H.reshape(batch * length, hidden_size)
    targets_N = targets_B_T.reshape(batch * length, *targets_B_T.shape[2:])
    chunk = chunk_positions(vocab_size)
    if trained_B_T is None or not torch.is_grad_enabled() or bool(trained_B_T.all()):
        logprobs_N, entropy_N = _positions_logprobs(
            hidden_N_H, output_layer, targets_N, chunk, kept_positions, with_entropy
        )
    elif not bool(trained_B_T.any()):  # a group RL prefix: no position of it trains
        with torch.no_grad():
            logprobs_N, entropy_N = _positions_logprobs(
                hidden_N_H, output_layer, targets_N, chunk, 0, with_entropy
            )
    else:
        trained_N = trained_B_T.reshape(-1)
        order_N = torch.argsort((~trained_N).to(torch.uint8), stable=True)  # trained positions first
        count = int(trained_N.sum())
        ordered_N_H, ordered_targets_N = hidden_N_H[order_N], targets_N[order_N]
        trained_logprobs, trained_entropy = _positions_logprobs(
            ordered_N_H[:count], output_layer, ordered_targets_N[:count], chunk, kept_positions, with_entropy
        )
        with torch.no_grad():
            free_logprobs, free_entropy = _positions_logprobs(
                ordered_N_H[count:], output_layer, ordered_targets_N[count:], chunk, 0, with_entropy
            )
        inverse_N = torch.empty_like(order_N)
        inverse_N[order_N] = torch.arange(order_N.shape[0], device=order_N.device)
        logprobs_N = torch.cat([trained_logprobs, free_logprobs])[inverse_N]
        entropy_N = None
        if with_entropy:
            assert trained_entropy is not None and free_entropy is not None
            entropy_N = torch.cat([trained_entropy, free_entropy])[inverse_N]
    logprobs_B_T = logprobs_N.reshape(targets_B_T.shape)
    if entropy_N is None:
        return logprobs_B_T, None
    return logprobs_B_T, entropy_N.reshape(batch, length)


def _positions_logprobs(
    hidden_N_H: Tensor,
    output_layer: nn.Module,
    targets_N: Tensor,
    chunk: int,
    kept_positions: int,
    with_entropy: bool,
) -> tuple[Tensor, Tensor | None]:
    """`target_logprobs` of N flat positions, C at a time, the first `kept_positions` keeping their
    log-softmax for backward: (N, …) logprobs and, when asked, (N,) entropy."""
    kept = hidden_N_H.shape[0] if not torch.is_grad_enabled() else min(kept_positions, hidden_N_H.shape[0])
    pieces = [
        _chunk_logprobs(output_layer, hidden_C_H, targets_C, with_entropy)
        for hidden_C_H, targets_C in zip(
            hidden_N_H[:kept].split(chunk), targets_N[:kept].split(chunk), strict=True
        )
    ]
    if kept < hidden_N_H.shape[0]:
        trainable = [param for param in output_layer.parameters() if param.requires_grad]
        pieces.append(
            _RecomputedTargetLogprobs.apply(
                hidden_N_H[kept:], targets_N[kept:], output_layer, chunk, with_entropy, *trainable
            )
        )
    logprobs_N = torch.cat([logprobs for logprobs, _ in pieces])
    if not with_entropy:
        return logprobs_N, None
    return logprobs_N, torch.cat([entropy for _, entropy in pieces])


def language_model_logprobs(
    model: nn.Module,
    input_ids_B_T: Tensor,
    attention_mask_B_T: Tensor,
    targets_B_T: Tensor,
    *,
    vocab_size: int,
    logits_from_hidden_states: bool,
    kept_positions: int,
    with_entropy: bool,
    trained_B_T: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """`target_logprobs` of an HF causal language model (or a peft model around one) on a batch.

    The decoder (`get_decoder()`) runs alone and its final hidden states go through the output layer
    (`get_output_embeddings()`) chunk by chunk. A model whose logits are more than that output layer's
    result (`logits_from_hidden_states` False: a soft cap or a scale after the output layer, see
    `workbench.engine.model.base_model.logits_from_hidden_states`) runs whole, and its logits are read in chunks.
    """
    features_B_T_F, output_layer = final_features(
        model, input_ids_B_T, attention_mask_B_T, logits_from_hidden_states=logits_from_hidden_states
    )
    return target_logprobs(
        features_B_T_F,
        output_layer,
        targets_B_T,
        vocab_size=vocab_size,
        kept_positions=kept_positions,
        with_entropy=with_entropy,
        trained_B_T=trained_B_T,
    )


@dataclass(frozen=True)
class PositionScores:
    """What `score_positions` computes for T positions (each None unless asked), on the CPU."""

    logprobs_T: Tensor  # log p(target_t)
    topk_ids_T_K: Tensor | None = None  # the K most likely tokens, most likely first
    topk_logprobs_T_K: Tensor | None = None
    chosen_logprobs_T_J: Tensor | None = None  # log p of each requested id; 0.0 where the id is −1
    draws_T_A: Tensor | None = None  # A draws at the temperature, with replacement
    draw_logprobs_T_A: Tensor | None = None  # their logprobs under the tempered distribution


@torch.no_grad()
def score_positions(
    features_T_F: Tensor,
    output_layer: OutputLayer,
    targets_T: Tensor,
    *,
    vocab_size: int,
    topk: int = 0,
    chosen_ids_T_J: Tensor | None = None,
    draws: int = 0,
    temperature: float = 1.0,
    generator: torch.Generator | None = None,
    scores_at_temperature: bool = False,
) -> PositionScores:
    """Scores of T next-token distributions from their features, a chunk of C positions at a time, so
    that no (T, V) tensor exists at once whatever K is: the targets' logprobs, the `topk` most likely
    tokens, the logprobs of `chosen_ids_T_J` (−1: none), and `draws` tokens drawn from
    softmax(logits / temperature) (argmax at temperature 0) with their logprobs under it (the model's
    own at temperature 0). The targets' and top-k logprobs are those of log_softmax(logits / temperature)
    for `scores_at_temperature` (a sampled sequence's, by the temperature rule), else the model's own;
    the chosen ids' are always the model's own."""
    chunk = chunk_positions(vocab_size)
    pieces: dict[str, list[Tensor]] = {}

    def keep(name: str, value: Tensor) -> None:
        pieces.setdefault(name, []).append(value.cpu())

    for start in range(0, features_T_F.shape[0], chunk):
        stop = start + chunk
        logits_C_V = output_layer(features_T_F[start:stop]).float()
        logprobs_C_V = torch.log_softmax(logits_C_V, dim=-1)
        scored_C_V = logprobs_C_V
        if scores_at_temperature and temperature not in (0.0, 1.0):
            scored_C_V = torch.log_softmax(logits_C_V / temperature, dim=-1)
        targets_C = targets_T[start:stop].to(logprobs_C_V.device)
        keep("logprobs", scored_C_V.gather(-1, targets_C[:, None]).squeeze(-1))
        if topk:
            values_C_K, ids_C_K = torch.topk(scored_C_V, topk, dim=-1)
            keep("topk_ids", ids_C_K)
            keep("topk_logprobs", values_C_K)
        if chosen_ids_T_J is not None:
            ids_C_J = chosen_ids_T_J[start:stop].to(logprobs_C_V.device)
            chosen_C_J = logprobs_C_V.gather(-1, ids_C_J.clamp_min(0))
            keep("chosen", torch.where(ids_C_J >= 0, chosen_C_J, torch.zeros_like(chosen_C_J)))
        if draws:
            if temperature == 0:
                ids_C_A = logprobs_C_V.argmax(dim=-1, keepdim=True).expand(-1, draws)
                tempered_C_V = logprobs_C_V
            else:
                tempered_C_V = torch.log_softmax(logits_C_V / temperature, dim=-1)
                ids_C_A = torch.multinomial(tempered_C_V.exp(), draws, replacement=True, generator=generator)
            keep("draws", ids_C_A)
            keep("draw_logprobs", tempered_C_V.gather(-1, ids_C_A))

    def joined(name: str) -> Tensor | None:
        return torch.cat(pieces[name]) if name in pieces else None

    return PositionScores(
        logprobs_T=torch.cat(pieces["logprobs"]) if pieces else torch.zeros(0),
        topk_ids_T_K=joined("topk_ids"),
        topk_logprobs_T_K=joined("topk_logprobs"),
        chosen_logprobs_T_J=joined("chosen"),
        draws_T_A=joined("draws"),
        draw_logprobs_T_A=joined("draw_logprobs"),
    )


def feature_forward(
    model: nn.Module, *, logits_from_hidden_states: bool
) -> tuple[Callable[..., Tensor], nn.Module]:
    """How to get the features the output layer turns into logits, `forward(**model_kwargs)`, and that
    layer: the decoder's final hidden states and the output embeddings, or, for a model whose logits
    are more than that layer's result, the logits themselves and the identity."""
    if logits_from_hidden_states:
        decoder = model.get_decoder()
        return lambda **kwargs: decoder(**kwargs).last_hidden_state, model.get_output_embeddings()
    return lambda **kwargs: model(**kwargs).logits, nn.Identity()


def final_features(
    model: nn.Module, input_ids_B_T: Tensor, attention_mask_B_T: Tensor, *, logits_from_hidden_states: bool
) -> tuple[Tensor, nn.Module]:
    """The features the output layer turns into logits for a batch, and that layer (`feature_forward`)."""
    forward, output_layer = feature_forward(model, logits_from_hidden_states=logits_from_hidden_states)
    return forward(input_ids=input_ids_B_T, attention_mask=attention_mask_B_T, use_cache=False), output_layer
