"""workbench/loops/chat.py: the one place a chat is rendered; a chat datum's prompt part is the prompt
every other caller (the compatible APIs, the panel's chat box and Sample tab) renders."""

from __future__ import annotations

from transformers import AutoTokenizer

from workbench.engine.model.base_model import resolve_model_path
from workbench.loops.chat import chat_datum, chat_prompt, render_chat

CONVERSATION = [
    {"role": "system", "content": "Answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
]


def test_a_chat_datums_prompt_part_is_the_rendered_prompt() -> None:
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny"))
    datum = chat_datum(tokenizer, CONVERSATION)
    prompt = render_chat(tokenizer, CONVERSATION[:-1])
    assert chat_prompt(tokenizer, CONVERSATION[:-1]).to_ints() == prompt
    tokens = [*datum.model_input.to_ints(), datum.loss_fn_inputs["target_tokens"].tolist()[-1]]
    weights = [0.0, *datum.loss_fn_inputs["weights"].tolist()]
    untrained = weights.index(1.0)
    assert tokens[:untrained] == prompt  # the prompt part: weight 0, exactly the rendered prompt
    answer = tokenizer.decode(tokens[untrained:], skip_special_tokens=True)
    assert answer.strip() == "Blue." and all(w == 1.0 for w in weights[untrained:])
