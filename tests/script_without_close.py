"""A script that ends without `close()` while its session is busy: a run training (its step function
also runs torch on the run's thread), operations queued on the worker, a panel polling, W&B offline.

Run by tests/test_clean_exit.py in fresh processes: the process must exit with status 0 every time.
"""

import time

import tinker
import torch

import workbench as wb

sess = wb.Session(base_model="tiny", lora=wb.LoraConfig(rank=8), seed=0, wandb=True)
tokens = [5, 17, 42, 8, 99, 23, 61] * 8
data = [
    tinker.Datum(
        model_input=tinker.ModelInput.from_ints(tokens),
        loss_fn_inputs={"target_tokens": [*tokens[1:], 4], "weights": [1.0] * len(tokens)},
    )
] * 4


def step(sess: wb.Session, i: int) -> dict[str, float]:
    sess.policy.forward_backward(data, "cross_entropy").result()
    sess.policy.optim_step(tinker.AdamParams(learning_rate=1e-2)).result()
    return {"noise:norm": float(torch.linalg.norm(torch.randn(256, 256) @ torch.randn(256, 256)))}


run = sess.run(step, steps=10_000)
time.sleep(0.5)
run.pause()
run.wait()
run.step()
run.wait()
run.resume()
sess.panel()
sess.plot("loss:sum")
queued = [sess.policy.forward_backward(data, "cross_entropy") for _ in range(3)]
print("script ended", flush=True)
