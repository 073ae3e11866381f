"""A `tinker` SDK client in its own process, for the server tests: trains, samples, saves and resumes a
model on the server at argv[1], and prints what it got as one JSON line.

It runs with whichever SDK is first on `PYTHONPATH` (0.38 from the venv, or 0.25 from its own folder),
so it keeps to the calls both versions have; `create_*` returns a client in 0.25 and a future of one
in 0.38, which `client()` resolves.
"""

from __future__ import annotations

import json
import os
import sys

import tinker
from tinker import types

TOKENS = [[5, 17, 33, 48, 60, 71, 2], [9, 21, 40, 11, 3]]


def client(value):
    return value if isinstance(value, (tinker.TrainingClient, tinker.SamplingClient)) else value.result()


def close(service: tinker.ServiceClient) -> None:
    """End the SDK's session before the process exits, so its heartbeat thread is not cut off mid-call
    by the interpreter's exit: 0.38 finishes the session with `close(status)`; 0.25 has no finish call
    and stops its heartbeat through its client holder's `close()`."""
    if tinker.__version__ == "0.25.0":
        service.holder.close()
    else:
        service.close("success").result()


def datum(tokens: list[int]) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n},
    )


def main(base_url: str) -> None:
    service = tinker.ServiceClient(base_url=base_url)
    try:
        model = client(service.create_lora_training_client(base_model="tiny", rank=4, seed=0))
        losses = []
        for _ in range(2):
            backward = model.forward_backward([datum(t) for t in TOKENS], "cross_entropy")
            step = model.optim_step(types.AdamParams(learning_rate=1e-2))
            losses.append(backward.result().metrics["loss:sum"])
            step.result()
        sampler = client(model.save_weights_and_get_sampling_client())
        params = types.SamplingParams(max_tokens=4, seed=5)
        sample = sampler.sample(types.ModelInput.from_ints(TOKENS[1]), 2, params).result()
        state = model.save_state("saved").result().path
        resumed = client(service.create_training_client_from_state(state))
        check = [datum(TOKENS[0])]
        result = json.dumps(
            {
                "sdk": tinker.__version__,
                "model_id": model.model_id,
                "losses": losses,
                "samples": [list(s.tokens) for s in sample.sequences],
                "state_path": state,
                "loss_after": model.forward(check, "cross_entropy").result().metrics["loss:sum"],
                "resumed_loss": resumed.forward(check, "cross_entropy").result().metrics["loss:sum"],
            }
        )
    finally:
        close(service)
    print(result, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    # The result is printed and flushed: the process ends here, without the interpreter's teardown of
    # native modules, in which SDK 0.25's process (torch and protobuf loaded) aborted about once in 15-20
    # runs on a busy machine (SIGABRT in the main thread with no Python frame, as faulthandler shows),
    # after a whole, correct result.
    os._exit(0)
