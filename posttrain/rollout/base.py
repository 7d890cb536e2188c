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

    def select_groups(self, groups: list[int]) -> Completions:
        """The completions of the given prompt indices, in that order."""
        rows = [g * self.n + j for g in groups for j in range(self.n)]
        idx = torch.tensor(rows, dtype=torch.long)
        return Completions(
            prompt_ids=[self.prompt_ids[g] for g in groups],
            token_ids=self.token_ids[idx],
            mask=self.mask[idx],
            logprobs=self.logprobs[idx],
            finished=self.finished[idx],
            texts=[self.texts[i] for i in rows],
            n=self.n,
        )


def concat_completions(parts: list[Completions], pad_id: int) -> Completions:
    """Concatenate completions of several generation batches (same ``n``), right-padding to one T."""
    if len(parts) == 1:
        return parts[0]
    width = max(c.token_ids.shape[1] for c in parts)

    def pad(x: Tensor, value: float) -> Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    return Completions(
        prompt_ids=[p for c in parts for p in c.prompt_ids],
        token_ids=torch.cat([pad(c.token_ids, pad_id) for c in parts]),
        mask=torch.cat([pad(c.mask, 0.0) for c in parts]),
        logprobs=torch.cat([pad(c.logprobs, 0.0) for c in parts]),
        finished=torch.cat([c.finished for c in parts]),
        texts=[t for c in parts for t in c.texts],
        n=parts[0].n,
    )


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
