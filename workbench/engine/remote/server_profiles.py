"""What a Tinker service is known to do differently from the protocol the installed SDK speaks.

`RemoteEngine` drives any Tinker-compatible service through the `tinker` SDK, but the services differ
in ways the protocol does not report. `identify_server` names the service at connect time and returns
its `ServerProfile`, so what it cannot do is refused before anything is sent, and what it does
differently is adapted or reported rather than silently different:

- SkyRL's Tinker server (`skyrl[tinker]`, which pins `tinker>=0.25,<0.26`) answers `GET /` with its
  API description (`"name": "Tinker API Mock"`). Its capabilities list no losses, though its JAX backend
  implements four (`skyrl.tinker.types.LOSS_TYPES`); its `asample` futures carry no
  `sample_sequence_ids`, which SDK 0.38 requires; it reports no `loss:sum`, and its optimizer metrics
  under its own names (`skyrl.ai/grad_norm`); it builds every adapter as `LoraConfig(rank, alpha=32,
  seed)` with attention and MLP layers and no unembedding; it accepts a weights load only as a model's
  first request; its models stay loaded after the SDK session ends, until `POST /api/v1/unload_model`,
  and a new model is refused once `max_lora_adapters` are loaded ("Maximum number of LoRA adapters");
  its prompt logprobs start at the prompt's second token (the protocol's first entry, None, is left out).
- Any other service is taken to speak the installed SDK's protocol (`workbench serve`, hosted Tinker).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import httpx

from workbench.types import LoraConfig

PROBE_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class AdapterLayout:
    """The adapter a service builds whatever the request asks: its fixed `alpha` and trained layers."""

    alpha: float
    train_attn: bool
    train_mlp: bool
    train_unembed: bool

    def differences(self, lora: LoraConfig) -> list[str]:
        """`field=asked (service: built)` for each field of `lora` the service would not honour."""
        built = {
            "alpha": self.alpha,
            "train_attn": self.train_attn,
            "train_mlp": self.train_mlp,
            "train_unembed": self.train_unembed,
        }
        return [
            f"{name}={getattr(lora, name)!r} (it builds {value!r})"
            for name, value in built.items()
            if getattr(lora, name) != value
        ]


@dataclass(frozen=True)
class ServerProfile:
    """How one kind of Tinker service departs from the installed SDK's protocol."""

    name: str  # in messages: "SkyRL's Tinker server"
    losses: tuple[str, ...] | None = None  # the losses it implements when its capabilities list none
    metric_names: Mapping[str, str] = field(default_factory=dict)  # its metric name -> ours ("" drops)
    adapter_layout: AdapterLayout | None = None  # None: it honours every LoraConfig field
    sends_sequence_ids: bool = True  # its asample futures carry `sample_sequence_ids`
    unload_model_path: str | None = None  # the endpoint that frees a model, where it has one
    prompt_logprobs_from_second_token: bool = False  # it leaves out the first token's (None) entry
    no_free_slot_message: str | None = (
        None  # what its refusal of a model says when its adapter slots are full
    )

    def has_no_free_slot(self, error: BaseException) -> bool:
        """Whether `error` is this service refusing a new model because every adapter slot is taken."""
        return self.no_free_slot_message is not None and self.no_free_slot_message in str(error)

    def default_lora(self) -> LoraConfig:
        """The adapter a session gets when it names none: `LoraConfig()`'s rank, in the layout this
        service builds (every field it would not honour set to what it builds)."""
        layout = self.adapter_layout
        if layout is None:
            return LoraConfig()
        return LoraConfig(
            alpha=layout.alpha,
            train_attn=layout.train_attn,
            train_mlp=layout.train_mlp,
            train_unembed=layout.train_unembed,
        )

    def rename_metrics(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The service's metrics under workbench's names (those it names its own way mapped or dropped)."""
        renamed = {self.metric_names.get(key, key): value for key, value in metrics.items()}
        return {key: value for key, value in renamed.items() if key}

    def aligned_prompt_logprobs(
        self, logprobs: Sequence[float | None] | None, prompt_length: int
    ) -> list[float | None] | None:
        """Prompt logprobs as the protocol has them, one per prompt token, the first None (it has no
        context), from a service that sends one fewer, starting at the second token."""
        if logprobs is None:
            return None
        if self.prompt_logprobs_from_second_token and len(logprobs) == prompt_length - 1:
            return [None, *logprobs]
        return list(logprobs)

    def free_models(self, url: str, model_ids: Iterable[str]) -> None:
        """Ask the service to unload the models, where it offers a way (best effort: a service that is
        gone has nothing left to free)."""
        if self.unload_model_path is None:
            return
        for model_id in model_ids:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(
                    f"{url}{self.unload_model_path}", json={"model_id": model_id}, timeout=PROBE_TIMEOUT_S
                ).raise_for_status()


TINKER_PROTOCOL = ServerProfile(name="the Tinker service")

SKYRL = ServerProfile(
    name="SkyRL's Tinker server",
    losses=("cross_entropy", "importance_sampling", "ppo", "cispo"),
    metric_names={"skyrl.ai/grad_norm": "grad_norm", "skyrl.ai/learning_rate": ""},
    adapter_layout=AdapterLayout(alpha=32.0, train_attn=True, train_mlp=True, train_unembed=False),
    sends_sequence_ids=False,
    unload_model_path="/api/v1/unload_model",
    prompt_logprobs_from_second_token=True,
    no_free_slot_message="Maximum number of LoRA adapters",  # its backend's `max_lora_adapters`
)

SKYRL_ROOT_NAME = "Tinker API Mock"
"""What SkyRL's `GET /` answers as its `name` (its API description, inherited from skyrl-tx)."""


def identify_server(url: str) -> ServerProfile:
    """The profile of the service at `url`, from its `GET /` answer (one bounded request)."""
    try:
        answer = httpx.get(f"{url}/", timeout=PROBE_TIMEOUT_S)
        description = answer.json() if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return TINKER_PROTOCOL
    if isinstance(description, dict) and description.get("name") == SKYRL_ROOT_NAME:
        return SKYRL
    return TINKER_PROTOCOL
