"""The rollout-engine interface shared by every engine (hf, vllm, ...).

The training loop only sees :class:`RolloutEngine`: ``generate(prompts, sampling)`` returns
:class:`Completions` with token ids and the sampled tokens' log-probabilities, and
``load_weights(state_dict)`` pushes new policy weights into the engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature=0`` is greedy decoding; ``top_k=0`` and ``top_p=1`` disable them."""

    max_new_tokens: int = 32
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = 1  # completions per prompt (the group size G)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1; got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0; got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1]; got {self.top_p}")
        if self.top_k < 0 or self.n < 1:
            raise ValueError(f"top_k must be >= 0 and n >= 1; got top_k={self.top_k}, n={self.n}")


@dataclass
class Completions:
    """Sampled completions, prompt-major: rows ``i*n .. i*n+n-1`` belong to prompt ``i``.

    ``token_ids``, ``mask`` and ``logprobs`` are ``[N, T]`` with N = P * n and T the longest
    completion; ``mask`` is 1 on generated tokens (the EOS token included) and 0 on padding.
    ``logprobs`` are log pi(token) under the sampling temperature (logits / temperature) before
    top-k / top-p truncation, which is what the trainer recomputes.
    """

    prompt_ids: list[list[int]]
    token_ids: Tensor
    mask: Tensor
    logprobs: Tensor
    finished: Tensor  # [N] bool: ended with EOS (else truncated at max_new_tokens)
    texts: list[str]
    n: int

    @property
    def lengths(self) -> Tensor:
        """Response lengths in tokens, ``[N]``."""
        return self.mask.sum(dim=1).long()

    @property
    def num_tokens(self) -> int:
        """Total generated tokens."""
        return int(self.mask.sum().item())


class RolloutEngine(Protocol):
    """What the loop needs from an engine."""

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams, *, generator: torch.Generator | None = None
    ) -> Completions:
        """Sample ``sampling.n`` completions for each tokenized prompt."""
        ...

    def load_weights(self, state_dict: Mapping[str, Tensor]) -> None:
        """Copy policy weights into the engine."""
        ...
