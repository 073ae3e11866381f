"""The local engine: one base model in this process, the LoRA models on it, and every operation on them.

`engine.py` is the engine; `state.py`, `lora_models.py` hold what the operations share; the other
modules are one operation each (`forward_backward`, `optim_step`, `sample`, `checkpoints`,
`model_lifecycle`, `merged_export`) or one part of one (`call_plan` and `pass_computation` of
`forward_backward`; `checkpoint_files`, `provenance`, `stability_records`).
"""
