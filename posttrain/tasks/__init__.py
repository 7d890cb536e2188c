"""Built-in verifiable tasks (pure Python): each generates examples, extracts and scores answers.

``make_task("arithmetic", digits=2, ops="+*")`` builds a task by name; :class:`Task` is the contract
the trainer relies on.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from posttrain.tasks.arithmetic import ArithmeticTask
from posttrain.tasks.base import Example, Split, Task, split_of
from posttrain.tasks.countdown import CountdownTask
from posttrain.tasks.pycode import PyCodeTask
from posttrain.tasks.reasoning_gym import ReasoningGymTask
from posttrain.tasks.word_math import WordMathTask

TASKS: dict[str, type[Task]] = {
    ArithmeticTask.name: ArithmeticTask,
    CountdownTask.name: CountdownTask,
    PyCodeTask.name: PyCodeTask,
    ReasoningGymTask.name: ReasoningGymTask,  # reasoning-gym's datasets; their config keys pass through
    WordMathTask.name: WordMathTask,
}


def task_names() -> list[str]:
    """Return the sorted names of the built-in tasks."""
    return sorted(TASKS)


def make_task(name: str, **params: object) -> Task:
    """Build task ``name`` with constructor ``params``.

    Raises:
        ValueError: for an unknown task name (listing the valid ones) or a parameter the task's
            constructor does not accept (naming it and listing the accepted ones). A constructor that
            takes ``**params`` (``reasoning_gym``: the dataset's config) checks its parameters itself.

    """
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; valid tasks: {', '.join(task_names())}")
    factory: Callable[..., Task] = TASKS[name]
    signature = inspect.signature(factory).parameters
    accepted = list(signature)
    checks_itself = any(p.kind is p.VAR_KEYWORD for p in signature.values())
    for key in () if checks_itself else params:
        if key not in accepted:
            raise ValueError(
                f"unknown parameter {key!r} for task {name!r}; accepted parameters: {', '.join(accepted)}"
            )
    return factory(**params)


__all__ = [
    "TASKS",
    "ArithmeticTask",
    "CountdownTask",
    "PyCodeTask",
    "ReasoningGymTask",
    "WordMathTask",
    "Example",
    "Split",
    "Task",
    "make_task",
    "split_of",
    "task_names",
]
