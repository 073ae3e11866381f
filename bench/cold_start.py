"""Cold start: what a notebook pays before its first step, workbench against plain torch/transformers/peft.

Each figure is the median of `--repeats` fresh Python processes (the model already prepared in the
cache, W&B at the session's default: offline without credentials):
  import: `import workbench`, against the floor `import torch` (what any torch library costs at least);
  first step: `import workbench` + `Session(model)` + one `forward_backward(cross_entropy)` on a
      128-token datum, against the floor of the same work by hand: import torch, transformers and peft,
      load the tokenizer and the model, wrap it with the same rank-32 LoRA (every linear layer), one
      forward + backward.
Targets: `import workbench` <= 1.5 s; the first step <= 8 s. All of it is measured twice, on a quiet
machine and with a second process keeping one core busy (`bench/contention.py`: what a notebook always
has beside the engine), with the first step's time contended / quiet.

    python bench/cold_start.py
    python bench/cold_start.py --model tiny --repeats 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from contention import MODES, quiet_and_contended  # bench/contention.py, beside this script

KINDS = ("floor-import", "import", "floor-step", "step")


def child(kind: str, model: str) -> dict[str, float]:
    """One measurement, in this fresh process: seconds per phase."""
    start = time.perf_counter()
    phases: dict[str, float] = {}

    def mark(name: str) -> None:
        phases[name] = time.perf_counter() - start - sum(phases.values())

    if kind == "floor-import":
        import torch

        mark("import")
    elif kind == "import":
        import workbench  # noqa: F401

        mark("import")
    elif kind == "floor-step":
        import peft
        import torch
        import torch.nn.functional as F
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from workbench.engine.model.base_model import (
            classify_linear_layers,
            lora_target_modules,
            resolve_model_path,
        )
        from workbench.types import LoraConfig

        mark("import")
        path = resolve_model_path(model)
        AutoTokenizer.from_pretrained(path)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        modules = lora_target_modules(classify_linear_layers(base), LoraConfig())
        lora = peft.LoraConfig(r=32, lora_alpha=32, target_modules=modules, task_type="CAUSAL_LM")
        policy = peft.get_peft_model(base, lora)
        policy.eval()
        mark("load")
        tokens = torch.arange(10, 139)[None]
        logits = policy(input_ids=tokens[:, :-1], use_cache=False).logits
        F.cross_entropy(logits[0].float(), tokens[0, 1:], reduction="sum").backward()
        mark("forward_backward")
    else:
        import workbench as wb

        mark("import")
        session = wb.Session(model, model_dir=tempfile.mkdtemp(prefix="workbench-cold-start-"))
        mark("load")
        tokens = list(range(10, 139))
        datum = wb.Datum(model_input=tokens[:-1], loss_fn_inputs={"target_tokens": tokens[1:]})
        session.policy.forward_backward([datum], "cross_entropy").result()
        mark("forward_backward")
    phases["total"] = time.perf_counter() - start
    return phases


def run_child(kind: str, model: str) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, __file__, "--model", model, "--child", kind],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    if out.returncode != 0:
        sys.exit(f"{kind} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--child", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.model)))
        return

    def measure() -> dict[str, list[dict[str, float]]]:
        """The phases' seconds of each fresh process, by kind."""
        runs: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
        for _ in range(args.repeats):  # interleaved, so that a busy spell hits every kind alike
            for kind in KINDS:
                runs[kind].append(run_child(kind, args.model))
        return runs

    both = quiet_and_contended(measure)

    def median(runs: dict[str, list[dict[str, float]]], kind: str, phase: str) -> float:
        return statistics.median(run[phase] for run in runs[kind])

    print(f"model={args.model}, median of {args.repeats} fresh processes, seconds")
    for mode, runs in zip(MODES, (both.quiet, both.contended), strict=True):
        print(f"{mode + ':':34s} {'floor':>7s} {'workbench':>10s} {'ratio':>6s}  target")
        floor, ours = median(runs, "floor-import", "total"), median(runs, "import", "total")
        print(f"{'import (floor: import torch)':34s} {floor:7.2f} {ours:10.2f} {ours / floor:6.2f}  <= 1.5 s")
        floor, ours = median(runs, "floor-step", "total"), median(runs, "step", "total")
        print(
            f"{'import + load + forward_backward':34s} {floor:7.2f} {ours:10.2f} {ours / floor:6.2f}  <= 8 s"
        )
        for phase in ("import", "load", "forward_backward"):
            print(
                f"{'  ' + phase:34s} {median(runs, 'floor-step', phase):7.2f} {median(runs, 'step', phase):10.2f}"
            )
    print(both.describe())
    print(
        "import + load + forward_backward time contended / quiet: workbench "
        f"{median(both.contended, 'step', 'total') / median(both.quiet, 'step', 'total'):.2f}x, floor "
        f"{median(both.contended, 'floor-step', 'total') / median(both.quiet, 'floor-step', 'total'):.2f}x"
    )


if __name__ == "__main__":
    main()
