"""LoRA on mixtures of experts: every expert adapted, trained, saved, sampled and exported exactly.

On tiny random twins of Qwen3-MoE, gpt-oss and DeepSeek-V3 (and Mixtral and Qwen2-MoE for placement),
built by `tests.engine.model.moe_twins`.
"""

from __future__ import annotations

from pathlib import Path

import peft
import pytest
import safetensors.torch
import tinker
import torch
from transformers import AutoModelForCausalLM

import workbench as wb
from tests.engine.model.gpt2_twin import save_gpt2_twin
from tests.engine.model.moe_twins import EXPERTS_PER_TOKEN, FAMILIES, NUM_EXPERTS, save_twin
from workbench.notebook.probes import check_logprob_agreement

TRAINED = ("qwen3_moe", "gpt_oss", "deepseek_v3")  # the families hosted Tinker trains most
RANK = 4


@pytest.fixture(scope="module")
def twins(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("moe-twins")
    return {family: save_twin(family, folder / family) for family in FAMILIES}


def _datum(tokens: list[int]) -> wb.Datum:
    return wb.Datum(
        model_input=wb.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


DATA = [_datum(list(range(5 + i, 25 + 2 * i))) for i in range(3)]


def _train(sess: wb.Session, steps: int) -> list[float]:
    losses = []
    for _ in range(steps):
        out = sess.policy.forward_backward(DATA, "cross_entropy").result()
        losses.append(out.metrics["loss:sum"])
        assert sess.policy.optim_step(wb.AdamParams(learning_rate=1e-2)).result().applied
    return losses


def _live_lora(sess: wb.Session, adapter: str = "policy") -> dict[str, torch.nn.Parameter]:
    return {
        n: p for n, p in sess.engine.torch_model.named_parameters() if "lora_" in n and f".{adapter}." in n
    }


def _expert_stacks(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every fused expert weight of a clean model, by name."""
    return {
        name: tuple(p.shape) for name, p in model.named_parameters() if ".experts." in name and p.dim() == 3
    }


def _must_adapt(folder: str) -> set[str]:
    """What a default LoraConfig must adapt on a clean model: every linear layer (attention, dense MLP,
    shared experts, output layer) and the module of every expert stack."""
    model = AutoModelForCausalLM.from_pretrained(folder)
    linear = {name for name, module in model.named_modules() if isinstance(module, torch.nn.Linear)}
    return linear | {name.rsplit(".", 1)[0] for name in _expert_stacks(model)}


def _adapted_modules(params: dict[str, torch.nn.Parameter]) -> set[str]:
    return {n.split(".lora_")[0].removeprefix("base_model.model.").replace(".base_layer", "") for n in params}


def _logprobs(model: torch.nn.Module, datum: wb.Datum) -> torch.Tensor:
    tokens = torch.tensor([datum.model_input.to_ints()])
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].tolist())
    with torch.no_grad():
        logits_T_V = model(input_ids=tokens).logits[0]
    return torch.log_softmax(logits_T_V, -1).gather(-1, targets[:, None])[:, 0]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_every_mlp_weight_gets_an_adapter_and_every_expert_its_own_pair(twins, family) -> None:
    """train_mlp covers the dense MLPs, the shared experts and each routed expert: each expert stack
    gets A of (experts·r, in) and B of (out, experts·r); attention and the output layer as before."""
    stacks = _expert_stacks(AutoModelForCausalLM.from_pretrained(twins[family]))
    assert len(stacks) == 2 * (2 - (family == "deepseek_v3"))  # DeepSeek-V3's first layer is dense
    with wb.Session(twins[family], wb.LoraConfig(rank=RANK), seed=0) as sess:
        params = _live_lora(sess)
        assert _adapted_modules(params) == _must_adapt(twins[family])
        assert sess.base_info.expert_weights.keys() == stacks.keys()
        expert_tensors = {n: p for n, p in params.items() if ".experts." in n}
        assert len(expert_tensors) == 2 * len(stacks)  # A and B per stack
        for name, param in expert_tensors.items():
            expert_dim = param.shape[0] if ".lora_A." in name else param.shape[1]
            assert expert_dim == NUM_EXPERTS * RANK, (name, tuple(param.shape))


def test_what_a_config_asks_for_and_the_model_cannot_provide_is_refused(tmp_path) -> None:
    """GPT-2 keeps its projections in `Conv1D` layers, which are no `nn.Linear`: asking for attention
    or MLP adapters is refused with the names, never skipped; the output layer alone still works."""
    folder = save_gpt2_twin(tmp_path / "gpt2")
    with pytest.raises(ValueError, match=r"train_attn=True.*c_attn"):
        wb.Session(folder, wb.LoraConfig(rank=2, train_mlp=False))
    with pytest.raises(ValueError, match=r"train_mlp=True.*mlp\.c_fc"):
        wb.Session(folder, wb.LoraConfig(rank=2, train_attn=False))
    with wb.Session(folder, wb.LoraConfig(rank=2, train_attn=False, train_mlp=False)) as sess:
        assert {n.split(".lora_")[0].split(".")[-1] for n in _live_lora(sess)} == {"lm_head"}
        # the same refusal for a second model, in-process and over HTTP, and the session is unchanged
        before = sess.state_digest()
        with pytest.raises(ValueError, match=r"train_attn=True.*c_attn"):
            sess.service_client().create_lora_training_client(base_model=folder, rank=2).result()
        with (
            sess.serve() as server,
            tinker.ServiceClient(base_url=server.url, api_key="tml-local") as service,
            pytest.raises(tinker.RequestFailedError, match=r"train_attn=True.*c_attn"),
        ):
            service.create_lora_training_client(base_model=folder, rank=2).result()
        assert sess.state_digest() == before


def _router_picks(sess: wb.Session) -> tuple[list[torch.Tensor], list]:
    """Hooks that record, for every MoE layer in order, the experts its router picked per token."""
    picks: list[torch.Tensor] = []
    hooks = []
    for module in sess.engine.torch_model.get_base_model().modules():
        if "router" in type(module).__name__.lower():
            hooks.append(module.register_forward_hook(lambda _m, _i, out: picks.append(out[-1].detach())))
    assert hooks
    return picks, hooks


@pytest.mark.parametrize("family", TRAINED)
def test_gradients_reach_every_expert_the_router_picked_and_no_other(twins, family) -> None:
    """With every expert's B made non-zero, one token's backward pass gives a non-zero gradient to A_e
    and B_e of exactly the experts the router sent it to, in every MoE layer."""
    with wb.Session(twins[family], wb.LoraConfig(rank=RANK), seed=0) as sess:
        params = _live_lora(sess)
        with torch.no_grad():
            for name, param in params.items():
                if ".lora_B." in name:
                    param.normal_(std=0.1)
        picks, hooks = _router_picks(sess)
        sess.policy.forward_backward([_datum([7, 11])], "cross_entropy").result()
        for hook in hooks:
            hook.remove()
        layers = sorted({n.split(".mlp.experts")[0] for n in params if ".experts." in n})
        assert len(picks) == len(layers) and all(p.shape == (1, EXPERTS_PER_TOKEN) for p in picks)
        for layer, picked in zip(layers, picks, strict=True):
            chosen = set(picked.flatten().tolist())
            assert len(chosen) == EXPERTS_PER_TOKEN
            for name, param in params.items():
                if not name.startswith(layer + ".mlp.experts"):
                    continue
                grad = param.grad
                if ".lora_A." in name:  # rows e·r .. (e+1)·r belong to expert e
                    per_expert = grad.reshape(NUM_EXPERTS, RANK, -1)
                else:  # columns k·E + e belong to expert e (peft's `ParamWrapper.get_delta_weight`)
                    per_expert = grad.reshape(grad.shape[0], RANK, NUM_EXPERTS).permute(2, 0, 1)
                reached = {e for e in range(NUM_EXPERTS) if per_expert[e].abs().sum() > 0}
                assert reached == chosen, (name, reached, chosen)


@pytest.mark.parametrize("family", TRAINED)
def test_sampler_and_trainer_agree_on_trained_experts(twins, family) -> None:
    """After steps that change the experts' adapters, HF sampling and `forward` score the same tokens
    alike, on two threads (where a pass would otherwise run on two streams sharing the experts)."""
    with wb.Session(twins[family], wb.LoraConfig(rank=RANK), seed=0, threads=2) as sess:
        assert sess.threads.streams == 1 and "streams" not in str(sess.threads)  # and says so
        losses = _train(sess, 3)
        assert losses[-1] < losses[0]
        experts_b = [p for n, p in _live_lora(sess).items() if ".experts." in n and ".lora_B." in n]
        assert experts_b and all(float(p.detach().abs().sum()) > 0 for p in experts_b)
        report = check_logprob_agreement(sess, [[5, 6, 7], [9, 10]], num_samples=2)
        assert report.num_tokens > 0 and report.max_abs_diff < 1e-4


def test_a_model_adapted_through_its_weights_keeps_its_passes_on_the_worker(tmp_path) -> None:
    """DeepSeek-V3 with dense layers only has no expert stack, but peft's rewrite makes its MLP layers
    adapted through their weights (`ParamWrapper`), which registers a parametrization on the layer for
    each call: two streams running the model at once failed in backward ("backward through the graph a
    second time", in 2 of 5 runs of one test). Its passes run on the worker; a dense model keeps its
    streams."""
    folder = save_twin("deepseek_v3", tmp_path / "deepseek-dense", dense=True)
    with wb.Session(folder, wb.LoraConfig(rank=RANK), seed=0, threads=2) as sess:
        assert any(isinstance(m, peft.tuners.lora.ParamWrapper) for m in sess.engine.torch_model.modules())
        assert not any(".experts." in name for name, _ in sess.engine.torch_model.named_parameters())
        assert sess.threads.streams == 1
        _train(sess, 3)
        lora_b = [p for n, p in _live_lora(sess).items() if ".lora_B." in n]
        assert lora_b and all(float(p.detach().abs().sum()) > 0 for p in lora_b)  # every layer trained
    with wb.Session(save_twin("mixtral", tmp_path / "mistral", dense=True), threads=2) as sess:
        assert sess.threads.streams == 2


@pytest.mark.parametrize("family", TRAINED)
def test_resume_is_bit_exact_with_expert_adapters(twins, family, tmp_path) -> None:
    with wb.Session(twins[family], wb.LoraConfig(rank=RANK), seed=3, model_dir=tmp_path / "run") as sess:
        _train(sess, 2)
        folder = Path(sess.policy.save_state("mid").result().folder)
        saved = safetensors.torch.load_file(folder / "policy" / "adapter_model.safetensors")
        assert any(".experts." in key for key in saved)
        expected = _train(sess, 2)
        expected_adapter = {n: p.detach().clone() for n, p in _live_lora(sess).items()}
    with wb.Session.from_checkpoint(folder, model_dir=tmp_path / "resumed") as resumed:
        assert _train(resumed, 2) == expected
        got = _live_lora(resumed)
        assert got.keys() == expected_adapter.keys()
        assert all(torch.equal(got[n], expected_adapter[n]) for n in got)


@pytest.mark.parametrize("family", TRAINED)
def test_sampler_weights_load_in_peft_and_the_merged_export_matches(twins, family, tmp_path) -> None:
    """`save_weights_for_sampler` writes the expert adapters in peft's format (`target_parameters`),
    which peft loads on its own with the same logprobs; the merged export folds each expert's B_e·A_e
    into its weights; a sampling client made from the saved weights samples."""
    with wb.Session(twins[family], wb.LoraConfig(rank=RANK), seed=0, model_dir=tmp_path / "run") as sess:
        _train(sess, 2)
        live = (
            sess.policy.forward([DATA[0]], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_torch()
        )
        saved = sess.policy.save_weights_for_sampler("s").result()
        merged = sess.export_merged(tmp_path / "merged")
        sampled = sess.policy.create_sampling_client(saved.path).sample(
            wb.ModelInput.from_ints([5, 6]), 1, wb.SamplingParams(max_tokens=4, temperature=1.0)
        )
        assert len(sampled.result().sequences[0].tokens) == 4
    tensors = safetensors.torch.load_file(Path(saved.folder) / "adapter_model.safetensors")
    assert any(".experts." in key for key in tensors)
    from_peft = peft.AutoPeftModelForCausalLM.from_pretrained(saved.folder).eval()
    torch.testing.assert_close(_logprobs(from_peft, DATA[0]), live, rtol=0, atol=1e-5)
    from_merged = AutoModelForCausalLM.from_pretrained(merged).eval()
    torch.testing.assert_close(_logprobs(from_merged, DATA[0]), live, rtol=0, atol=1e-5)
    # the adapters matter: the base model scores the tokens differently
    base = AutoModelForCausalLM.from_pretrained(twins[family]).eval()
    assert float((_logprobs(base, DATA[0]) - live).abs().max()) > 1e-3


@pytest.mark.parametrize("family", TRAINED)
def test_the_critic_adapts_the_experts_too(twins, family) -> None:
    with wb.Session(twins[family], wb.LoraConfig(rank=RANK), seed=0) as sess:
        critic = sess.create_critic()
        critic_params = _live_lora(sess, "critic")
        # the default critic adapter: attention and every MLP weight, no output layer
        assert _adapted_modules(critic_params) == _must_adapt(twins[family]) - {"lm_head"}
        tokens = list(range(5, 15))
        datum = wb.Datum(
            model_input=wb.ModelInput.from_ints(tokens),
            loss_fn_inputs={"values": [0.0] * len(tokens), "returns": [0.1] * len(tokens)},
        )
        for _ in range(2):  # the value head starts at zero: the adapters get a gradient from step 2
            critic.forward_backward([datum], "ppo_critic").result()
            assert critic.optim_step(wb.AdamParams(learning_rate=1e-2)).result().applied
        assert any(
            float(p.detach().abs().sum()) > 0
            for n, p in critic_params.items()
            if ".experts." in n and ".lora_B." in n
        )


@pytest.mark.vllm
def test_vllm_refuses_expert_adapters_and_auto_takes_hf(twins, capsys) -> None:
    """vLLM's CPU build has no fused-MoE LoRA kernels: `sampler="vllm"` is refused with the reason, and
    `sampler="auto"` samples with HF, saying why."""
    with pytest.raises(ValueError, match="fused-MoE LoRA kernels"):
        wb.Session(twins["qwen3_moe"], wb.LoraConfig(rank=RANK), sampler="vllm")
    with wb.Session(twins["qwen3_moe"], wb.LoraConfig(rank=RANK), sampler="auto") as sess:
        assert sess.config.sampler == "hf"
    assert "fused-MoE LoRA kernels" in capsys.readouterr().out
