"""Token sampling from logits: temperature, top-k, top-p, greedy, banned tokens.

The draw is an exact inverse-CDF draw (:func:`categorical`) that needs two uniforms per row.
``torch.multinomial`` over a 49,152-token vocabulary cost ~65 ms for 64 rows on 2 CPU cores, and
Gumbel-max needs one exponential per vocabulary entry (~57 ms for the RNG alone); the two-level
inverse CDF costs a few passes over the logits (a few ms).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

CHUNK = 256  # the first level draws a chunk of this many tokens by its mass, the second a token in it


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


def categorical(weights_BV: Tensor, generator: torch.Generator | None) -> Tensor:
    """Draw one index per row with ``P(i) = w_i / sum_j w_j``; returns ``[B]`` (long).

    ``weights_BV`` are finite, >= 0, with a positive sum per row (unnormalized probabilities; a zero
    weight is never drawn). Two-level inverse CDF with uniforms ``u1, u2`` in [0, 1):
    chunk ``c`` (``CHUNK`` tokens) is the first with ``cumsum(mass)_c > u1 * sum(mass)``, then token
    ``j`` of it the first with ``cumsum(w_chunk)_j > u2 * sum(w_chunk)``. The cumulative sums are in
    float64 over at most ``V / CHUNK`` and ``CHUNK`` terms, so the drawn distribution is the
    weights' own up to float64 rounding (a single float32 cumsum over 49k terms would skew rare
    tokens by its accumulated rounding).
    """
    b, v = weights_BV.shape
    n_chunks = -(-v // CHUNK)
    w = F.pad(weights_BV, (0, n_chunks * CHUNK - v)) if n_chunks * CHUNK != v else weights_BV
    w = w.reshape(b, n_chunks, CHUNK)
    cdf = w.sum(-1).double().cumsum(-1)  # [B, n_chunks]
    total = cdf[:, -1:]
    if not bool(((total > 0) & total.isfinite()).all()):
        raise ValueError("sampling weights must be finite and >= 0 with a positive sum per row (NaN/inf logits?)")
    u = torch.rand(b, 2, dtype=torch.float64, generator=generator, device=w.device)
    # u < 1 gives u * total < total in float64, so the index stays in range; clamp only guards it
    chunk = torch.searchsorted(cdf, u[:, :1] * total, right=True).clamp(max=n_chunks - 1)[:, 0]
    inner = w[torch.arange(b, device=w.device), chunk].double().cumsum(-1)  # [B, CHUNK]
    j = torch.searchsorted(inner, u[:, 1:] * inner[:, -1:], right=True).clamp(max=CHUNK - 1)[:, 0]
    return chunk * CHUNK + j


def sample_next(
    logits_BV: Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None,
    banned: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Sample one token per row from ``softmax(logits / temperature)`` restricted to the top-k /
    top-p set and without the ``banned`` token ids (EOS before ``min_new_tokens``); greedy when
    ``temperature == 0``.

    Returns (tokens ``[B]``, log-probs ``[B]``): the log-probs are the policy's own,
    ``log_softmax(logits / temperature)[token]`` (``logits`` at temperature 0), before banning
    and filtering.
    """
    logits_BV = logits_BV.float()
    scaled = logits_BV / temperature if temperature not in (0.0, 1.0) else logits_BV
    if temperature == 0.0 or top_k > 0 or top_p < 1.0:
        lse = scaled.logsumexp(-1)
        pick = scaled if banned is None else scaled.index_fill(-1, banned, float("-inf"))
        if temperature == 0.0:
            tokens = pick.argmax(-1)
        else:
            pick = filter_logits(pick, top_k, top_p)
            tokens = categorical((pick - pick.amax(-1, keepdim=True)).exp_(), generator)
    else:  # one exp pass serves the log-prob normalizer and the draw
        top = scaled.amax(-1, keepdim=True)
        weights = (scaled - top).exp_()
        lse = weights.sum(-1).log_() + top[:, 0]
        if banned is not None:
            weights.index_fill_(-1, banned, 0.0)
        tokens = categorical(weights, generator)
    return tokens, scaled.gather(-1, tokens[:, None])[:, 0] - lse
