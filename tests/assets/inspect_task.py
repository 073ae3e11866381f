"""An inspect-ai task that tests/server/test_inspect_ai.py runs with the `inspect eval` command, as a user
would run their own task file: three questions, one greedy reply each (`generate()`), scored by
`includes()`."""

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.scorer import includes
from inspect_ai.solver import generate


@task
def colours() -> Task:
    return Task(
        dataset=[
            Sample(id=1, input="What colour is the sky on a clear day?", target="blue"),
            Sample(id=2, input="What colour is grass?", target="green"),
            Sample(id=3, input="What colour is snow?", target="white"),
        ],
        solver=generate(),
        scorer=includes(),
    )
