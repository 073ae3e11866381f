"""Tinker-shaped types and conversion from the SDK, dicts and lists."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import workbench as wb
from workbench.types import to_adam_params, to_datum, to_lora_config, to_model_input, to_sampling_params


def test_model_input_helpers() -> None:
    mi = wb.ModelInput.from_ints([1, 2, 3]).append_int(4).append(wb.EncodedTextChunk(tokens=[5, 6]))
    assert mi.to_ints() == [1, 2, 3, 4, 5, 6]
    assert mi.length == 6
    assert wb.ModelInput.empty().length == 0


def test_tensor_data_round_trips() -> None:
    td = wb.TensorData.from_torch(torch.tensor([1.5, -2.0]))
    assert td.dtype == "float32" and td.tolist() == [1.5, -2.0] and td.data == [1.5, -2.0] and td.shape == [2]
    assert torch.equal(td.to_torch(), torch.tensor([1.5, -2.0]))
    ints = wb.TensorData.from_numpy(np.array([3, 4]))
    assert ints.dtype == "int64" and ints.to_torch().dtype == torch.int64
    assert wb.TensorData([1, 2, 3, 4], "int64", shape=[2, 2]).tolist() == [[1, 2], [3, 4]]


def test_datum_coerces_inputs_by_key() -> None:
    d = wb.Datum(
        model_input=[1, 2, 3],
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": np.ones(3), "advantages": torch.zeros(3)},
    )
    assert d.model_input.to_ints() == [1, 2, 3]
    assert d.loss_fn_inputs["target_tokens"].dtype == "int64"
    assert d.loss_fn_inputs["weights"].dtype == "float32"
    assert d.loss_fn_inputs["advantages"].dtype == "float32"
    assert to_datum({"model_input": [1], "loss_fn_inputs": {"target_tokens": [2]}}).model_input.to_ints() == [
        1
    ]
    with pytest.raises(ValueError, match="a datum dict has keys"):
        to_datum({"tokens": [1]})


def test_sdk_objects_convert() -> None:
    tinker = pytest.importorskip("tinker")
    mi = tinker.ModelInput.from_ints([1, 2])
    assert to_model_input(mi).to_ints() == [1, 2]
    sd = tinker.Datum(model_input=mi, loss_fn_inputs={"target_tokens": [2, 3], "weights": [0.0, 1.0]})
    ours = to_datum(sd)
    assert ours.loss_fn_inputs["weights"].tolist() == [0.0, 1.0]
    assert to_adam_params(tinker.AdamParams(learning_rate=3e-4, grad_clip_norm=1.0)) == wb.AdamParams(
        learning_rate=3e-4, grad_clip_norm=1.0
    )
    sp = to_sampling_params(tinker.SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"]))
    assert sp.max_tokens == 5 and sp.temperature == 0.0 and sp.stop == ("\n",)
    assert to_lora_config(tinker.LoraConfig(rank=8, train_unembed=False)) == wb.LoraConfig(
        rank=8, train_unembed=False
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"stop": ["a", 3]}, "not a mix"),
        ({"stop": [""]}, "must not be empty"),
    ],
)
def test_sampling_params_validate(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wb.SamplingParams(**kwargs)


def test_sampling_params_normalise_stop() -> None:
    assert wb.SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert wb.SamplingParams(stop=[]).stop == ()
    assert wb.SamplingParams().stop is None


def test_lora_config_validates() -> None:
    with pytest.raises(ValueError, match="rank"):
        wb.LoraConfig(rank=0)
    with pytest.raises(ValueError, match="trains nothing"):
        wb.LoraConfig(train_attn=False, train_mlp=False, train_unembed=False)
    with pytest.raises(ValueError, match="unknown LoraConfig"):
        to_lora_config({"rank": 4, "dropout": 0.1})
