"""workbench/server/openai_api.py (with generation.py, sampling_fields.py, served_weights.py, loops/chat.py): OpenAI's API
on the served session, driven by the unmodified `openai` client and lm-evaluation-harness.

Every test that takes `sampler` runs on HF generate and, marked `vllm`, on vLLM (`make test-vllm`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
import tinker
from tinker import types

import workbench as wb
from tests.datums import sft_datum
from tests.server.conftest import HeldDecoding
from workbench.engine.model.base_model import resolve_model_path
from workbench.loops.datasets import colours_quiz_file
from workbench.server import TinkerServer

ADAM = {"learning_rate": 3e-3}
QUESTION = [{"role": "user", "content": "What is the secret word?"}]


def oai(srv: TinkerServer, key: str = "tml-local") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{srv.url}/oai/api/v1", api_key=key, max_retries=0, timeout=600
    )  # vLLM starts on first use


def rendered(sess: wb.Session, messages: list[dict[str, str]]) -> list[int]:
    text = sess.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return sess.tokenizer.encode(text, add_special_tokens=False)


def test_greedy_chat_is_the_tinker_samplers_greedy_sample(
    sampler: str, sess: wb.Session, srv: TinkerServer, client: tinker.ServiceClient
) -> None:
    reply = oai(srv).chat.completions.create(
        model=sess.config.base_model, messages=QUESTION, max_tokens=12, temperature=0
    )
    prompt = rendered(sess, QUESTION)
    tinker_sampler = client.create_sampling_client(base_model=sess.config.base_model).result()
    sampled = tinker_sampler.sample(
        types.ModelInput.from_ints(prompt),
        1,
        types.SamplingParams(max_tokens=12, temperature=0.0, stop=[sess.tokenizer.eos_token_id]),
    ).result()
    choice = reply.choices[0]
    assert choice.model_extra["token_ids"] == sampled.sequences[0].tokens
    assert reply.model_extra["prompt_token_ids"] == prompt
    assert reply.usage.prompt_tokens == len(prompt)
    assert reply.usage.completion_tokens == len(sampled.sequences[0].tokens)
    ids = sampled.sequences[0].tokens
    shown = ids[:-1] if ids and ids[-1] == sess.tokenizer.eos_token_id else ids
    assert choice.message.content == sess.tokenizer.decode(shown, skip_special_tokens=True)
    assert choice.finish_reason == ("stop" if len(shown) < len(ids) else "length")


def test_echoed_logprobs_are_compute_logprobs(sampler: str, sess: wb.Session, srv: TinkerServer) -> None:
    prompts = [[5, 17, 42, 99, 7, 3], [11, 12, 13]]
    answer = oai(srv).completions.create(
        model=sess.config.base_model, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    base = sess.sampling_client(base=True)
    for prompt, choice in zip(prompts, answer.choices, strict=True):
        expected = base.compute_logprobs(wb.ModelInput.from_ints(prompt)).result()
        got = choice.logprobs.token_logprobs
        assert got[0] is None and expected[0] is None
        assert len(got) == len(prompt) + 1  # the prompt, then the one sampled token
        assert got[1 : len(prompt)] == pytest.approx(expected[1:], abs=1e-4)
        assert choice.model_extra["prompt_token_ids"] == prompt
        # lm-eval's greedy check reads the top alternative at every position
        for logprob, top in zip(got[1:], choice.logprobs.top_logprobs[1:], strict=True):
            assert max(top.values()) >= logprob - 1e-5
    only_prompt = oai(srv).completions.create(
        model=sess.config.base_model, prompt=prompts[0], max_tokens=0, echo=True, logprobs=0
    )
    assert only_prompt.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        base.compute_logprobs(wb.ModelInput.from_ints(prompts[0])).result()[1:], abs=1e-4
    )
    assert only_prompt.usage.completion_tokens == 0


def test_streamed_text_is_the_unstreamed_text(sampler: str, sess: wb.Session, srv: TinkerServer) -> None:
    api = oai(srv)
    base = sess.config.base_model
    whole = api.chat.completions.create(model=base, messages=QUESTION, max_tokens=20, temperature=0)
    chunks = list(
        api.chat.completions.create(
            model=base,
            messages=QUESTION,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert len(chunks) > 3
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[0].finish_reason
    whole_text = api.completions.create(model=base, prompt="The sky is", max_tokens=15, temperature=0)
    pieces = api.completions.create(
        model=base, prompt="The sky is", max_tokens=15, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in pieces) == whole_text.choices[0].text


def test_seeds_repeat_and_n_samples(sampler: str, sess: wb.Session, srv: TinkerServer) -> None:
    api = oai(srv)
    base = sess.config.base_model

    def draw(seed: int) -> list[list[int]]:
        reply = api.chat.completions.create(model=base, messages=QUESTION, max_tokens=10, seed=seed, n=3)
        return [choice.model_extra["token_ids"] for choice in reply.choices]

    first = draw(7)
    assert len(first) == 3
    assert draw(7) == first
    assert draw(8) != first


def test_stop_strings_end_the_text(sampler: str, sess: wb.Session, srv: TinkerServer) -> None:
    api = oai(srv)
    base = sess.config.base_model
    free = (
        api.completions.create(model=base, prompt="a b c", max_tokens=30, temperature=0, stop=[])
        .choices[0]
        .text
    )
    stop = free[5:7]
    assert stop.strip(), free
    cut = api.completions.create(
        model=base, prompt="a b c", max_tokens=30, temperature=0, stop=[stop]
    ).choices[0]
    assert cut.text == free[: free.index(stop)]
    assert cut.finish_reason == "stop"
    assert cut.model_extra["stop_reason"] == stop


def test_streamed_choices_are_the_unstreamed_choices_with_stop_strings_and_n(
    sess: wb.Session, srv: TinkerServer
) -> None:
    """Greedy chat (n=2) and text completions (two prompts x n=2, echoed), each with a stop string the
    free text contains: every streamed choice's text joins to the unstreamed choice's text, ends with
    its finish reason, and its last content chunk carries its token ids."""
    api = oai(srv)
    base = sess.config.base_model
    chat = api.chat.completions.create(model=base, messages=QUESTION, max_tokens=30, temperature=0)
    free = api.completions.create(model=base, prompt="a b c", max_tokens=30, temperature=0, stop=[])
    chat_stop, stop = chat.choices[0].message.content[5:7], free.choices[0].text[5:7]
    assert chat_stop.strip() and stop.strip(), (chat.choices[0].message.content, free.choices[0].text)
    requests = [
        (
            api.chat.completions.create,
            {"messages": QUESTION, "max_tokens": 30, "n": 2, "stop": [chat_stop]},
            lambda choice: choice.message.content,
            lambda choice: choice.delta.content,
            2,
        ),
        (
            api.completions.create,
            {"prompt": ["a b c", "The sky is"], "max_tokens": 30, "n": 2, "stop": [stop], "echo": True},
            lambda choice: choice.text,
            lambda choice: choice.text,
            4,
        ),
    ]
    for create, request, text_of, piece_of, choices in requests:
        whole = create(model=base, temperature=0, **request)
        chunks = list(create(model=base, temperature=0, stream=True, **request))
        texts: dict[int, str] = {}
        finishes: dict[int, str] = {}
        token_ids: dict[int, list[int]] = {}
        for chunk in chunks:
            (choice,) = chunk.choices
            texts[choice.index] = texts.get(choice.index, "") + (piece_of(choice) or "")
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
            if (choice.model_extra or {}).get("token_ids") is not None:
                token_ids[choice.index] = choice.model_extra["token_ids"]
        assert len(whole.choices) == choices
        for choice in whole.choices:
            assert texts[choice.index] == text_of(choice)
            assert finishes[choice.index] == choice.finish_reason
            assert token_ids[choice.index] == choice.model_extra["token_ids"]
        assert "stop" in finishes.values()


def test_tokens_reach_the_client_while_the_sample_is_drawn(
    sess: wb.Session, srv: TinkerServer, hold_decoding: Callable[[int], HeldDecoding]
) -> None:
    """A streamed chat's first content chunk arrives before its sequence ends. Deterministic on any
    machine: the sampler's decoding loop is held after its 63rd of 64 tokens until the client has read
    the first content chunk, so that chunk can only have come from a sample still being drawn (were
    the stream sent at the end, the hold would run out and `waited` be False). The reply runs to
    `max_tokens` (finish_reason "length"), and the streamed text is still the unstreamed text."""
    api = oai(srv)
    base = sess.config.base_model
    request = {"model": base, "messages": QUESTION, "max_tokens": 64, "temperature": 0}
    whole = api.chat.completions.create(**request)
    assert whole.choices[0].finish_reason == "length"
    hold = hold_decoding(63)
    text, finish = "", None
    for chunk in api.chat.completions.create(**request, stream=True):
        piece = chunk.choices[0].delta.content if chunk.choices else None
        if piece and not hold.let_go.is_set():
            assert hold.waited is None  # the sampler is held, at token 63: the sequence has not ended
            hold.let_go.set()
        text += piece or ""
        finish = (chunk.choices[0].finish_reason if chunk.choices else None) or finish
    assert hold.waited is True
    assert text == whole.choices[0].message.content
    assert finish == "length"


def test_a_client_that_leaves_a_stream_leaves_the_server_serving(
    sess: wb.Session, srv: TinkerServer, hold_decoding: Callable[[int], HeldDecoding]
) -> None:
    """A client that closes its stream after the first content chunk, while the sampler is held
    mid-sequence: the sampler then draws the rest into a stream nobody reads, without waiting for it,
    and the next request is answered as usual."""
    api = oai(srv)
    base = sess.config.base_model
    hold = hold_decoding(8)
    stream = api.chat.completions.create(
        model=base, messages=QUESTION, max_tokens=64, temperature=0, stream=True
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    hold.let_go.set()
    reply = (
        oai(srv)
        .with_options(timeout=60)
        .chat.completions.create(model=base, messages=QUESTION, max_tokens=5, temperature=0)
    )
    assert hold.waited is True
    assert reply.usage.completion_tokens == 5
    sampled = [row for row in sess.history if row["op"] == "sample"]
    assert [row["num_tokens:sum"] for row in sampled[-2:]] == [64, 5]  # the abandoned sample finished


def test_a_trained_checkpoint_answers_by_its_path_and_the_base_does_not(
    sampler: str, sess: wb.Session, srv: TinkerServer
) -> None:
    """A model of the test's own on the served engine, made as a session makes its policy, taught one
    answer: its checkpoint keeps the answer as the live model trains on."""
    model_id = sess.engine.create_model(wb.LoraConfig(rank=4), seed=0).result()
    policy = wb.TrainingClient(sess.engine, model_id)
    answer = " pineapple"
    prompt_text = sess.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    datum = sft_datum(sess.tokenizer, prompt_text, answer + sess.tokenizer.eos_token)
    for _ in range(80):
        policy.forward_backward([datum], "cross_entropy")
        policy.optim_step(ADAM)
    path = policy.save_weights_for_sampler("pineapple").result().path
    api = oai(srv)
    listed = [model.id for model in api.models.list().data]
    assert path in listed and sess.config.base_model in listed and model_id in listed

    def reply(model: str) -> str:
        return (
            api.chat.completions.create(model=model, messages=QUESTION, max_tokens=8, temperature=0)
            .choices[0]
            .message.content
        )

    assert reply(path) == answer
    assert reply(f"{sess.config.base_model};{path}") == answer
    assert reply(model_id) == answer  # the live policy, at its current weights
    assert reply(sess.config.base_model) != answer
    for _ in range(60):  # training on: the checkpoint keeps its weights, the live policy moves on
        policy.forward_backward(
            [sft_datum(sess.tokenizer, prompt_text, " no" + sess.tokenizer.eos_token)], "cross_entropy"
        )
        policy.optim_step(ADAM)
    assert reply(path) == answer
    assert reply(model_id) != answer
    sess.engine.delete_model(model_id).result()


REFUSALS = [
    # (request keywords, the client's exception class, words of the message)
    ({"model": "no-such-model"}, openai.NotFoundError, "not served here"),
    ({"model": "tinker://nope/sampler_weights/x"}, openai.NotFoundError, "no training run"),
    ({"n": 10_000}, openai.BadRequestError, "max_samples_per_request"),
    ({"max_tokens": 10**9}, openai.BadRequestError, "context"),
    ({"max_tokens": -1}, openai.BadRequestError, "max_tokens"),
    ({"temperature": -1}, openai.BadRequestError, "temperature"),
    ({"top_p": 0}, openai.BadRequestError, "top_p"),
    ({"top_logprobs": 99, "logprobs": True}, openai.BadRequestError, "top_logprobs"),
    ({"stop": ["x"] * 100}, openai.BadRequestError, "stop"),
    ({"presence_penalty": 0.5}, openai.BadRequestError, "presence_penalty"),
    ({"logit_bias": {"5": 10}}, openai.BadRequestError, "logit_bias"),
    ({"response_format": {"type": "json_object"}}, openai.BadRequestError, "response_format"),
    ({"tool_choice": "required"}, openai.BadRequestError, "tool_choice"),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
        openai.BadRequestError,
        "does not render tools",
    ),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, openai.BadRequestError, "role"),
    (
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        openai.BadRequestError,
        "text parts",
    ),
    ({"messages": [{"role": "user", "content": "x " * 5000}]}, openai.BadRequestError, "context"),
]


def test_every_refusal_is_the_clients_own_error_at_once_and_changes_nothing(
    sess: wb.Session, srv: TinkerServer
) -> None:
    api = oai(srv)
    digest, rows = sess.state_digest(), len(sess.history)
    for keywords, error_class, words in REFUSALS:
        request = {"model": sess.config.base_model, "messages": QUESTION, "max_tokens": 4, **keywords}
        start = time.perf_counter()
        with pytest.raises(error_class, match=words):
            api.chat.completions.create(**request)
        assert time.perf_counter() - start < 1.0, keywords
    for keywords, error_class, words in [
        ({"prompt": []}, openai.BadRequestError, "prompt"),
        ({"prompt": [[1, 10**7]]}, openai.BadRequestError, "vocabulary"),
        ({"prompt": [[1, 2]] * 200}, openai.BadRequestError, "max_samples_per_request"),
        ({"prompt": "x", "max_tokens": 0}, openai.BadRequestError, "echo"),
        ({"prompt": "x", "logprobs": 50}, openai.BadRequestError, "logprobs"),
        ({"prompt": "x", "suffix": "y"}, openai.BadRequestError, "suffix"),
        ({"prompt": "x", "best_of": 3}, openai.BadRequestError, "best_of"),
    ]:
        with pytest.raises(error_class, match=words):
            api.completions.create(model=sess.config.base_model, **keywords)
    with pytest.raises(openai.NotFoundError, match="no endpoint"):
        api.embeddings.create(model=sess.config.base_model, input="hi")
    malformed = httpx.post(f"{srv.url}/oai/api/v1/chat/completions", content=b"{not json", timeout=30)
    assert malformed.status_code == 400
    assert "not valid JSON" in malformed.json()["error"]["message"]
    assert sess.state_digest() == digest
    assert len(sess.history) == rows  # no operation ran


def test_the_tinker_key_is_the_key(sess: wb.Session) -> None:
    srv = sess.serve(api_key="tml-secret-key")
    with pytest.raises(openai.AuthenticationError, match="API key"):
        oai(srv, key="tml-wrong-key-1").chat.completions.create(model="tiny", messages=QUESTION, max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        oai(srv, key="tml-wrong-key-1").models.list()
    reply = oai(srv, key="tml-secret-key").chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=2
    )
    assert reply.usage.completion_tokens >= 1


def test_openai_client_of_the_session(sess: wb.Session) -> None:
    api = sess.openai_client()
    assert len(sess.servers) == 1
    assert sess.openai_client().base_url == api.base_url  # the running server is reused
    assert str(api.base_url).endswith("/oai/api/v1/")
    assert (
        api.chat.completions.create(
            model=sess.model_id, messages=QUESTION, max_tokens=3
        ).usage.completion_tokens
        >= 1
    )


# ---------------------------------------------------------------------------------------------- lm-eval

QUIZ = colours_quiz_file()
PROMPT = "Question: {{question}}\nAnswer:"
MULTIPLE_CHOICE = {
    "task": "colours_quiz_mc",
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": str(QUIZ)}},
    "test_split": "test",
    "output_type": "multiple_choice",
    "doc_to_text": PROMPT,
    "doc_to_choice": "choices",
    "doc_to_target": "answer",
    "metric_list": [{"metric": "acc"}],
}
GENERATE_UNTIL = {
    "task": "colours_quiz_gen",
    "dataset_path": "json",
    "dataset_kwargs": {"data_files": {"test": str(QUIZ)}},
    "test_split": "test",
    "output_type": "generate_until",
    "doc_to_text": PROMPT,
    "doc_to_target": "target",
    "generation_kwargs": {"until": ["\n"], "max_gen_toks": 8, "do_sample": False, "temperature": 0},
    "metric_list": [{"metric": "exact_match", "ignore_case": True, "ignore_punctuation": True}],
}


def test_lm_eval_local_completions_multiple_choice_matches_the_sessions_own_scores(
    sampler: str, sess: wb.Session, srv: TinkerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-eval's loglikelihood requests (echo + logprobs, max_tokens 1) through the endpoint give the
    accuracy the session's own `compute_logprobs` gives choice by choice."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": sess.config.base_model,
            "base_url": f"{srv.url}/oai/api/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": sess.base_info.path,
            "num_concurrent": 1,
            "max_retries": 1,
        },
        tasks=[MULTIPLE_CHOICE],
        task_manager=TaskManager(include_defaults=False),  # not lm-eval's thousands of bundled tasks
        log_samples=False,
    )
    accuracy = results["results"]["colours_quiz_mc"]["acc,none"]
    base = sess.sampling_client(base=True)
    tokenizer = sess.tokenizer
    right = 0
    rows = [json.loads(line) for line in QUIZ.read_text().splitlines()]
    for row in rows:
        context = tokenizer.encode(f"Question: {row['question']}\nAnswer:")
        scores = []
        for choice in row["choices"]:
            whole = tokenizer.encode(f"Question: {row['question']}\nAnswer: {choice}")
            logprobs = base.compute_logprobs(wb.ModelInput.from_ints(whole)).result()
            scores.append(sum(logprobs[len(context) :]))
        right += scores.index(max(scores)) == row["answer"]
    assert accuracy == pytest.approx(right / len(rows))


def test_lm_eval_local_chat_completions_generate_until(
    sampler: str, sess: wb.Session, srv: TinkerServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """lm-eval's generate-until requests through the chat endpoint: its responses are the greedy chat
    replies the openai client gets for the same conversations."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    results = lm_eval.simple_evaluate(
        model="local-chat-completions",
        model_args={
            "model": sess.config.base_model,
            "base_url": f"{srv.url}/oai/api/v1/chat/completions",
            "num_concurrent": 1,
            "max_retries": 1,
            "max_gen_toks": 8,
        },
        tasks=[GENERATE_UNTIL],
        task_manager=TaskManager(include_defaults=False),
        apply_chat_template=True,
        log_samples=True,
    )
    assert "exact_match,none" in results["results"]["colours_quiz_gen"]
    api = oai(srv)
    for sample in results["samples"]["colours_quiz_gen"][:3]:
        question = sample["doc"]["question"]
        reply = api.chat.completions.create(
            model=sess.config.base_model,
            messages=[{"role": "user", "content": f"Question: {question}\nAnswer:"}],
            max_tokens=8,
            temperature=0,
            stop=["\n"],
        )
        assert sample["resps"][0][0] == reply.choices[0].message.content


