"""Held-out accuracy (pass@1) of a policy on a task's test split: one completion per example."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from posttrain.evaluation.sampled import evaluate_samples
from posttrain.rollout.base import RolloutEngine
from posttrain.tasks.base import Example, Task


def evaluate(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    *,
    max_new_tokens: int,
    temperature: float = 0.0,
    system_prompt: str | None = None,
    batch_size: int = 256,
    seed: int = 0,
) -> dict[str, float]:
    """One completion per example; returns ``pass@1`` (fraction verified), lengths, truncation.

    With ``temperature=0`` (the default) decoding is greedy, so pass@1 is deterministic. This is
    :func:`~posttrain.evaluation.sampled.evaluate_samples` with ``n = 1``.
    """
    return evaluate_samples(
        engine,
        tokenizer,
        task,
        examples,
        n=1,
        ks=(1,),
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        system_prompt=system_prompt,
        max_batch=batch_size,
        seed=seed,
    ).metrics
