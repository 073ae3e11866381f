"""Tinker-shaped types and conversion from the SDK, dicts and lists."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

import workbench as wb
from workbench.sdk_conversion import (
    from_sdk_forward_backward_output,
    from_sdk_sampled_sequence,
    to_adam_params,
    to_datum,
    to_lora_config,
    to_model_input,
    to_sampling_params,
    to_sdk_adam_params,
    to_sdk_datum,
    to_sdk_sampling_params,
)


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


def test_ours_convert_to_the_sdks_and_back() -> None:
    """What the remote engine sends through the SDK reads back as what it was built from."""
    tinker = pytest.importorskip("tinker")
    datum = wb.Datum(
        model_input=[1, 2, 3],
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 0.5]},
        model_input_spans=(wb.PromptProvenanceSpan(sequence_id="s", length=3),),
        loss_fn_input_spans=(wb.SampledProvenanceSpan(sequence_id="s", offset=1, length=3),),
    )
    sent = to_sdk_datum(datum)
    assert isinstance(sent, tinker.Datum)
    assert isinstance(sent.model_input_spans[0], tinker.PromptProvenanceSpan)
    back = to_datum(sent)
    assert back.model_input == datum.model_input and back.loss_fn_inputs == datum.loss_fn_inputs
    assert (back.model_input_spans, back.loss_fn_input_spans) == (
        datum.model_input_spans,
        datum.loss_fn_input_spans,
    )
    params = wb.SamplingParams(max_tokens=5, temperature=0.5, top_k=3, stop=["\n"], seed=7)
    assert to_sampling_params(to_sdk_sampling_params(params)) == params
    adam = wb.AdamParams(learning_rate=3e-4, grad_clip_norm=1.0)
    assert to_adam_params(to_sdk_adam_params(adam)) == adam
    output = tinker.ForwardBackwardOutput(
        loss_fn_output_type="cross_entropy",
        loss_fn_outputs=[{"logprobs": tinker.TensorData(data=[-1.5, -0.25], dtype="float32", shape=[2])}],
        metrics={"loss:sum": 1.75},
    )
    ours = from_sdk_forward_backward_output(output)
    assert ours.loss_fn_outputs[0]["logprobs"].tolist() == [-1.5, -0.25] and ours.metrics == {
        "loss:sum": 1.75
    }
    sequence = tinker.SampledSequence(stop_reason="length", sequence_id="s1", tokens_np=np.array([4, 5]))
    assert from_sdk_sampled_sequence(sequence) == wb.SampledSequence(
        tokens=[4, 5], logprobs=[], stop_reason="length", sequence_id="s1"
    )


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


def test_sdk_fields_convert_where_a_datum_comes_in_and_the_data_class_refuses_them() -> None:
    """An SDK `Datum` (or a dict) with SDK fields converts at the edge (`to_datum`, which the engines and
    clients call); `wb.Datum` itself takes plain forms only and names the SDK object it was given."""
    tinker = pytest.importorskip("tinker")
    fields = {
        "model_input": tinker.ModelInput.from_ints([1, 2, 3]),
        "loss_fn_inputs": {
            "target_tokens": tinker.TensorData.from_numpy(np.array([2, 3, 4])),
            "weights": tinker.TensorData(data=[0.0, 1.0, 0.5], dtype="float32", shape=[3]),
        },
        "model_input_spans": [tinker.PromptProvenanceSpan(sequence_id="s", length=3)],
        "loss_fn_input_spans": [tinker.SampledProvenanceSpan(sequence_id="s", offset=1, length=3)],
    }
    for given in (tinker.Datum(**fields), fields):
        datum = to_datum(given)
        assert datum.model_input == wb.ModelInput.from_ints([1, 2, 3])
        assert datum.loss_fn_inputs["target_tokens"] == wb.TensorData([2, 3, 4], "int64")
        assert datum.loss_fn_inputs["weights"] == wb.TensorData([0.0, 1.0, 0.5], "float32")
        assert datum.model_input_spans == (wb.PromptProvenanceSpan(sequence_id="s", length=3),)
        assert datum.loss_fn_input_spans == (wb.SampledProvenanceSpan(sequence_id="s", offset=1, length=3),)
    with pytest.raises(ValueError, match=r"target_tokens.*token ids must be integers"):
        to_datum(
            {
                "model_input": [1],
                "loss_fn_inputs": {"target_tokens": tinker.TensorData.from_numpy(np.array([0.5]))},
            }
        )
    with pytest.raises(ValueError, match=r"model_input: .* got tinker(\.\w+)*\.ModelInput"):
        wb.Datum(model_input=fields["model_input"])
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['weights'\] .* got tinker(\.\w+)*\.TensorData"):
        wb.Datum(model_input=[1, 2, 3], loss_fn_inputs={"weights": fields["loss_fn_inputs"]["weights"]})


def test_the_data_types_do_not_import_the_sdk_conversions() -> None:
    """The data classes sit below their conversions to and from the SDK: building one loads neither."""
    code = (
        "import sys, workbench.types as t; t.Datum(model_input=[1], loss_fn_inputs={'weights': [1.0]}); "
        "assert 'workbench.sdk_conversion' not in sys.modules and 'tinker' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


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
        ({"stop": 2}, "stop must be a string, a list of strings or a list of token ids"),
        ({"seed": 2**64}, "seed must be None or an integer that fits in 64 bits"),
        ({"seed": True}, "seed"),
        ({"temperature": 1e-40}, r"temperature must be 0 \(greedy\) or a finite number >= 1e-06"),
        ({"temperature": True}, "temperature"),
        ({"top_p": True}, "top_p"),
    ],
)
def test_sampling_params_validate(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wb.SamplingParams(**kwargs)


def test_sampling_params_normalise_stop() -> None:
    assert wb.SamplingParams(stop="\n\n").stop == ("\n\n",)
    assert wb.SamplingParams(stop=[]).stop == ()
    assert wb.SamplingParams().stop is None
    assert wb.SamplingParams(stop=np.array([3, 4])).stop == (3, 4)
    assert (
        wb.SamplingParams(seed=np.int64(7)).seed == 7
        and type(wb.SamplingParams(seed=np.int64(7)).seed) is int
    )


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ([True, 5], "got True at position 0"),
        ([5, 6.0], "got 6.0 at position 1"),
        (np.array([5.0, 6.0]), "got 5.0 at position 0"),
        (torch.tensor([5.0]), "got 5.0 at position 0"),
        ([[5, 6]], r"got \[5, 6\] at position 0"),
    ],
)
def test_token_ids_are_integers_only(value: object, message: str) -> None:
    """Bools and floats are not token ids, in a model input or in target_tokens (they used to be read as
    ids 1/0 and 6)."""
    with pytest.raises(ValueError, match=f"model_input: token ids must be .*{message}"):
        wb.Datum(model_input=value, loss_fn_inputs={})
    with pytest.raises(
        ValueError, match=rf"loss_fn_inputs\['target_tokens'\]: token ids must be .*{message}"
    ):
        wb.Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": value})


def test_target_token_arrays_must_hold_integers() -> None:
    for value in (np.array([True, False]), torch.tensor([6.0, 7.0]), wb.TensorData([6.0, 7.0], "float32")):
        with pytest.raises(
            ValueError, match=r"loss_fn_inputs\['target_tokens'\]: token ids must be integers"
        ):
            wb.Datum(model_input=[1, 2], loss_fn_inputs={"target_tokens": value})
    numpy_ints = wb.Datum(model_input=np.array([1, 2]), loss_fn_inputs={"target_tokens": [np.int64(2), 3]})
    assert numpy_ints.model_input.to_ints() == [1, 2]
    assert numpy_ints.loss_fn_inputs["target_tokens"].dtype == "int64"


@pytest.mark.parametrize(
    ("model_input", "message"),
    [
        ({"chunks": [{}]}, r"model_input: chunk 0 must be a dict with 'tokens'"),
        (
            {"chunks": [5]},
            r"model_input: chunk 0 must be a dict with 'tokens' \(a list of token ids\), got 5",
        ),
        ({"chunks": 5}, r"model_input: 'chunks' must be a list of chunks, got 5"),
        ({"chunks": [{"tokens": [1, 2.5]}]}, r"model_input: chunk 0: token ids must be integers, got 2.5"),
        (
            {"chunks": [{"tokens": 5}]},
            r"model_input: chunk 0: token ids must be a list of integers, got int 5",
        ),
    ],
)
def test_malformed_chunks_raise_value_errors(model_input: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        wb.Datum(model_input=model_input, loss_fn_inputs={})


def test_lora_config_validates() -> None:
    with pytest.raises(ValueError, match="rank"):
        wb.LoraConfig(rank=0)
    with pytest.raises(ValueError, match="trains nothing"):
        wb.LoraConfig(train_attn=False, train_mlp=False, train_unembed=False)
    with pytest.raises(ValueError, match="unknown LoraConfig"):
        to_lora_config({"rank": 4, "dropout": 0.1})
    for alpha in (float("inf"), float("nan"), True, 0.0):
        with pytest.raises(ValueError, match=r"LoraConfig\.alpha must be a finite number > 0"):
            wb.LoraConfig(alpha=alpha)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"learning_rate": 1e30}, r"learning_rate must be <= 1 \(an AdamW step"),
        ({"eps": 1e-46}, "eps must be at least 1.18e-38"),
        ({"learning_rate": 0.5, "weight_decay": 3.0}, "learning_rate × weight_decay must be <= 1"),
    ],
)
def test_adam_params_refuse_values_that_break_the_weights(kwargs: dict, message: str) -> None:
    """Each of these made an optimizer step turn the model's outputs (or its untouched weights) to NaN,
    and the step was reported as applied."""
    with pytest.raises(ValueError, match=message):
        wb.AdamParams(**kwargs)
