"""The engine layer: one base model, the LoRA models on it, and every operation on them, in order.

`Engine` is the interface; the modules beside it hold the state (`state`, `adapted_model`,
`training_runs`) and one operation each (`forward_backward`, `optim_step`, `sampling`, `checkpoints`,
`model_lifecycle`, `merged_export`).
"""

from workbench.engine.checkpoint_files import Restore
from workbench.engine.config import EngineConfig, SessionConfig
from workbench.engine.engine import Engine, ModelTensors, RunStatus
from workbench.engine.forward_backward import CustomLossFn
from workbench.engine.roles import Role
from workbench.engine.sampling import SamplerPin

__all__ = [
    "CustomLossFn",
    "Engine",
    "EngineConfig",
    "ModelTensors",
    "Restore",
    "Role",
    "RunStatus",
    "SamplerPin",
    "SessionConfig",
]
