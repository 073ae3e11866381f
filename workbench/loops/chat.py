"""Chat-formatted prompts and supervised datums, through the tokenizer's own chat template.

`chat_prompt` renders messages into the tokens a model reads before answering (the template's
generation prompt included). `chat_datum` turns a whole conversation into a Tinker SFT datum whose
weights train only on the assistant's final message: the prompt is context, not a target.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from transformers import PreTrainedTokenizerBase

from workbench.types import Datum, ModelInput

Message = Mapping[str, str]


def _render(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], add_generation_prompt: bool
) -> list[int]:
    if tokenizer.chat_template is None:
        raise ValueError("this tokenizer has no chat template; build the prompt tokens yourself")
    text = tokenizer.apply_chat_template(
        list(messages), add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False).input_ids


def chat_prompt(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> ModelInput:
    """The prompt for the model's next (assistant) turn after `messages`."""
    return ModelInput.from_ints(_render(tokenizer, messages, add_generation_prompt=True))


def chat_datum(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> Datum:
    """An SFT datum from a conversation ending with the assistant's answer: weight 1 on the answer's
    tokens (its end-of-turn token included), 0 on everything before it."""
    if not messages or messages[-1]["role"] != "assistant":
        raise ValueError("a chat datum's last message must be the assistant's answer")
    prompt = _render(tokenizer, messages[:-1], add_generation_prompt=True)
    full = _render(tokenizer, messages, add_generation_prompt=False)
    if full[: len(prompt)] != prompt:
        raise ValueError("the chat template renders the conversation's start differently from its prompt")
    eos = tokenizer.eos_token_id
    if eos is not None and eos in full[len(prompt) :]:
        # end at the answer's end-of-turn token: what a template adds after it is not the model's to say
        full = full[: len(full) - full[::-1].index(eos)]
    weights = [0.0] * len(prompt) + [1.0] * (len(full) - len(prompt))
    return Datum(
        model_input=ModelInput.from_ints(full[:-1]),
        loss_fn_inputs={"target_tokens": full[1:], "weights": weights[1:]},
    )
