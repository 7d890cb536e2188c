"""Token sampling from logits: temperature, top-k, top-p, greedy."""

from __future__ import annotations

import torch
from torch import Tensor


def filter_logits(logits_BV: Tensor, top_k: int, top_p: float) -> Tensor:
    """Set logits outside the top-k / nucleus (top-p) set to -inf. Keeps at least one token."""
    if top_k > 0 and top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[:, -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits_BV, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the mass before it already reaches top_p (the first token always stays)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop, float("-inf"))
    return logits_BV


def sample_next(
    logits_BV: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> tuple[Tensor, Tensor]:
    """Sample one token per row. Returns (tokens ``[B]``, log-probs ``[B]`` under logits/temperature)."""
    logits_BV = logits_BV.float()
    if temperature == 0.0:
        tokens = logits_BV.argmax(-1)
        logp = logits_BV.log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
        return tokens, logp
    scaled = logits_BV / temperature
    logp_BV = scaled.log_softmax(-1)
    filtered = filter_logits(scaled, top_k, top_p)
    probs = filtered.softmax(-1) if (top_k > 0 or top_p < 1.0) else logp_BV.exp()
    tokens = torch.multinomial(probs, 1, generator=generator)[:, 0]
    return tokens, logp_BV.gather(-1, tokens[:, None])[:, 0]
