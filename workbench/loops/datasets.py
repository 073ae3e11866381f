"""Small built-in datasets for the demo and the tutorials: they ship with the package, nothing downloads.

- `pirate_sft`: 32 questions answered in one recognisable style ("Arr, ..., matey!"), so a few steps of
  supervised fine-tuning visibly change how a model answers questions it was not trained on.
- `addition_problems`: "What is a + b?" with the exact answer, for RL with a verifiable reward.
- `colours_quiz_file`: 16 "What colour is ...?" questions with four choices (the answer's index and its
  word as `target`), a JSONL file an evaluation harness reads by path (lm-evaluation-harness's `json`
  datasets: tutorial 12).
"""

from __future__ import annotations

import importlib.resources
import json
import random
from dataclasses import dataclass
from pathlib import Path

_ASSETS = importlib.resources.files("workbench").joinpath("assets")


@dataclass(frozen=True)
class QA:
    question: str
    answer: str

    def messages(self) -> list[dict[str, str]]:
        """As a chat: the user's question, then the assistant's answer."""
        return [{"role": "user", "content": self.question}, {"role": "assistant", "content": self.answer}]


def pirate_sft() -> list[QA]:
    lines = (_ASSETS / "pirate_sft.jsonl").read_text(encoding="utf-8").splitlines()
    return [QA(**json.loads(line)) for line in lines if line.strip()]


def addition_problems(count: int, *, seed: int = 0, largest: int = 9) -> list[QA]:
    """`count` problems a + b with 0 <= a, b <= largest; the answer is the sum's digits only."""
    rng = random.Random(seed)
    problems = []
    for _ in range(count):
        a, b = rng.randint(0, largest), rng.randint(0, largest)
        problems.append(QA(question=f"What is {a} + {b}? Reply with the number only.", answer=str(a + b)))
    return problems


def colours_quiz_file() -> Path:
    """The colours quiz's JSONL file: one `{"question", "choices", "answer", "target"}` object a line."""
    return Path(str(_ASSETS / "colours_quiz.jsonl"))
