"""Sampling with vLLM on a GPU, with LoRA hot-swap: each policy weight version is a new LoRA adapter.

vLLM runs in-process (`vllm.LLM`) on its own copy of the base model, with LoRA enabled. When a sampling
request names weights vLLM has not seen (a model's weight version, or an adapter loaded from a sampler
checkpoint), the engine writes that adapter in peft's format (the same folder `save_weights_for_sampler`
writes) and it is registered as a new LoRA id: no reload of the base model and no merge into the
training model. The time this takes is those weights' `sync_ms`, reported with every sample of them.
The base model samples with no LoRA request.

Logprobs are vLLM's raw logprobs of the sampled tokens (before temperature and top-k/top-p), the same
quantity the HF sampler and `forward` report at temperature 1; `topk_sample_logprobs=k` is vLLM's own
`logprobs=k`. At another temperature the temperature rule (`workbench.types.SampledSequence`) wants the
tempered distribution's logprobs, which vLLM's raw mode does not give: the engine then scores the
sequences again with the training model (`workbench.engine.local.sample`), as it does the prompt scores
vLLM has no option for (target ids, prompt draws, top-k of the prompt). When GPU memory is short (less than `SLEEP_BELOW_FREE`
of it free after sampling), vLLM sleeps between sample calls (weights offloaded, KV cache dropped) and
wakes for the next one, leaving the memory to training.

Written against vLLM's public API (`LLM`, `SamplingParams`, `TokensPrompt`, `LoRARequest`,
`LLM.sleep/wake_up`); tested on a GPU by the `vllm`-marked tests.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path

import torch

from workbench.engine.samplers.requests import RequestResult, SampleRequest
from workbench.types import SampledSequence

# Fraction of GPU memory vLLM's engine may take (weights, activations, KV cache).
GPU_MEMORY_UTILIZATION = 0.35
# Sleep between calls when less than this fraction of GPU memory is free after sampling.
SLEEP_BELOW_FREE = 0.2

WriteAdapter = Callable[[Path], None]
"""Writes the adapter for a set of weights, in peft's format, into the given folder."""


class VLLMSampler:
    """A vLLM engine that samples the base model or any policy weight version, as LoRA adapters."""

    def __init__(
        self,
        model_path: str,
        tokenizer_path: str,
        dtype: torch.dtype,
        max_lora_rank: int,
        max_length: int,
        seed: int,
    ):
        import vllm

        self._vllm = vllm
        self._llm = vllm.LLM(
            model=model_path,
            tokenizer=tokenizer_path,
            dtype=str(dtype).removeprefix("torch."),
            enable_lora=True,
            max_lora_rank=max(8, 1 << (max_lora_rank - 1).bit_length()),  # vLLM takes powers of two >= 8
            max_loras=2,
            max_model_len=max_length,
            gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
            enable_sleep_mode=True,
            seed=seed,
        )
        self._adapters_dir = Path(tempfile.mkdtemp(prefix="workbench-vllm-adapters-"))
        self._loaded: dict[Hashable, tuple[int, object]] = {}  # weights key -> (LoRA id, LoRARequest)
        self._sync_ms: dict[Hashable, float] = {}
        self._lora_ids_made = 0
        self._asleep = False

    def sync_ms(self, key: Hashable) -> float:
        """Milliseconds it took to write and register the adapter for `key` (0 before it was)."""
        return self._sync_ms.get(key, 0.0)

    def _lora_request(self, key: Hashable, write_adapter: WriteAdapter) -> object:
        """The LoRA request for `key`'s weights, writing and registering its adapter the first time."""
        if key not in self._loaded:
            from vllm.lora.request import LoRARequest

            start = time.perf_counter()
            self._lora_ids_made += 1
            lora_id = self._lora_ids_made
            folder = self._adapters_dir / f"lora-{lora_id}"
            write_adapter(folder)
            request = LoRARequest(lora_name=f"lora-{lora_id}", lora_int_id=lora_id, lora_path=str(folder))
            self._llm.llm_engine.add_lora(request)
            self._loaded[key] = (lora_id, request)
            self._sync_ms[key] = (time.perf_counter() - start) * 1000
        return self._loaded[key][1]

    def forget(self, key: Hashable) -> None:
        """Drop weights no client needs any more (their adapter folder, their LoRA slot)."""
        loaded = self._loaded.pop(key, None)
        if loaded is not None:
            lora_id, _ = loaded
            self._llm.llm_engine.remove_lora(lora_id)
            shutil.rmtree(self._adapters_dir / f"lora-{lora_id}", ignore_errors=True)

    def generate(
        self, requests: Sequence[SampleRequest], key: Hashable | None, write_adapter: WriteAdapter
    ) -> list[RequestResult]:
        """Sample every request with the weights `key` names (None: the base model)."""
        if self._asleep:
            self._llm.wake_up()
            self._asleep = False
        lora = None if key is None else self._lora_request(key, write_adapter)
        prompts = [self._vllm.inputs.TokensPrompt(prompt_token_ids=list(r.prompt_tokens)) for r in requests]
        params = [self._params(r) for r in requests]
        outputs = self._llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        results = [self._result(request, output) for request, output in zip(requests, outputs, strict=True)]
        free, total = torch.cuda.mem_get_info()
        if free / total < SLEEP_BELOW_FREE:
            self._llm.sleep(level=1)
            self._asleep = True
        return results

    def _params(self, request: SampleRequest) -> object:
        p = request.params
        return self._vllm.SamplingParams(
            n=request.num_samples,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k if p.top_k > 0 else -1,
            max_tokens=request.max_tokens,
            seed=request.seed,
            stop=list(request.stop_strings) or None,
            stop_token_ids=sorted(request.stop_token_ids) or None,
            ignore_eos=not request.stop_token_ids and not request.stop_strings,
            include_stop_str_in_output=True,
            logprobs=request.topk_sample_logprobs,
            prompt_logprobs=0 if request.include_prompt_logprobs else None,
            detokenize=bool(request.stop_strings),
        )

    @staticmethod
    def _result(request: SampleRequest, output: object) -> RequestResult:
        rows = []
        for completion in output.outputs:
            tokens = list(completion.token_ids)
            logprobs = [
                position[token].logprob for position, token in zip(completion.logprobs, tokens, strict=True)
            ]
            topk = None
            if request.topk_sample_logprobs:  # vLLM adds the sampled token to its top-k: keep the k best
                topk = [
                    [
                        (int(token), float(entry.logprob))
                        for token, entry in sorted(position.items(), key=lambda item: -item[1].logprob)
                    ][: request.topk_sample_logprobs]
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
        prompt_logprobs = None
        if request.include_prompt_logprobs:
            prompt_logprobs = [None] + [
                position[token].logprob
                for position, token in zip(output.prompt_logprobs[1:], request.prompt_tokens[1:], strict=True)
            ]
        return RequestResult(sequences=rows, prompt_logprobs=prompt_logprobs)

    def close(self) -> None:
        shutil.rmtree(self._adapters_dir, ignore_errors=True)
        del self._llm
