"""The local engine: one base model in this process, the LoRA models on it, and every operation on them.

`engine.py` is the engine, and `base_models.py` an engine per base model within a memory budget;
`state.py`, `lora_models.py` hold what the operations share; the other modules are one operation each
(`forward_backward.py`, `optim_step.py`, `sample.py`, `checkpoints.py`, `model_lifecycle.py`,
`merged_export.py`) or one part of one (`call_plan.py` and `pass_computation.py` of `forward_backward`;
`checkpoint_files.py`, `checkpoint_writes.py`, `provenance.py`, `stability_records.py`; `streams.py`, a pass's datums on
single-threaded streams, and `heap.py`, each micro-batch's freed memory handed back to the system;
`resource_use.py`, what the process uses, recorded with each optimizer step).
On several devices, `ranks.py` starts and watches the follower ranks (`rank_follower.py` is one's
process, `rank_messages.py` what crosses its pipe), `collectives.py` joins them in one process group and
sums a call's gradient, `data_parallel.py` splits a training call over them and gathers it back, and
`rank_sampling.py` does the same for a sample call.
"""
