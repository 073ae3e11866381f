"""Sampling backends behind one interface: HF `generate` in-process (`hf.py`), or vLLM with LoRA
hot-swap (`vllm.py`).

`sampler.py` is what every backend is to the engine (the `Sampler` protocol, the `PinnedWeights` it
samples, the `SamplerBackend` row that starts it); `factory.py` is the table of backends and the one
place that chooses one for a session (`"auto"`, its fallback and notice), refuses and starts it.
Every surface builds a `SampleRequest` (`sample_request.py`), checked as it is built; `requests.py`
prepares it for a sampler against the model and holds what a sampler returns; `prefix_cache.py` is the
HF sampler's LRU of prompts' keys and values across calls. A new backend is a module here and a row in
`factory.SAMPLERS`.
"""

from workbench.engine.samplers.sampler import SamplerChoice

__all__ = ["SamplerChoice"]
