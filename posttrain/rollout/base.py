"""The rollout-engine interface shared by every engine (hf, vllm, ...).

The training loop only sees :class:`RolloutEngine`: ``generate(prompts, sampling, seed)`` returns
a :class:`~posttrain.rollout.batch.Rollout` (token ids, masks, the sampler's log-probabilities and
the policy version that sampled it), and ``sync(weights, version)`` hands the engine the
learner's weights after every optimizer step. ``make_engine`` (``posttrain.rollout``) builds one
from ``rollout.engine``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from torch import Tensor

from posttrain.rollout.batch import Rollout


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature=0`` is greedy decoding; ``top_k=0`` and ``top_p=1`` disable them."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1  # completions per prompt (the group size G)
    min_new_tokens: int = 0  # EOS cannot be sampled before this many tokens (vLLM's min_tokens)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0 or self.n < 1:
            raise ValueError(f"top_k must be >= 0 and n >= 1; got top_k={self.top_k}, n={self.n}")


class RolloutEngine(Protocol):
    """What every caller needs from an engine (train, sft, dpo, eval, demo)."""

    pad_id: int
    version: int  # the policy version of the weights it samples with (the learner's optimizer steps)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams, seed: int | None = None) -> Rollout:
        """Sample ``sampling.n`` completions for each tokenized prompt; ``seed`` fixes the draw."""
        ...

    def sync(self, weights: Mapping[str, Tensor], version: int) -> None:
        """Take the learner's weights (a state dict) as policy ``version``."""
        ...
