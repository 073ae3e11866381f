"""The engines: what every surface drives a model through.

- `interface.py`: `EngineInterface`, what both engines do.
- `local/`: `Engine`, the base model in this process and one module per operation on it.
- `remote/`: `RemoteEngine`, a model on a Tinker-compatible service through the `tinker` SDK, and what it
  does for servers that differ from hosted Tinker.
- `model/`: the pieces the local engine is built from (base model and adapters, logprobs, batching,
  trainable adapters, weight versions, the critic's value head).
- `samplers/`: the `SampleRequest` both engines take, and HF `generate` and vLLM, the local engine's two
  samplers.
- `worker.py`, `config.py`, `roles.py`, `threads.py`: the ordered worker thread, the settings, what a client
  speaks for, and how many torch threads the worker uses.
- `bitsandbytes_notices.py`: filters two notices bitsandbytes logs (peft imports it), added here, before
  any module below imports peft.
"""

from workbench.engine.bitsandbytes_notices import quiet_bitsandbytes_notices

quiet_bitsandbytes_notices()