def test_a_remote_session_gets_an_openai_client_of_its_service(sess: wb.Session, srv: TinkerServer) -> None:
    remote = wb.Session.connect(
        srv.url, base_model=sess.config.base_model, lora=wb.LoraConfig(rank=4), wandb=False
    )
    try:
        api = remote.openai_client(max_retries=0)
        assert str(api.base_url) == f"{srv.url}/oai/api/v1/"
        ours = api.chat.completions.create(
            model=sess.config.base_model, messages=QUESTION, max_tokens=6, temperature=0
        )
        local = oai(srv).chat.completions.create(
            model=sess.config.base_model, messages=QUESTION, max_tokens=6, temperature=0
        )
        assert ours.choices[0].model_extra["token_ids"] == local.choices[0].model_extra["token_ids"]
    finally:
        remote.close()


def test_a_second_base_model_is_served_on_its_own_engine(
    sess: wb.Session, srv: TinkerServer, tiny_teacher: str
) -> None:
    """A server of two base models: a request naming the second is rendered and sampled on its own
    engine (its logprobs are its own, not the first base's), both APIs, and `/models` lists both."""
    service = sess.service_client()
    teacher = service.create_sampling_client(base_model=tiny_teacher).result()  # loads the second base
    prompt = [5, 17, 42, 99, 7, 3]
    expected = teacher.compute_logprobs(wb.ModelInput.from_ints(prompt)).result()
    first_base = sess.sampling_client(base=True).compute_logprobs(wb.ModelInput.from_ints(prompt)).result()
    assert max(abs(a - b) for a, b in zip(expected[1:], first_base[1:], strict=True)) > 1e-2
    answer = oai(srv).completions.create(
        model=tiny_teacher, prompt=[prompt], max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    assert answer.choices[0].logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(expected[1:], abs=1e-4)
    listed = {entry.id: entry.root for entry in oai(srv).models.list().data}
    assert listed[tiny_teacher] == tiny_teacher and listed[sess.config.base_model] == sess.config.base_model
    reply = anthropic.Anthropic(
        base_url=f"{srv.url}/anthropic/api", api_key="tml-local", max_retries=0
    ).messages.create(model=tiny_teacher, max_tokens=4, messages=QUESTION)
    assert reply.model == tiny_teacher and reply.usage.output_tokens >= 1
    with pytest.raises(openai.NotFoundError, match="is not served here"):
        oai(srv).completions.create(model="no-such-base", prompt=[prompt], max_tokens=1)
    service.close("success")


def test_workbench_serve_speaks_both_apis_to_the_clients_and_the_lm_eval_command(tmp_path: Path) -> None:
    """`workbench serve` in its own process, with a key: the openai and anthropic clients, and
    `lm_eval --model local-completions` as a user types it, on the colours quiz."""
    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "PYTHONPATH": str(root),
        "WORKBENCH_RUNS": str(tmp_path / "runs"),
        "HF_DATASETS_OFFLINE": "1",
    }
    key = "tml-serve-secret"
    command = [
        sys.executable,
        "-m",
        "workbench.cli",
        "serve",
        "--base-model",
        "tiny",
        "--port",
        "0",
        "--no-wandb",
    ]
    server = subprocess.Popen(
        command,
        env={**env, "WORKBENCH_API_KEY": key},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert server.stdout is not None
        lines = []
        for line in server.stdout:
            lines.append(line)
            if "OpenAI's API at" in line:
                break
        url = lines[-1].split(" at ")[1].split("/oai/")[0]
        api = openai.OpenAI(base_url=f"{url}/oai/api/v1", api_key=key, max_retries=0)
        reply = api.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=5, temperature=0)
        assert reply.usage.completion_tokens >= 1
        import anthropic

        message = anthropic.Anthropic(
            base_url=f"{url}/anthropic/api", api_key=key, max_retries=0
        ).messages.create(model="tiny", max_tokens=5, messages=QUESTION, extra_body={"temperature": 0})
        assert message.content[0].text == reply.choices[0].message.content
        tasks = tmp_path / "tasks"
        tasks.mkdir()
        (tasks / "colours_quiz_mc.yaml").write_text(json.dumps(MULTIPLE_CHOICE))  # JSON is YAML
        tokenizer = resolve_model_path("tiny")
        evaluated = subprocess.run(
            [
                str(Path(sys.executable).parent / "lm_eval"),
                "--model",
                "local-completions",
                "--tasks",
                "colours_quiz_mc",
                "--include_path",
                str(tasks),
                "--model_args",
                f"model=tiny,base_url={url}/oai/api/v1/completions,tokenizer_backend=huggingface,"
                f"tokenizer={tokenizer},num_concurrent=1,max_retries=1",
                "--output_path",
                str(tmp_path / "results"),
            ],
            env={**env, "OPENAI_API_KEY": key},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert evaluated.returncode == 0, evaluated.stderr[-3000:]
        assert "colours_quiz_mc" in evaluated.stdout and "acc" in evaluated.stdout
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=60)
