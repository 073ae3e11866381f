"""The frozen base model and every LoRA adapter on it: one copy of the base weights for all models.

Each training run's policy and critic, and each adapter loaded for a sampling client, is a named peft
adapter on the same base. The forward pass uses one of them at a time (`using`), or none: the base model
with adapters off is the reference policy. The first adapter wraps the base in a `peft.PeftModel`;
removing the last one unwraps it again (peft cannot hold zero adapters), the base weights untouched.

Everything here runs on the engine's worker thread.

Notation: B datums in a micro-batch, T positions, V vocabulary, H hidden size.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from pathlib import Path

import peft
import safetensors.torch
import torch
from peft.utils import get_peft_model_state_dict
from torch import Tensor, nn
from transformers import PreTrainedModel

from workbench.engine.model.activation_checkpointing import (
    checkpointed_layer_count,
    checkpointing,
    decoder_layers,
    full_activation_limit,
    full_activation_tokens,
    install_checkpointing,
)
from workbench.engine.model.base_model import BaseModelInfo, adapter_parameters, add_lora_adapter, attach_lora
from workbench.engine.model.batching import MicroBatch
from workbench.engine.model.grouped_attention import use_grouped_attention
from workbench.engine.model.logprobs import feature_forward, language_model_logprobs, target_logprobs
from workbench.engine.model.prefix_attention import prefix_pass, suffix_pass
from workbench.engine.model.prefix_parts import PrefixStage
from workbench.engine.model.shared_prefix import SharedPrefixMicroBatch
from workbench.engine.model.value_head import ValueHead
from workbench.storage.checkpoint_store import json_bytes
from workbench.types import LoraConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


class AdaptedModel:
    """The base model, its adapters, and the forward passes every operation uses."""

    def __init__(
        self,
        base: PreTrainedModel,
        info: BaseModelInfo,
        device: torch.device,
    ):
        self.base = base
        self.info = info
        self.device = device
        if device.type == "cpu":
            use_grouped_attention(base)
        self.peft_model: peft.PeftModel | None = None
        self.decoder_layers = decoder_layers(base.get_decoder())
        install_checkpointing(self.decoder_layers)
        # F of `workbench.engine.model.activation_checkpointing`'s rule for this model
        self.full_activation_limit = full_activation_limit(
            info.hidden_size, info.num_layers, info.vocab_size, base.dtype.itemsize
        )

    @property
    def module(self) -> nn.Module:
        """What the forward pass runs: the peft model, or the bare base before any adapter exists."""
        return self.base if self.peft_model is None else self.peft_model

    # ------------------------------------------------------------------------------------------ adapters

    def add_adapter(self, name: str, lora: LoraConfig, seed: int) -> dict[str, nn.Parameter]:
        """Add a LoRA adapter (A drawn from `seed`, B zero: the adapted model starts equal to the base);
        returns its trainable parameters by name."""
        if self.peft_model is None:
            self.peft_model = attach_lora(self.base, self.info, lora, name, seed=seed)
        else:
            add_lora_adapter(self.peft_model, self.info, lora, name, seed=seed)
        return adapter_parameters(self.peft_model, name)

    def load_adapter(self, name: str, folder: Path) -> None:
        """Load a saved peft adapter folder as an inference-only adapter."""
        if self.peft_model is None:
            self.peft_model = peft.PeftModel.from_pretrained(
                self.base, str(folder), adapter_name=name, is_trainable=False
            )
            self.peft_model.eval()
        else:
            self.peft_model.load_adapter(str(folder), adapter_name=name, is_trainable=False)
        for param in adapter_parameters(self.peft_model, name).values():
            param.requires_grad_(False)

    def delete_adapter(self, name: str) -> None:
        """Remove an adapter and free its weights; the last one unwraps the base model again."""
        assert self.peft_model is not None
        if list(self.peft_model.peft_config) == [name]:
            self.base = self.peft_model.unload()
            self.peft_model = None
            return
        if self.peft_model.active_adapter == name:  # another becomes active quietly (peft would warn)
            self.peft_model.set_adapter(next(other for other in self.peft_model.peft_config if other != name))
        self.peft_model.delete_adapter(name)

    def adapter_tensors(self, name: str) -> dict[str, Tensor]:
        """One adapter's tensors under peft's file keys (the adapter name removed), as views of the live
        parameters: writing into them writes the adapter. The embedding layers stay out (peft would add
        the base model's full embeddings when the output layer is adapted)."""
        assert self.peft_model is not None
        return get_peft_model_state_dict(self.peft_model, adapter_name=name, save_embedding_layers=False)

    def peft_config_dict(self, name: str) -> dict[str, object]:
        assert self.peft_model is not None
        return self.peft_model.peft_config[name].to_dict()

    def adapter_files(self, name: str) -> dict[str, bytes]:
        """One adapter as peft's two files, loadable on their own by `PeftModel.from_pretrained` and vLLM.

        The config is peft's own (`LoraConfig.to_dict()`, as `save_pretrained` writes it) with
        `base_model_name_or_path` set to the folder or HF id the base was loaded from, and set-valued
        fields sorted so the same adapter always gives the same bytes.
        """
        assert self.peft_model is not None
        config = copy.deepcopy(self.peft_model.peft_config[name])
        config.base_model_name_or_path = self.info.path
        config.inference_mode = True
        config_dict = {
            key: sorted(value) if isinstance(value, set) else value for key, value in config.to_dict().items()
        }
        tensors = {
            key: value.detach().cpu().contiguous() for key, value in self.adapter_tensors(name).items()
        }
        return {
            ADAPTER_CONFIG: json_bytes(config_dict),
            ADAPTER_WEIGHTS: safetensors.torch.save(tensors, metadata={"format": "pt"}),
        }

    def free(self) -> None:
        """Drop every reference to the model's tensors, so their memory is returned (the engine is closed)."""
        del self.base, self.peft_model

    # ------------------------------------------------------------------------------------------ forward

    @contextlib.contextmanager
    def using(self, adapter: str | None) -> Iterator[nn.Module]:
        """Run the body with `adapter` active, or with every adapter off (`None`: the base model)."""
        if self.peft_model is None:
            if adapter is not None:
                raise ValueError(f"no adapter {adapter!r} is loaded")
            yield self.base
            return
        if adapter is None:
            with self.peft_model.disable_adapter():
                yield self.peft_model
            return
        if self.peft_model.active_adapter != adapter:
            self.peft_model.set_adapter(adapter)
        yield self.peft_model

    def activation_checkpointing(self, micro: MicroBatch) -> contextlib.AbstractContextManager[None]:
        """Checkpoint as many decoder layers as `workbench.engine.model.activation_checkpointing`'s rule gives for this
        micro-batch's padded tokens when gradients are on (none otherwise)."""
        count = 0
        if torch.is_grad_enabled():
            count = checkpointed_layer_count(
                computed_tokens(micro), len(self.decoder_layers), self.full_activation_limit
            )
        return self.checkpointing_first(count)

    def checkpointing_first(self, count: int) -> contextlib.AbstractContextManager[None]:
        """Checkpoint the first `count` decoder layers within the block (the calling thread's passes)."""
        return checkpointing(self.decoder_layers[:count])

    def final_hidden_states(self, micro: MicroBatch) -> Tensor:
        """The decoder's last hidden states, (B, T, H), with whatever adapter state is in effect: the
        model without its output layer (the logits are made chunk by chunk where they are used)."""
        decoder = self.base.get_decoder()
        with self.activation_checkpointing(micro):
            return decoder(
                input_ids=micro.input_ids_B_T, attention_mask=micro.attention_mask_B_T, use_cache=False
            ).last_hidden_state

    def target_logprobs(
        self, adapter: str | None, micro: MicroBatch, with_entropy: bool, trained_B_T: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """log p(target_t | prefix) for every position (with autograd when enabled), and the detached
        next-token entropy when asked; `trained_B_T` (bool, or None: all) marks the positions whose
        logprob can have a gradient (`logprobs.target_logprobs`).

        What the backward pass needs is kept or recomputed by `workbench.engine.model.activation_checkpointing`'s
        rule; a recomputation runs with the adapter state it finds then, which is this one: the worker
        runs nothing else between a call's forward and its backward.
        """
        if isinstance(micro, SharedPrefixMicroBatch):
            return self.shared_target_logprobs(adapter, micro, with_entropy, trained_B_T)
        with self.using(adapter), self.activation_checkpointing(micro):
            return language_model_logprobs(
                self.base,
                micro.input_ids_B_T,
                micro.attention_mask_B_T,
                micro.inputs["target_tokens"],
                vocab_size=self.info.vocab_size,
                logits_from_hidden_states=self.info.logits_from_hidden_states,
                kept_positions=full_activation_tokens(
                    micro.input_ids_B_T.numel(), self.full_activation_limit
                ),
                with_entropy=with_entropy,
                trained_B_T=trained_B_T,
            )

    def shared_target_logprobs(
        self,
        adapter: str | None,
        micro: SharedPrefixMicroBatch,
        with_entropy: bool,
        trained_B_T: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """`target_logprobs` of a shared-prefix micro-batch, in its plain (R, T) layout: the prefixes
        and suffixes run once each (`workbench.engine.model.prefix_attention`); a prefix position's
        log-softmax is computed once and read at every datum's target there (as G of the K target
        columns `logprobs.target_logprobs` takes), its entropy once and shared."""
        kept = full_activation_tokens(micro.computed_tokens, self.full_activation_limit)
        with self.activation_checkpointing(micro):
            stage = self.prefix_stage(adapter, None, micro, with_entropy, kept, trained_B_T)
            return self.suffix_part(
                adapter,
                None,
                stage,
                micro,
                list(range(micro.members)),
                kept_positions=max(0, kept - micro.prefix_ids_P_L.numel()),
                trained_B_T=trained_B_T,
            )

    def _forward_and_head(self, head: ValueHead | None) -> tuple[Callable[..., Tensor], nn.Module]:
        """What a shared pass runs (`feature_forward` for logprobs; the decoder's last hidden states for
        a critic's `head`) and the output layer (the head itself for a critic)."""
        if head is not None:
            decoder = self.base.get_decoder()
            return lambda **kwargs: decoder(**kwargs).last_hidden_state, head
        return feature_forward(self.base, logits_from_hidden_states=self.info.logits_from_hidden_states)

    def prefix_stage(
        self,
        adapter: str | None,
        head: ValueHead | None,
        micro: SharedPrefixMicroBatch,
        with_entropy: bool,
        kept_positions: int,
        trained_B_T: Tensor | None,
        in_parts: bool = False,
    ) -> PrefixStage:
        """A shared pass's prefixes, once (`workbench.engine.model.prefix_parts`): the targets' logprobs
        per datum, (P, L_max, G, …), or the critic `head`'s values, (P, L_max); in parts, with leaf
        copies for the parts. A prefix position's logprobs have autograd where `trained_B_T` (None: all)
        marks it for any datum of its group."""
        with self.using(adapter):
            forward, output_layer = self._forward_and_head(head)
            prefix_P_L_F, keys_values = prefix_pass(forward, micro)
            if head is not None:
                return PrefixStage.of(head(prefix_P_L_F), keys_values, None, in_parts)
            prefix_targets_P_L_G_X = micro.prefix_values(micro.inputs["target_tokens"])
            groups, length = prefix_targets_P_L_G_X.shape[:2]
            trained_P_L = None
            if trained_B_T is not None:
                trained_P_L = micro.prefix_values(trained_B_T).reshape(groups, length, -1).any(dim=-1)
            logprobs, entropy_P_L = target_logprobs(
                prefix_P_L_F,
                output_layer,
                prefix_targets_P_L_G_X.reshape(groups, length, -1),
                vocab_size=self.info.vocab_size,
                kept_positions=kept_positions,
                with_entropy=with_entropy,
                trained_B_T=trained_P_L,
            )
        return PrefixStage.of(
            logprobs.reshape(prefix_targets_P_L_G_X.shape), keys_values, entropy_P_L, in_parts
        )

    def suffix_part(
        self,
        adapter: str | None,
        head: ValueHead | None,
        stage: PrefixStage,
        micro: SharedPrefixMicroBatch,
        members: list[int],
        kept_positions: int,
        trained_B_T: Tensor | None,
    ) -> tuple[Tensor, Tensor | None]:
        """The (R, T) logprobs (and detached entropy when the stage has it) or values of `micro`'s datums,
        the members `members` of the stage's groups, their suffixes run against the stage's keys and
        values; the first `kept_positions` suffix positions keep their log-softmax for backward, and
        those `trained_B_T` (None: all) marks have autograd."""
        with self.using(adapter):
            forward, output_layer = self._forward_and_head(head)
            suffix_R_S_F = suffix_pass(forward, micro, stage.read_keys_values)
            if head is not None:
                return micro.per_datum(stage.read_outputs, head(suffix_R_S_F), per_member=False), None
            with_entropy = stage.entropy_P_L is not None
            suffix_logprobs_R_S_X, suffix_entropy_R_S = target_logprobs(
                suffix_R_S_F,
                output_layer,
                micro.suffix_values(micro.inputs["target_tokens"]),
                vocab_size=self.info.vocab_size,
                kept_positions=kept_positions,
                with_entropy=with_entropy,
                trained_B_T=None if trained_B_T is None else micro.suffix_values(trained_B_T),
            )
        prefix_logprobs_P_L_G_X = stage.read_outputs[:, :, members]
        logprobs_R_T_X = micro.per_datum(prefix_logprobs_P_L_G_X, suffix_logprobs_R_S_X, per_member=True)
        if stage.entropy_P_L is None or suffix_entropy_R_S is None:
            return logprobs_R_T_X, None
        return logprobs_R_T_X, micro.per_datum(stage.entropy_P_L, suffix_entropy_R_S, per_member=False)

    def values(self, adapter: str, head: ValueHead, micro: MicroBatch) -> Tensor:
        """A critic's V for every position, (B, T): the decoder's last hidden state through the value head.
        The decoder alone runs (no output embedding): the critic needs hidden states, not logits."""
        if isinstance(micro, SharedPrefixMicroBatch):
            with self.activation_checkpointing(micro):
                stage = self.prefix_stage(adapter, head, micro, False, kept_positions=0, trained_B_T=None)
                values_B_T, _ = self.suffix_part(
                    adapter, head, stage, micro, [], kept_positions=0, trained_B_T=None
                )
                return values_B_T
        with self.using(adapter):
            return head(self.final_hidden_states(micro))


def computed_tokens(micro: MicroBatch) -> int:
    """The padded tokens a micro-batch's pass computes: its (B, T), or a shared-prefix pass's
    prefixes and suffixes."""
    if isinstance(micro, SharedPrefixMicroBatch):
        return micro.computed_tokens
    return micro.input_ids_B_T.numel()
