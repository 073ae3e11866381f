"""sharded_base.py: a base sharded over two CPU ranks (gloo) trains its adapters as the unsharded model
does, and each rank holds half of it.

The ranks are real processes (`torch.multiprocessing`, spawned), joined by `torch.distributed` over a
rendezvous file; each writes what it computed to a file, and the test compares it with the same work
done here on the unsharded model. A rank that fails fails the test with its traceback; the ranks are
always joined, and killed first when the test ends otherwise. A collective that waits longer than
`COLLECTIVE_TIMEOUT` fails instead of hanging.
"""

from __future__ import annotations

import datetime
import gc
import multiprocessing
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from transformers import AutoConfig

from tests.engine.model.moe_twins import save_twin
from workbench.engine.model.adapted_model import AdaptedModel
from workbench.engine.model.base_model import load_base_model, resolve_model_path
from workbench.engine.model.batching import MicroBatch
from workbench.engine.model.sharded_base import (
    fits_one_device,
    free_device_memory,
    resident_base_bytes,
    shard_base,
    unsharded_base_bytes,
)
from workbench.engine.model.trainable_adapter import TrainableAdapter
from workbench.types import AdamParams, LoraConfig

RANKS = 2
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=120)
CPU = torch.device("cpu")
ADAPTER = "policy"
LORA = LoraConfig(rank=4, train_unembed=True)  # adapters in every kind of group: layers and output layer
STEP = AdamParams(learning_rate=1e-3)
BATCH, LENGTH = 4, 24


