"""Token views: one escaped, coloured span per token, with the value in its hover text and a legend."""

from __future__ import annotations

import html
import re

import pytest

import workbench as wb
from tests.datums import rl_datum, sft_datum

SPAN = re.compile(r'<span title="([^"]*)" style="([^"]*)">(.*?)</span>', re.S)


def _spans(view: wb.TokenView) -> list[tuple[str, str, str]]:
    return SPAN.findall(view.html)


def _background(style: str) -> str | None:
    match = re.search(r"background:(#[0-9a-f]{8})", style)
    return match.group(1) if match else None


def test_render_tokens_escapes_text_and_explains_the_scale(tiny: wb.Session) -> None:
    tokens = tiny.tokenizer("<b>fish & chips</b>").input_ids
    view = wb.render_tokens(tiny.tokenizer, tokens, [-0.1] * len(tokens), kind="logprob")
    spans = _spans(view)
    assert len(spans) == len(tokens)
    assert "<b>" not in view.html and "</b>" not in view.html
    assert "&lt;b&gt;fish &amp; chips&lt;/b&gt;" in "".join(text for _, _, text in spans)
    assert "".join(html.unescape(text) for _, _, text in spans) == tiny.tokenizer.decode(tokens)
    assert "probability exp(logprob)" in view.html
    assert view._repr_html_() == view.html
    assert f"token {tokens[0]}, logprob -0.1 (p=0.905)" in spans[0][0]


def test_logprob_colours_run_from_unlikely_to_likely(tiny: wb.Session) -> None:
    tokens = tiny.tokenizer("one two three").input_ids[:3]
    view = wb.render_tokens(tiny.tokenizer, tokens, [-8.0, -0.7, -0.001], kind="logprob")
    colours = [_background(style) for _, style, _ in _spans(view)]
    assert len(set(colours)) == 3
    low, high = colours[0], colours[2]
    assert low is not None and high is not None
    assert int(low[1:3], 16) > int(low[3:5], 16)  # red-ish
    assert int(high[3:5], 16) > int(high[1:3], 16)  # green-ish


def test_render_datum_by_weight_and_advantage(tiny: wb.Session) -> None:
    datum = sft_datum(tiny.tokenizer, "Q: hi", " A: hello")
    view = wb.render_datum(tiny.tokenizer, datum)
    spans = _spans(view)
    targets = datum.loss_fn_inputs["target_tokens"].tolist()
    weights = datum.loss_fn_inputs["weights"].tolist()
    assert len(spans) == len(targets) + 1
    assert _background(spans[0][1]) is None and spans[0][0] == f"token {datum.model_input.to_ints()[0]}"
    for (title, style, _), weight in zip(spans[1:], weights, strict=True):
        assert f"weight {weight:.4g}" in title
        assert (_background(style) == "#f7fcf58c") == (weight == 0)  # weight 0 is the scale's white end
    assert "loss weight" in view.html

    tokens = tiny.tokenizer("a b c d e f").input_ids
    rl = rl_datum(tokens, 3, [-0.5] * (len(tokens) - 1), advantage=-2.0)
    adv = wb.render_datum(tiny.tokenizer, rl, "advantage")
    assert "advantage: red -2 · white 0 · blue 2" in adv.html
    assert adv.values[-1] == -2.0
    by_sampler = wb.render_datum(tiny.tokenizer, rl, "logprob")
    assert by_sampler.values[1:] == rl.loss_fn_inputs["logprobs"].tolist()


def test_render_datum_with_a_forward_output(tiny: wb.Session) -> None:
    datum = sft_datum(tiny.tokenizer, "Q: hi", " A: hello")
    out = tiny.policy.forward([datum], "cross_entropy").result()
    view = wb.render_datum(tiny.tokenizer, datum, "logprob", out.loss_fn_outputs[0]["logprobs"])
    assert view.values[1:] == pytest.approx(out.loss_fn_outputs[0]["logprobs"].tolist())
    assert view.kind == "logprob"
    with pytest.raises(ValueError, match="no 'advantages' loss input"):
        wb.render_datum(tiny.tokenizer, datum, "advantage")
    with pytest.raises(ValueError, match="one value per target"):
        wb.render_datum(tiny.tokenizer, datum, "logprob", [0.0])
    with pytest.raises(ValueError, match="kind must be one of"):
        wb.render_datum(tiny.tokenizer, datum, "entropy")  # type: ignore[arg-type]


def test_render_sample_colours_the_completion_after_its_prompt(tiny: wb.Session) -> None:
    prompt = wb.ModelInput.from_ints(tiny.tokenizer("Say:").input_ids)
    completion = tiny.tokenizer(" hello world").input_ids
    sequence = wb.SampledSequence(tokens=completion, logprobs=[-1.0] * len(completion), stop_reason="length")
    view = wb.render_sample(tiny.tokenizer, sequence, prompt)
    spans = _spans(view)
    assert len(spans) == prompt.length + len(completion)
    assert all(_background(style) is None for _, style, _ in spans[: prompt.length])
    assert all(_background(style) is not None for _, style, _ in spans[prompt.length :])
    with_prompt_logprobs = wb.render_sample(
        tiny.tokenizer, sequence, prompt, [None] + [-2.0] * (prompt.length - 1)
    )
    assert _background(_spans(with_prompt_logprobs)[1][1]) is not None
    assert len(_spans(wb.render_sample(tiny.tokenizer, sequence))) == len(completion)


def test_missing_and_non_finite_values(tiny: wb.Session) -> None:
    tokens = tiny.tokenizer("x y").input_ids[:2]
    view = wb.render_tokens(tiny.tokenizer, tokens, [None, float("nan")], kind="advantage")
    assert [_background(style) for _, style, _ in _spans(view)] == [None, None]
    assert "advantage nan" in _spans(view)[1][0]
    with pytest.raises(ValueError, match="one value per token"):
        wb.render_tokens(tiny.tokenizer, tokens, [0.0])
    with pytest.raises(ValueError, match="kind must be"):
        wb.render_tokens(tiny.tokenizer, tokens, [0.0, 0.0], kind="loss")  # type: ignore[arg-type]
