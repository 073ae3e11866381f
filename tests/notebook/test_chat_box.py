"""workbench/notebook/panel/chat_box.py: the Sample tab's chat keeps a conversation with the live policy,
the base model or a checkpoint, and answers what the OpenAI-compatible endpoint answers for it."""

from __future__ import annotations

import pytest

import workbench as wb

WAIT_S = 60.0


@pytest.fixture
def panel(tiny: wb.Session):
    p = tiny.panel()
    yield p
    p.close()


def test_the_chat_box_keeps_the_conversation_and_answers_as_the_endpoint_does(
    panel: wb.Panel, tiny: wb.Session
) -> None:
    box = panel.sample.chat_box
    assert box.widget in panel.sample.widget.children
    box.temperature.value, box.max_tokens.value = 0.0, 8
    box.message.value = "Hello there"
    box.send_button.click()
    first = box.replied.result(WAIT_S)
    assert box.message.value == ""
    second = box.send("And then?").result(WAIT_S)
    assert [m["role"] for m in box.messages] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in box.messages[1::2]] == [first, second]
    assert "And then?" in box.transcript.value
    api = tiny.openai_client(max_retries=0)
    expected = api.chat.completions.create(
        model=tiny.model_id, messages=box.messages[:3], max_tokens=8, temperature=0
    )
    assert expected.choices[0].message.content == second
    box.new_button.click()
    assert box.messages == [] and box.transcript.value == ""


def test_the_chat_box_talks_to_a_checkpoint_or_the_base(panel: wb.Panel, tiny: wb.Session) -> None:
    box = panel.sample.chat_box
    path = tiny.policy.save_weights_for_sampler("chat-ckpt").result().path
    box.refresh_button.click()
    values = [value for _, value in box.weights.options]
    assert values[:2] == ["live", "base"] and len(values) == 3
    box.temperature.value, box.max_tokens.value = 0.0, 6
    box.weights.value = values[2]
    from_checkpoint = box.send("Hi").result(WAIT_S)
    api = tiny.openai_client(max_retries=0)
    reply = api.chat.completions.create(
        model=path, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, temperature=0
    )
    assert reply.choices[0].message.content == from_checkpoint
    box.new_chat()
    box.weights.value = "base"
    assert isinstance(box.send("Hi").result(WAIT_S), str)
    with pytest.raises(ValueError, match="write a message"):
        box.send("  ")
