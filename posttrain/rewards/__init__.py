"""Reward functions ``(prompt, completion, **fields) -> float | None`` and safe scoring.

``None`` means "could not score". :func:`score_batch` never lets a reward function break the
run: an exception or a non-finite value is scored ``None`` and counted, and the run goes on.
The fields given to every function are the example's fields plus ``answer``, ``example`` (the
:class:`~posttrain.tasks.base.Example`) and ``task``; a function takes what it needs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from posttrain.rewards.registry import REGISTRY, RewardFn, register, reward_names
from posttrain.tasks.base import Example, Task

__all__ = ["REGISTRY", "RewardFn", "ScoreReport", "register", "reward_names", "score_batch"]


@register("task")
def task_reward(prompt: str, completion: str, *, task: Task, example: Example, **_: object) -> float:
    """The built-in task's verifier: 1.0 if the completion solves the example, else 0.0."""
    return float(task.verify(completion, example))


@dataclass
class ScoreReport:
    """Per-component outcome of scoring one batch."""

    values: list[list[float | None]]  # [K][N]
    errors: list[int]  # per component: calls that raised or returned a non-number
    nonfinite: list[int]  # per component: NaN / inf results
    samples: list[str] = field(default_factory=list)  # a few error messages, for the log


def score_batch(
    fns: list[tuple[str, RewardFn, Mapping[str, object]]],
    prompts: list[str],
    completions: list[str],
    fields: list[Mapping[str, object]],
) -> ScoreReport:
    """Score every completion with every component ``(name, fn, params)``; failures become ``None``."""
    values: list[list[float | None]] = []
    errors, nonfinite, samples = [], [], []
    for name, fn, params in fns:
        col: list[float | None] = []
        n_err = n_nan = 0
        for prompt, completion, f in zip(prompts, completions, fields, strict=True):
            try:
                v = fn(prompt, completion, **params, **f)
            except Exception as e:  # noqa: BLE001 - any failure of user code is scored None
                n_err += 1
                if len(samples) < 3:
                    samples.append(
                        f"reward {name!r} raised {type(e).__name__}: {e} (completion {completion!r:.80})"
                    )
                col.append(None)
                continue
            if v is None:
                col.append(None)
            elif not isinstance(v, int | float):
                n_err += 1
                if len(samples) < 3:
                    samples.append(f"reward {name!r} returned {type(v).__name__}, not a number")
                col.append(None)
            elif not math.isfinite(float(v)):
                n_nan += 1
                col.append(None)
            else:
                col.append(float(v))
        values.append(col)
        errors.append(n_err)
        nonfinite.append(n_nan)
    return ScoreReport(values, errors, nonfinite, samples)
