"""workbench: a Jupyter-first research workbench for LLM post-training.

One kernel-resident `Session` holds a base model with a LoRA policy, and speaks the Tinker training API
(`forward_backward`, `forward`, `optim_step`, ...) on the local GPU or CPU, or, with `Session.connect`,
on a Tinker-compatible service elsewhere.

`import workbench` loads none of the heavy libraries: each public name is imported from its module the
first time it is used (PEP 562 module `__getattr__`), so torch, transformers and peft load with the
first name that needs them, and ipywidgets, matplotlib and W&B only with a panel, a plot or a W&B run.
`from workbench import Session` and `wb.Session` work as with eager imports.

The public names are declared once, in `_PUBLIC` below: `__all__` and the lazy lookup both come from it.
Old names kept for code written against earlier versions are declared there too, marked deprecated;
their modules warn with a DeprecationWarning when they are used.
"""

from __future__ import annotations

import importlib
from typing import Any

# Each module and the public names it gives `workbench`.
_PUBLIC: dict[str, tuple[str, ...]] = {
    # SessionConfig and RunStatus: deprecated names of ModelConfig and ModelStatus
    "workbench.engine.config": ("ModelConfig", "QuantizationConfig", "SessionConfig"),
    "workbench.engine.interface": ("EngineInterface", "ModelStatus", "Restore", "RunStatus"),
    "workbench.engine.local.engine": ("Engine", "ModelTensors"),
    "workbench.engine.model.trainable_adapter": ("NonFiniteGradientError",),
    "workbench.engine.remote.engine": (
        "EngineUnreachableError",
        "RemoteEngine",
        "RemoteProtocolError",
        "RemoteUnsupportedError",
    ),
    "workbench.engine.roles": ("Role",),
    "workbench.engine.samplers.sample_request": ("SampleRequest",),
    "workbench.engine.worker": ("SessionClosedError",),
    "workbench.futures": ("APIFuture", "ReentrantWaitError"),
    "workbench.loops.advantages": (
        "broadcast_to_tokens",
        "completion_mask",
        "gae",
        "group_relative_advantages",
        "kl_penalty",
    ),
    "workbench.loops.chat": ("chat_datum", "chat_prompt"),
    "workbench.loops.data_checks": ("DataProblem", "check_data"),
    "workbench.loops.health": ("rollout_health",),
    "workbench.loops.rollout_groups": ("RolloutGroup", "attach_trainer_logprobs", "rollout_data"),
    "workbench.loops.rollouts": ("completion_positions", "critic_datum", "policy_datum", "sequence_datum"),
    "workbench.losses": ("LOSSES",),
    "workbench.metrics": ("MetricsHistory",),
    "workbench.notebook.panel.panel": ("Panel",),
    "workbench.notebook.panel.rollouts_tab": ("RolloutExplorer",),
    "workbench.notebook.probes": ("AgreementReport", "check_logprob_agreement"),
    "workbench.notebook.rollout_log": ("RolloutLog",),
    "workbench.notebook.run": ("Run", "RunActiveError", "RunState", "WaitInterrupted", "train_step"),
    "workbench.notebook.session": ("Session",),
    "workbench.notebook.sweep": ("Member", "MemberSettings", "Sweep", "grid"),
    "workbench.notebook.triggers": ("PauseRule", "Trigger"),
    "workbench.notebook.token_view": ("render_datum", "render_sample", "render_tokens", "TokenView"),
    "workbench.storage.archive": ("export_archive", "import_archive", "UnsafeArchiveError"),
    "workbench.storage.checkpoint_store": ("CheckpointError", "CheckpointInfo", "CorruptCheckpointError"),
    "workbench.tinker_api.clients": ("ClientFuture", "SamplingClient", "TrainingClient"),
    "workbench.tinker_api.rest_client": ("RestClient",),
    "workbench.tinker_api.service_client": ("ServiceClient",),
    "workbench.types": (
        "AdamParams",
        "Datum",
        "EncodedTextChunk",
        "ForwardBackwardOutput",
        "GetInfoResponse",
        "LoraConfig",
        "ModelData",
        "ModelInput",
        "OptimStepResponse",
        "PromptAltTokens",
        "PromptProvenanceSpan",
        "SampledProvenanceSpan",
        "SampledSequence",
        "SampleResponse",
        "SamplingParams",
        "TensorData",
    ),
}
# Modules that are public names themselves: `wb.datasets.pirate_sft()`.
_PUBLIC_MODULES: dict[str, str] = {"datasets": "workbench.loops.datasets"}

_MODULE_OF: dict[str, str] = {name: module for module, names in _PUBLIC.items() for name in names}
__all__ = sorted([*_MODULE_OF, *_PUBLIC_MODULES])


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here for the next."""
    if name in _PUBLIC_MODULES:
        value = importlib.import_module(_PUBLIC_MODULES[name])
    elif name in _MODULE_OF:
        value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    else:
        raise AttributeError(f"module 'workbench' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
