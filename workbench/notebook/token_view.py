"""Token-level views: a sequence of tokens as coloured HTML, one span per token.

A loss number hides where it comes from; colouring each token by the value training sees for it
shows which tokens the model finds unlikely (`logprob`), which ones an RL update pushes up or down
(`advantage`), and which ones count at all (`weight`). Every token's exact id and value are in its
hover text, and a legend under the tokens explains the colour scale.

`render_tokens` is the primitive; `render_datum` reads a `Datum`'s targets and loss inputs, and
`render_sample` a sampled sequence with its logprobs. Each returns a `TokenView`, which a notebook
shows as HTML (it has `_repr_html_`) and the panel puts in an `ipywidgets.HTML`.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from matplotlib import colormaps
from matplotlib.colors import Colormap, to_hex
from transformers import PreTrainedTokenizerBase

from workbench.types import Datum, ModelInput, SampledSequence, TensorData

ValueKind = Literal["logprob", "advantage", "weight", "mismatch"]
"""`mismatch` is the sampler's logprob minus the trainer's for the same token (see `workbench.loops.
health`): ~0 when both compute the same model."""

# The loss input each kind is read from in `render_datum`.
DATUM_INPUTS: dict[str, str] = {"logprob": "logprobs", "advantage": "advantages", "weight": "weights"}

STOP_REASONS: dict[str, str] = {"stop": "ended with a stop token", "length": "cut off at max_tokens"}
"""How views describe a sampled sequence's stop reason."""

# Background opacity: strong enough to read the scale, light enough to read black text on it.
ALPHA = 0.55


@dataclass(frozen=True)
class TokenView:
    """Rendered tokens: `html` is a self-contained fragment (inline styles only, no scripts)."""

    html: str
    tokens: list[int]
    values: list[float | None]
    kind: ValueKind

    def _repr_html_(self) -> str:
        return self.html


@dataclass(frozen=True)
class _Scale:
    """How values of one kind map to colours, and the sentence that explains it."""

    cmap: Colormap
    low: float
    high: float
    legend: str

    def colour(self, value: float) -> str:
        span = self.high - self.low
        position = 0.5 if span <= 0 else min(max((value - self.low) / span, 0.0), 1.0)
        return to_hex(self.cmap(position), keep_alpha=False)


def _scale(kind: ValueKind, values: Sequence[float]) -> _Scale:
    """Logprobs are shown as probabilities exp(lp) on a fixed 0..1 scale, so views compare across
    samples; advantages on a diverging scale centred on 0; weights from 0 to their largest value."""
    if kind == "logprob":
        return _Scale(colormaps["RdYlGn"], 0.0, 1.0, "probability exp(logprob): red 0 · yellow 0.5 · green 1")
    if kind == "advantage":
        bound = max((abs(v) for v in values), default=0.0) or 1.0
        return _Scale(
            colormaps["RdBu"], -bound, bound, f"advantage: red {-bound:.3g} · white 0 · blue {bound:.3g}"
        )
    if kind == "weight":
        top = max(values, default=0.0) or 1.0
        return _Scale(colormaps["Greens"], 0.0, top, f"loss weight: white 0 · green {top:.3g}")
    if kind == "mismatch":
        bound = max((abs(v) for v in values), default=0.0) or 1e-3
        return _Scale(
            colormaps["PuOr"],
            -bound,
            bound,
            f"sampler − trainer logprob: orange {-bound:.2g} · white 0 · purple {bound:.2g}",
        )
    raise ValueError(f"kind must be 'logprob', 'advantage', 'weight' or 'mismatch', got {kind!r}")


def _shown(kind: ValueKind, value: float) -> float:
    return math.exp(value) if kind == "logprob" else value


