"""Peak memory of a critic that shares the policy's base, against the policy alone.

Each configuration runs in a fresh process: load the model, one forward_backward + optim_step on the
policy (and on the critic when there is one), then report the process's peak resident memory (and the
peak CUDA memory on a GPU). For contrast, the third configuration builds the critic the way a
second-model design does: a second full copy of the base model.
Target: policy + critic <= 1.15 x policy alone.
Not measured contended (as the timing benchmarks are): a busy core changes time, not peak memory.

    python bench/critic_memory.py --model smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

CONFIGS = ("policy", "policy+critic", "policy+second-model")


def measure(model: str, config: str) -> dict[str, float]:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    import workbench as wb

    tokens = list(range(10, 138))
    policy_data = [wb.Datum(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]})] * 8
    critic_data = [
        wb.Datum(model_input=tokens[:-1], loss_fn_inputs={"values": [0.0] * 127, "returns": [1.0] * 127})
    ] * 8
    sessions = [wb.Session(model, wb.LoraConfig(rank=16), critic=config == "policy+critic", wandb=False)]
    if config == "policy+second-model":
        sessions.append(wb.Session(model, wb.LoraConfig(rank=16), wandb=False))
    sess = sessions[0]
    sess.policy.forward_backward(policy_data, "cross_entropy").result()
    sess.policy.optim_step().result()
    if sess.critic is not None:
        sess.critic.forward_backward(critic_data, "ppo_critic").result()
        sess.critic.optim_step().result()
    if config == "policy+second-model":
        sessions[1].policy.forward_backward(policy_data, "cross_entropy").result()
        sessions[1].policy.optim_step().result()
    result = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        result["peak_cuda_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument(
        "--config", choices=CONFIGS, help=argparse.SUPPRESS
    )  # one measurement, in a child process
    args = parser.parse_args()
    if args.config:
        print(json.dumps(measure(args.model, args.config)))
        return
    results = {}
    for config in CONFIGS:
        out = subprocess.run(
            [sys.executable, __file__, "--model", args.model, "--config", config],
            capture_output=True,
            text=True,
            check=True,
        )
        results[config] = json.loads(out.stdout.strip().splitlines()[-1])
    base = results["policy"]
    print(f"model={args.model} rank=16, one training step each, peak memory per fresh process")
    for key in base:
        print(f"{'configuration':22s} {key:>14s} {'x policy':>9s}")
        for config in CONFIGS:
            value = results[config][key]
            print(f"{config:22s} {value:14.1f} {value / base[key]:9.3f}")
    ratio = results["policy+critic"]["peak_rss_mb"] / base["peak_rss_mb"]
    print(f"policy+critic / policy = {ratio:.3f} (target <= 1.15)")


if __name__ == "__main__":
    main()