def _run_on_ranks(rank_function: Callable[..., None], folder: Path, *args: object) -> None:
    """Run `rank_function(rank, folder, *args)` on RANKS processes joined in one gloo group.

    They are forked from a server process started clean (not from the test process, whose threads a
    fork would not carry) that has imported this module once: each rank then starts in a moment, where a
    spawned one would import torch, transformers and peft again."""
    multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
    context = mp.start_processes(
        _rank_main, args=(rank_function, folder, *args), nprocs=RANKS, join=False, start_method="forkserver"
    )
    try:
        while not context.join():  # raises, naming the rank, when one fails (the others are terminated)
            pass
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def _rank_main(rank: int, rank_function: Callable[..., None], folder: Path, *args: object) -> None:
    torch.set_num_threads(1)  # two ranks on a loaded machine: one thread each
    dist.init_process_group(
        "gloo",
        init_method=f"file://{folder / 'rendezvous'}",
        rank=rank,
        world_size=RANKS,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        rank_function(rank, folder, *args)
    finally:
        dist.destroy_process_group()


def _adapted_model(name: str, lora: LoraConfig) -> tuple[AdaptedModel, dict[str, torch.nn.Parameter]]:
    """`name` in fp32 on the CPU with one adapter whose every tensor is drawn at random (seeded): a fresh
    adapter's B is zero, which makes A's gradient zero and a comparison of it empty."""
    base, _tokenizer, info = load_base_model(name, CPU, torch.float32)
    model = AdaptedModel(base, info, CPU)
    parameters = model.add_adapter(ADAPTER, lora, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in parameters.values():
            param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    return model, parameters


def _batch(vocab_size: int, rows: list[int]) -> MicroBatch:
    """Rows `rows` of one seeded batch of BATCH datums, two of them padded."""
    tokens_B_T = torch.randint(0, vocab_size, (BATCH, LENGTH + 1), generator=torch.Generator().manual_seed(0))
    mask_B_T = torch.ones(BATCH, LENGTH, dtype=torch.long)
    mask_B_T[1, LENGTH // 2 :] = 0
    mask_B_T[3, LENGTH // 3 :] = 0
    return MicroBatch(
        indices=rows,
        input_ids_B_T=tokens_B_T[rows, :-1],
        attention_mask_B_T=mask_B_T[rows],
        inputs={"target_tokens": tokens_B_T[rows, 1:]},
        lengths=[int(mask_B_T[row].sum()) for row in rows],
    )


def _cross_entropy_sum(model: AdaptedModel, micro: MicroBatch, adapter: str = ADAPTER) -> torch.Tensor:
    """Tinker's cross_entropy with `adapter`: the sum of the targets' negative logprobs, through the
    engine's own pass (the decoder, then the output layer chunk by chunk)."""
    logprobs_B_T, _entropy = model.target_logprobs(adapter, micro, with_entropy=False, trained_B_T=None)
    return -(logprobs_B_T * micro.attention_mask_B_T).sum()


def _train_sharded(rank: int, folder: Path) -> None:
    """One data-parallel step on a sharded tiny: this rank's datums, gradients summed over the ranks."""
    model, parameters = _adapted_model("tiny", LORA)
    adapter = TrainableAdapter(ADAPTER, parameters)
    shard_base(model.base, init_device_mesh("cpu", (RANKS,)))
    with adapter.accumulating("forward_backward"):
        loss = _cross_entropy_sum(model, _batch(model.info.vocab_size, list(range(rank, BATCH, RANKS))))
        loss.backward()
        for param in parameters.values():
            dist.all_reduce(param.grad)
    loss = loss.detach()
    dist.all_reduce(loss)
    gradients = {name: param.grad.clone() for name, param in parameters.items()}
    response = adapter.optim_step(STEP)
    weights = {name: param.detach().clone() for name, param in parameters.items()}
    critic = _later_adapter_gradients(model, list(range(rank, BATCH, RANKS)))
    for grad in critic.values():
        dist.all_reduce(grad)
    torch.save(
        {
            "loss": loss,
            "gradients": gradients,
            "applied": response.applied,
            "weights": weights,
            "critic_gradients": critic,
        },
        folder / f"rank{rank}.pt",
    )


def _later_adapter_gradients(model: AdaptedModel, rows: list[int]) -> dict[str, torch.Tensor]:
    """The gradients of a second adapter added after the first (after the base was sharded, on a rank),
    its B drawn at random as the first's, from `rows`' cross-entropy sum."""
    parameters = model.add_adapter("critic", LoraConfig(rank=2), seed=3)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in parameters.values():
            param.copy_(0.02 * torch.randn(param.shape, generator=generator))
    _cross_entropy_sum(model, _batch(model.info.vocab_size, rows), adapter="critic").backward()
    return {name: param.grad.clone() for name, param in parameters.items()}


def _relative_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(value - reference) / torch.linalg.vector_norm(reference))


def test_a_sharded_tiny_trains_its_adapters_as_the_unsharded_model(tmp_path: Path) -> None:
    _run_on_ranks(_train_sharded, tmp_path)
    model, parameters = _adapted_model("tiny", LORA)
    adapter = TrainableAdapter(ADAPTER, parameters)
    with adapter.accumulating("forward_backward"):
        loss = _cross_entropy_sum(model, _batch(model.info.vocab_size, list(range(BATCH))))
        loss.backward()
    loss = loss.detach()
    gradients = {name: param.grad.clone() for name, param in parameters.items()}
    assert adapter.optim_step(STEP).applied
    critic = _later_adapter_gradients(model, list(range(BATCH)))
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(RANKS)]
    for result in ranks:
        assert result["applied"]
        assert abs(float(result["loss"]) - float(loss)) <= 1e-5 * abs(float(loss))
        assert result["gradients"].keys() == gradients.keys()
        worst = max(_relative_error(result["gradients"][name], grad) for name, grad in gradients.items())
        assert worst <= 1e-5, f"adapter gradients {worst:.2g} from the unsharded model's"
        stepped = max(
            _relative_error(result["weights"][name], param.detach()) for name, param in parameters.items()
        )
        assert stepped <= 1e-5, f"adapters after the step {stepped:.2g} from the unsharded model's"
        later = max(_relative_error(result["critic_gradients"][name], grad) for name, grad in critic.items())
        assert later <= 1e-5, f"an adapter added after sharding: gradients {later:.2g} from the unsharded"
    for name in parameters:  # every rank the same adapter, bit for bit
        assert torch.equal(ranks[0]["weights"][name], ranks[1]["weights"][name]), name


def _measure_sharded_smollm2(rank: int, folder: Path) -> None:
    """A rank's base weights whole, sharded, and after a training pass on the sharded base; and how many
    of the whole weights are still alive once sharded."""
    model, parameters = _adapted_model("smollm2-135m", LoraConfig(rank=8))
    whole = resident_base_bytes(model.base)
    originals = [weakref.ref(param) for name, param in model.base.named_parameters() if "lora_" not in name]
    shard_base(model.base, init_device_mesh("cpu", (RANKS,)))
    gc.collect()
    sharded = resident_base_bytes(model.base)
    _cross_entropy_sum(model, _batch(model.info.vocab_size, [rank])).backward()
    assert all(param.grad is not None for param in parameters.values())
    torch.save(
        {
            "whole": whole,
            "sharded": sharded,
            "after_pass": resident_base_bytes(model.base),
            "originals_alive": sum(original() is not None for original in originals),
        },
        folder / f"rank{rank}.pt",
    )


@pytest.mark.integration
def test_each_rank_holds_at_most_0_6_of_smollm2s_base(tmp_path: Path) -> None:
    resolve_model_path("smollm2-135m")  # built here, once: inside a process group only rank 0 could write it
    _run_on_ranks(_measure_sharded_smollm2, tmp_path)
    for rank in range(RANKS):
        measured = torch.load(tmp_path / f"rank{rank}.pt")
        assert measured["whole"] >= 134_000_000 * 4  # SmolLM2-135M's weights in fp32, tied ones once
        assert measured["originals_alive"] == 0  # no whole weight kept beside the shards
        assert measured["sharded"] <= 0.6 * measured["whole"], measured
        assert measured["after_pass"] <= 0.6 * measured["whole"], measured


def test_the_whole_base_is_counted_before_loading_and_fits_the_cpu_or_not() -> None:
    base, _tokenizer, _info = load_base_model("tiny", CPU, torch.float32)
    counted = unsharded_base_bytes(AutoConfig.from_pretrained(resolve_model_path("tiny")), torch.float32)
    assert counted == resident_base_bytes(base)
    assert fits_one_device(counted, CPU)
    assert not fits_one_device(free_device_memory(CPU), CPU)  # all of it leaves no room to train


def test_expert_adapters_are_refused_before_anything_is_sharded(tmp_path: Path) -> None:
    """peft parametrizes a fused expert stack's weight during each forward call, which FSDP's gathered
    weight does not hold: refused by name, the model untouched (one rank: nothing to wait for)."""
    model, _parameters = _adapted_model(save_twin("qwen3_moe", tmp_path / "qwen3-moe"), LoraConfig(rank=2))
    dist.init_process_group(
        "gloo",
        init_method=f"file://{tmp_path / 'rendezvous'}",
        rank=0,
        world_size=1,
        timeout=COLLECTIVE_TIMEOUT,
    )
    try:
        with pytest.raises(ValueError, match=r"ParamWrapper: \['model\.layers\.0\.mlp\.experts"):
            shard_base(model.base, init_device_mesh("cpu", (1,)))
    finally:
        dist.destroy_process_group()
    assert not any(isinstance(param, DTensor) for param in model.base.parameters())
