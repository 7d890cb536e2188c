"""Partial credit for an answer: the share of its characters in the right place.

A dense verifier reward for tasks whose answers are digit strings (the built-in arithmetic task,
numeric datasets). A binary verifier gives a model that solves few prompts almost no signal: when
every sample of a group is wrong, all advantages are zero. Crediting each correct digit ranks wrong
answers by how close they are, so GRPO has something to compare from the first step.
"""

from __future__ import annotations

from typing import Literal

from posttrain.rewards.registry import register
from posttrain.tasks.base import Example, Task

__all__ = ["answer_match", "partial_answer"]

Align = Literal["auto", "left", "right"]


def answer_match(got: str, ref: str, *, align: Literal["left", "right"]) -> float:
    """Share of positions where ``got`` and ``ref`` agree, over the longer length (0 if both empty).

    ``align="right"`` compares from the last character (numbers written most-significant first, so
    the units line up); ``"left"`` from the first (numbers written least-significant first).
    ``answer_match("579", "589", align="right")`` = 2/3; an extra or missing digit costs its place:
    ``answer_match("5790", "579", align="left")`` = 3/4.
    """
    n = max(len(got), len(ref))
    if n == 0:
        return 0.0
    if align == "right":
        got, ref = got[::-1], ref[::-1]
    return sum(a == b for a, b in zip(got, ref, strict=False)) / n


@register("partial_answer")
def partial_answer(
    prompt: str,
    completion: str,
    *,
    task: Task,
    example: Example,
    weight: float = 0.5,
    align: Align = "auto",
    **_: object,
) -> float:
    """1.0 if the task's verifier accepts the completion, else ``weight * answer_match(answer, reference)``.

    r = 1                                  if verify(completion) = 1
    r = weight * matches / max(|a|, |ref|) otherwise (a = the task's extracted answer; 0 if none)

    so a wrong answer earns at most ``weight`` < 1 and never ties a correct one. ``align="auto"``
    asks the task: the arithmetic task with ``reverse=True`` writes answers least-significant digit
    first (aligned left); everything else is aligned right. Fields: ``task``, ``example`` (as for
    ``task``). Not from a paper: a posttrain reward for the low-accuracy start where a binary
    verifier leaves most groups without signal; its nearest neighbour is ``task`` (weight 0).
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"partial_answer: weight must be in [0, 1), got {weight}")
    if align not in ("auto", "left", "right"):
        raise ValueError(f"partial_answer: align must be 'auto', 'left' or 'right', got {align!r}")
    if task.verify(completion, example) >= 1.0:
        return 1.0
    got = task.extract(completion)
    if got is None:
        return 0.0
    side = ("left" if getattr(task, "reverse", False) else "right") if align == "auto" else align
    return weight * answer_match(got.strip(), example.answer.strip(), align=side)
