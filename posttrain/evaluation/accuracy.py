"""Held-out accuracy (pass@1) of a policy on a task's test split."""

from __future__ import annotations

import torch
from transformers import PreTrainedTokenizerBase

from posttrain.models.load import encode_chat
from posttrain.rollout.base import RolloutEngine, SamplingParams
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
    """One completion per example; returns ``pass@1`` (fraction verified), length and truncation.

    With ``temperature=0`` (the default) decoding is greedy, so pass@1 is deterministic.
    """
    correct = 0.0
    lengths, truncated = 0, 0
    gen = torch.Generator().manual_seed(seed)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, n=1)
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        prompts = [encode_chat(tokenizer, ex.prompt, system_prompt) for ex in batch]
        comps = engine.generate(prompts, sampling, generator=gen)
        correct += sum(task.verify(text, ex) for text, ex in zip(comps.texts, batch, strict=True))
        lengths += int(comps.lengths.sum())
        truncated += int((~comps.finished).sum())
    n = max(1, len(examples))
    return {"pass@1": correct / n, "length_mean": lengths / n, "truncation_rate": truncated / n}
