"""Weights out through the SDK: tinker-cookbook's `weights.download` (its only download path:
`save_weights_external` and `get_external_weights_urls`, age-encrypted for a training checkpoint), then
`weights.build_lora_adapter` and `weights.build_hf_model`, unmodified, in-process and over `workbench
serve`. The merged HF model (transformers) and the PEFT adapter (peft, on the base) score a datum's
tokens as the session does, to 1e-4 in fp32.

In-process the cookbook's `tinker.ServiceClient` and `tinker.RestClient` are the session's service
client and `wb.RestClient` (the URLs are `file://` URLs of this machine); over HTTP nothing is patched
and the URLs are the server's own, signed.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pyrage
import pytest
import tinker
import torch
from peft import PeftModel
from tinker_cookbook import weights
from transformers import AutoModelForCausalLM

import workbench as wb
from tests.promises.conftest import SdkClients
from workbench.engine.model.base_model import resolve_model_path

TOLERANCE = 1e-4
CONVERSATION = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "apple pie"}]


@pytest.fixture
def sess(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, sdk_clients: SdkClients) -> Iterator[wb.Session]:
    monkeypatch.setenv("TINKER_API_KEY", "tml-local")
    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    session = wb.Session("tiny", wb.LoraConfig(rank=4), seed=0, wandb=False, dtype="float32")
    datum = wb.chat_datum(session.tokenizer, CONVERSATION)
    for _ in range(3):  # weights away from the initial adapter (whose B is zero)
        session.policy.forward_backward([datum], "cross_entropy")
        session.policy.optim_step(wb.AdamParams(learning_rate=1e-2))
    yield session
    sdk_clients.close()  # while the session's server still answers
    session.close()


def _logprobs(model: torch.nn.Module, datum: wb.Datum) -> torch.Tensor:
    tokens = torch.tensor([datum.model_input.to_ints()])
    targets = datum.loss_fn_inputs["target_tokens"].to_torch().long()
    with torch.no_grad():
        logits = model(input_ids=tokens).logits[0].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, targets[:, None])[:, 0]


def _check_the_files_score_as_the_session(sess: wb.Session, adapter_dir: str, out: Path) -> None:
    base = resolve_model_path("tiny")
    weights.build_lora_adapter(base_model=base, adapter_path=adapter_dir, output_path=str(out / "peft"))
    weights.build_hf_model(base_model=base, adapter_path=adapter_dir, output_path=str(out / "merged"))
    datum = wb.chat_datum(sess.tokenizer, CONVERSATION)
    expected = (
        sess.policy.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
    )

    merged = AutoModelForCausalLM.from_pretrained(out / "merged", dtype=torch.float32).eval()
    adapted = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), out / "peft"
    ).eval()
    for model in (merged, adapted):
        difference = (_logprobs(model, datum) - expected).abs().max().item()
        assert difference <= TOLERANCE, difference
    untrained = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    assert (_logprobs(untrained, datum) - expected).abs().max().item() > 100 * TOLERANCE  # the check can fail


def _download_both_kinds(sess: wb.Session, tmp_path: Path, base_url: str | None) -> None:
    external = sess.policy.save_weights_external("final").result().path
    assert external == f"tinker://{sess.model_id}/external_weights/final"
    plain = weights.download(tinker_path=external, output_dir=str(tmp_path / "plain"), base_url=base_url)
    assert sorted(p.name for p in Path(plain).iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    _check_the_files_score_as_the_session(sess, plain, tmp_path / "from-external")

    # A training checkpoint: loaded into a temporary run, exported age-encrypted to a key made for this
    # download, fetched, decrypted, and the export deleted.
    state = sess.policy.save_state("step-3").result().path
    decrypted = weights.download(tinker_path=state, output_dir=str(tmp_path / "state"), base_url=base_url)
    _check_the_files_score_as_the_session(sess, decrypted, tmp_path / "from-state")
    assert sorted(c.kind for c in sess.list_checkpoints()) == ["external", "state"]  # the export is gone


def test_weights_download_through_build_hf_model_in_process(
    sess: wb.Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tinker, "ServiceClient", sess.service_client)
    monkeypatch.setattr(tinker, "RestClient", wb.RestClient)
    _download_both_kinds(sess, tmp_path, None)


def test_weights_download_through_build_hf_model_over_http(sess: wb.Session, tmp_path: Path) -> None:
    _download_both_kinds(sess, tmp_path, sess.serve().url)


def test_external_weights_are_encrypted_to_the_recipients_over_http(sess: wb.Session, tmp_path: Path) -> None:
    identity = pyrage.x25519.Identity.generate()
    server = sess.serve()
    with tinker.ServiceClient(base_url=server.url) as client:
        training = client.create_lora_training_client(base_model="tiny", rank=4).result()
        path = (
            training.save_weights_external("sealed", age_encryption_recipients=[str(identity.to_public())])
            .result()
            .path
        )
        rest = tinker.RestClient(base_url=server.url)
        urls = rest.get_external_weights_urls(path).result()
        assert sorted(urls.urls) == ["adapter_config.json.age", "adapter_model.safetensors.age"]
        assert all(url.startswith(server.url) and "signature=" in url for url in urls.urls.values())
        sealed = urllib.request.urlopen(urls.urls["adapter_config.json.age"]).read()
        assert b"lora_alpha" not in sealed and b"lora_alpha" in pyrage.decrypt(sealed, [identity])
        listed = rest.list_checkpoints(path.split("/")[2]).result().checkpoints
        assert [(c.checkpoint_type, c.checkpoint_id) for c in listed] == [
            ("external", "external_weights/sealed")
        ]

        for bad in (["age1notakey"], ["ssh-rsa AAAA"], [str(identity.to_public())] * 11):
            with pytest.raises(tinker.RequestFailedError, match="age_encryption_recipients"):
                training.save_weights_external("bad", age_encryption_recipients=bad).result()
        tampered = urls.urls["adapter_config.json.age"].replace("signature=", "signature=0")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(tampered)
        assert refused.value.code == 403


def _vllm_prompt_logprobs(llm: object, datum: wb.Datum, lora: object | None = None) -> torch.Tensor:
    """vLLM's logprobs of the datum's target tokens, from its prompt logprobs of the whole sequence."""
    import vllm

    tokens = [*datum.model_input.to_ints(), int(datum.loss_fn_inputs["target_tokens"].to_torch()[-1])]
    params = vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    prompt = vllm.inputs.TokensPrompt(prompt_token_ids=tokens)
    scored = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0].prompt_logprobs
    return torch.tensor(
        [position[token].logprob for position, token in zip(scored[1:], tokens[1:], strict=True)]
    )


@pytest.mark.vllm
def test_vllm_loads_the_merged_model_and_the_adapter_with_the_sessions_logprobs(
    tiny_for_vllm: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, sdk_clients: SdkClients
) -> None:
    """The cookbook's `build_hf_model` folder served by vLLM as a model of its own, and its
    `build_lora_adapter` folder as a LoRA adapter on the base model in vLLM, score the datum's tokens as
    the session does (fp32, the tolerance of the HF checks)."""
    import vllm
    from vllm.lora.request import LoRARequest

    monkeypatch.setenv("WORKBENCH_RUNS", str(tmp_path / "runs"))
    with wb.Session(tiny_for_vllm, wb.LoraConfig(rank=4), seed=0, wandb=False, dtype="float32") as sess:
        monkeypatch.setattr(tinker, "ServiceClient", sess.service_client)
        monkeypatch.setattr(tinker, "RestClient", wb.RestClient)
        datum = wb.chat_datum(sess.tokenizer, CONVERSATION)
        for _ in range(3):
            sess.policy.forward_backward([datum], "cross_entropy")
            sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2))
        external = sess.policy.save_weights_external("final").result().path
        adapter_dir = weights.download(tinker_path=external, output_dir=str(tmp_path / "download"))
        expected = (
            sess.policy.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        )
        sdk_clients.close()
    weights.build_hf_model(
        base_model=tiny_for_vllm, adapter_path=adapter_dir, output_path=str(tmp_path / "merged")
    )
    weights.build_lora_adapter(
        base_model=tiny_for_vllm, adapter_path=adapter_dir, output_path=str(tmp_path / "peft")
    )

    merged = vllm.LLM(model=str(tmp_path / "merged"), dtype="float32", kv_cache_memory_bytes=1 << 28, seed=0)
    try:
        difference = (_vllm_prompt_logprobs(merged, datum) - expected).abs().max().item()
        assert difference <= TOLERANCE, difference
    finally:
        merged.llm_engine.engine_core.shutdown()
    base = vllm.LLM(
        model=tiny_for_vllm,
        dtype="float32",
        kv_cache_memory_bytes=1 << 28,
        seed=0,
        enable_lora=True,
        max_lora_rank=8,
    )
    try:
        adapter = LoRARequest(lora_name="peft", lora_int_id=1, lora_path=str(tmp_path / "peft"))
        difference = (_vllm_prompt_logprobs(base, datum, adapter) - expected).abs().max().item()
        assert difference <= TOLERANCE, difference
        untrained = (_vllm_prompt_logprobs(base, datum) - expected).abs().max().item()
        assert untrained > 100 * TOLERANCE  # the check can fail
    finally:
        base.llm_engine.engine_core.shutdown()
