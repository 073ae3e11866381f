"""workbench/engine/samplers/sample_request.py: a sample request is checked as it is built, of everything
that needs no model, and holds its fields in one form; what needs the model is checked by
`requests.prepare_request` (tests/engine/samplers/test_sampling*.py run both through the engines)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tinker
import torch

import workbench as wb
from workbench.engine.samplers.sample_request import SampleRequest

PROMPT = [5, 17, 42, 99]
PARAMS = wb.SamplingParams(max_tokens=2)

BAD = [
    ({"prompt": []}, "prompt is empty"),
    ({"prompt": None}, "prompt: model_input must be"),
    ({"sampling_params": 5}, "sampling_params"),
    ({"num_samples": 2.0}, "num_samples must be an integer"),
    ({"include_prompt_logprobs": "yes"}, "include_prompt_logprobs must be True or False"),
    ({"record_stability_info": 1}, "record_stability_info must be True or False"),
    ({"prompt_logprobs_last_n": 2}, "prompt_logprobs_last_n needs include_prompt_logprobs=True"),
    (
        {"include_prompt_logprobs": True, "prompt_logprobs_last_n": 4},
        r"prompt_logprobs_last_n must be an integer in \[1, 3\]",
    ),
    ({"topk_sample_logprobs": True}, "topk_sample_logprobs must be an integer"),
    ({"prompt_alt_tokens_k": 2.5}, "prompt_alt_tokens_k must be an integer"),
    ({"prompt": [5], "topk_prompt_logprobs": 3}, "the prompt needs at least 2 tokens"),
    ({"target_prompt_logprobs": torch.zeros(2, 1, dtype=torch.long)}, r"= \[3, K\]"),
    ({"target_prompt_logprobs": torch.zeros(3, 1)}, "integer token ids"),
    ({"target_prompt_logprobs": torch.full((3, 2), -1)}, "names no token id"),
    ({"sequence_ids": ["a"]}, "sequence_ids must be 2 distinct non-empty strings"),
    ({"sequence_ids": ["a", "a"]}, "sequence_ids must be 2 distinct non-empty strings"),
    ({"sequence_ids": ["a", ""]}, "sequence_ids must be 2 distinct non-empty strings"),
]


@pytest.mark.parametrize(("fields", "message"), BAD, ids=[m for _, m in BAD])
def test_a_bad_field_is_refused_as_the_request_is_built(fields: dict, message: str) -> None:
    arguments = {"prompt": PROMPT, "num_samples": 2, "sampling_params": PARAMS} | fields
    with pytest.raises(ValueError, match=message):
        SampleRequest(**arguments)


def test_ours_and_the_sdks_objects_are_held_in_one_form() -> None:
    sdk_targets = tinker.TensorData(
        data=[7, 9], dtype="int64", shape=[3, 2], sparse_crow_indices=[0, 1, 1, 2], sparse_col_indices=[1, 0]
    )
    from_sdk = SampleRequest(
        tinker.ModelInput.from_ints(PROMPT),
        2,
        tinker.SamplingParams(max_tokens=2),
        target_prompt_logprobs=sdk_targets,
        sequence_ids=["a", "b"],
    )
    ours = SampleRequest(
        wb.ModelInput.from_ints(PROMPT),
        2,
        {"max_tokens": 2},
        target_prompt_logprobs=[[-1, 7], [-1, -1], [9, -1]],
        sequence_ids=("a", "b"),
    )
    for request in (from_sdk, ours):
        assert request.prompt == wb.ModelInput.from_ints(PROMPT)
        assert request.sampling_params == PARAMS
        assert request.sequence_ids == ("a", "b")
        assert request.target_prompt_logprobs.dtype == np.int64
        assert request.target_prompt_logprobs.tolist() == [[-1, 7], [-1, -1], [9, -1]]
        assert request.scores_prompt


def test_a_built_request_changes_with_nothing_its_caller_does_after() -> None:
    targets = torch.tensor([[3], [-1], [4]])
    request = SampleRequest(PROMPT, 1, PARAMS, target_prompt_logprobs=targets)
    targets[0, 0] = 8
    assert request.target_prompt_logprobs.tolist() == [[3], [-1], [4]]
    with pytest.raises(ValueError, match="read-only"):
        request.target_prompt_logprobs[0, 0] = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.num_samples = 3  # type: ignore[misc]


def test_the_bounds_the_model_sets_are_left_to_the_engine() -> None:
    """Widths, counts and ids the vocabulary or the engine bound: `prepare_request` checks them."""
    request = SampleRequest(PROMPT, 10**6, PARAMS, topk_sample_logprobs=10**9)
    assert (request.num_samples, request.topk_sample_logprobs) == (10**6, 10**9)
    assert not request.scores_prompt
