"""Policy entropy over response tokens: the mean and the mean of the high-entropy minority."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.algorithms.entropy import token_entropy
from posttrain.diagnostics._masked import masked_mean, to_floats


@torch.no_grad()
def token_entropies(logits_NTV: Tensor, *, chunk_tokens: int = 1024) -> Tensor:
    """Per-position entropy H_t = -sum_v p_v log p_v of softmax(logits), ``[N, T, V]`` -> ``[N, T]``.

    Float32, no gradient. Positions are processed ``chunk_tokens`` at a time, so the float32
    ``log_softmax`` copy is ``chunk_tokens x V`` (1024 x 152k = 0.6 GB) rather than ``N x T x V``.
    """
    n, t, v = logits_NTV.shape
    flat = logits_NTV.reshape(n * t, v)
    out = torch.empty(n * t, dtype=torch.float32, device=logits_NTV.device)
    for start in range(0, n * t, chunk_tokens):
        out[start : start + chunk_tokens] = token_entropy(flat[start : start + chunk_tokens])
    return out.reshape(n, t)


@torch.no_grad()
def entropy_stats(
    logits_NTV: Tensor, mask_NT: Tensor, *, top_q: float = 0.2, chunk_tokens: int = 1024
) -> dict[str, float]:
    """Mean token entropy and the mean over the top-q fraction of highest-entropy tokens.

    H_t as in :func:`token_entropies`. With M masked tokens:
    ``entropy_mean`` = (1/M) sum_t H_t;  ``entropy_top_mean`` = mean of the ceil(q M) largest H_t,
    the "forking tokens" of Wang et al., "Beyond the 80/20 Rule: High-Entropy Minority Tokens
    Drive Effective RL for LLM Reasoning" (arXiv:2506.01939, q = 0.2). Token-level (every token
    weighs the same, long responses weigh more). Shapes: logits ``[N, T, V]``, mask ``[N, T]``.
    NaN for an empty mask. A uniform policy over V tokens gives log V for both.
    """
    if not 0.0 < top_q <= 1.0:
        raise ValueError(f"top_q must lie in (0, 1]; got {top_q}")
    h_NT = token_entropies(logits_NTV, chunk_tokens=chunk_tokens)
    h_M = h_NT[mask_NT.to(torch.bool)]
    if h_M.numel() == 0:
        top = torch.tensor(float("nan"), device=h_NT.device)
    else:
        top = torch.topk(h_M, math.ceil(top_q * h_M.numel())).values.mean()
    return to_floats({"entropy_mean": masked_mean(h_NT, mask_NT), "entropy_top_mean": top})