def render_tokens(
    tokenizer: PreTrainedTokenizerBase,
    tokens: Sequence[int],
    values: Sequence[float | None],
    *,
    kind: ValueKind = "logprob",
) -> TokenView:
    """Render tokens as HTML spans coloured by one value each.

    Args:
        tokenizer: Decodes each token on its own (a token that is part of a multi-byte character
            shows as the replacement character; its id is in the hover text).
        tokens: Token ids.
        values: One per token; None leaves a token uncoloured (e.g. the first prompt token, which
            nothing predicts). NaN is shown uncoloured as well, marked "nan" in the hover text.
        kind: What the values are: `"logprob"`, `"advantage"`, `"weight"` or `"mismatch"`.
    """
    if len(tokens) != len(values):
        raise ValueError(
            f"render_tokens needs one value per token: {len(tokens)} tokens, {len(values)} values"
        )
    finite = [_shown(kind, v) for v in values if v is not None and math.isfinite(v)]
    scale = _scale(kind, finite)
    spans = []
    for token, value in zip(tokens, values, strict=True):
        text = html.escape(tokenizer.decode([int(token)]))
        if value is None:
            title, style = f"token {int(token)}", "color:#555"
        elif not math.isfinite(value):
            title, style = f"token {int(token)}, {kind} nan", "color:#555;text-decoration:underline dotted"
        else:
            shown = _shown(kind, value)
            detail = f"{kind} {value:.4g}" + (f" (p={shown:.3g})" if kind == "logprob" else "")
            title, style = (
                f"token {int(token)}, {detail}",
                f"background:{scale.colour(shown)}{round(ALPHA * 255):02x}",
            )
        spans.append(f'<span title="{html.escape(title)}" style="{style}">{text}</span>')
    body = "".join(spans)
    fragment = (
        '<div class="wb-tokens"><style>.wb-tokens span{border-radius:2px}</style>'
        f'<div style="font-family:monospace;white-space:pre-wrap;line-height:1.6">{body}</div>'
        f'<div style="font-size:smaller;color:#666;margin-top:2px">{html.escape(scale.legend)}</div>'
        "</div>"
    )
    return TokenView(html=fragment, tokens=[int(t) for t in tokens], values=list(values), kind=kind)


def _floats(data: TensorData | Sequence[float]) -> list[float]:
    return [float(v) for v in (data.tolist() if isinstance(data, TensorData) else data)]


def render_datum(
    tokenizer: PreTrainedTokenizerBase,
    datum: Datum,
    kind: ValueKind = "weight",
    values: TensorData | Sequence[float] | None = None,
) -> TokenView:
    """Render a training datum: its first input token (uncoloured), then each target token coloured by
    the datum's loss input for `kind` (`weights`, `advantages`, or the sampler's `logprobs`).

    Args:
        values: Colour by these instead (one per target), e.g. the `logprobs` a `forward` returned for
            this datum: `render_datum(tok, d, "logprob", out.loss_fn_outputs[0]["logprobs"])`.
    """
    inputs = datum.model_input.to_ints()
    targets = [int(t) for t in datum.loss_fn_inputs["target_tokens"].tolist()]
    if values is None:
        if kind not in DATUM_INPUTS:
            raise ValueError(f"kind must be one of {list(DATUM_INPUTS)}, got {kind!r}")
        key = DATUM_INPUTS[kind]
        if key not in datum.loss_fn_inputs:
            raise ValueError(f"this datum has no {key!r} loss input to colour by; pass values=...")
        values = datum.loss_fn_inputs[key]
    per_target = _floats(values)
    if len(per_target) != len(targets):
        raise ValueError(
            f"render_datum needs one value per target token: {len(targets)} targets, {len(per_target)} values"
        )
    return render_tokens(tokenizer, inputs[:1] + targets, [None, *per_target], kind=kind)


def render_sample(
    tokenizer: PreTrainedTokenizerBase,
    sequence: SampledSequence,
    prompt: ModelInput | None = None,
    prompt_logprobs: Sequence[float | None] | None = None,
) -> TokenView:
    """Render a sampled sequence coloured by the sampler's logprob of each token, after its prompt
    (uncoloured, or coloured by `prompt_logprobs` when the sample asked for them)."""
    prompt_tokens = prompt.to_ints() if prompt is not None else []
    if prompt_logprobs is None:
        prompt_values: list[float | None] = [None] * len(prompt_tokens)
    else:
        prompt_values = list(prompt_logprobs)
    return render_tokens(
        tokenizer,
        prompt_tokens + list(sequence.tokens),
        prompt_values + list(sequence.logprobs),
        kind="logprob",
    )
