"""Token-level divergence between the current policy and the starting (base) model.

Paper: Meng et al., "Sparse but Critical: A Token-Level Analysis of Distributional Shifts in RLVR
Fine-Tuning of LLMs" (arXiv:2603.22446, ICLR 2026; seed papers/004_f298e9ec572f7f27.txt:191,
catalog L191). It compares the base and RL next-token distributions at each position of sampled
responses with the Jensen-Shannon divergence and finds the shift sparse: few positions diverge.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.diagnostics._masked import masked_mean, to_floats

_LOG2 = math.log(2.0)


def _xlogy_ratio(logp: Tensor, logq: Tensor) -> Tensor:
    # sum_v p_v (log p_v - log q_v), with p_v = 0 terms (log p = -inf) contributing 0
    finite = torch.isfinite(logp)
    diff = torch.where(finite, logp - logq, torch.zeros_like(logp))
    return (logp.exp() * diff).sum(dim=-1)


@torch.no_grad()
def token_divergence(
    logits_NTV: Tensor,
    base_logits_NTV: Tensor,
    *,
    kind: Literal["js", "kl"] = "js",
    chunk_tokens: int = 1024,
) -> Tensor:
    """Per-position divergence between softmax(logits) = pi and softmax(base_logits) = pi_0, ``[N, T]``.

    - ``"js"`` (the paper's measure): JS(pi, pi_0) = 1/2 KL(pi || M) + 1/2 KL(pi_0 || M),
      M = (pi + pi_0) / 2, in nats, so 0 <= JS <= log 2; symmetric and finite even where one
      model gives a token probability 0.
    - ``"kl"``: KL(pi || pi_0) = sum_v pi_v (log pi_v - log pi_0_v), full vocabulary (the exact
      value that the k1/k3 estimators of ``kl_to_reference`` approximate from one sample).

    Both logits tensors ``[N, T, V]`` over the same positions (the base model scored on the
    policy's samples). Float32, no gradient, ``chunk_tokens`` positions at a time.
    """
    if logits_NTV.shape != base_logits_NTV.shape:
        raise ValueError(f"logits {tuple(logits_NTV.shape)} and base {tuple(base_logits_NTV.shape)} differ")
    if kind not in ("js", "kl"):
        raise ValueError(f"kind must be 'js' or 'kl'; got {kind!r}")
    n, t, v = logits_NTV.shape
    flat, base_flat = logits_NTV.reshape(n * t, v), base_logits_NTV.reshape(n * t, v)
    out = torch.empty(n * t, dtype=torch.float32, device=logits_NTV.device)
    for start in range(0, n * t, chunk_tokens):
        sl = slice(start, start + chunk_tokens)
        logp = F.log_softmax(flat[sl].float(), dim=-1)
        logq = F.log_softmax(base_flat[sl].float(), dim=-1)
        if kind == "kl":
            out[sl] = _xlogy_ratio(logp, logq)
        else:
            logm = torch.logaddexp(logp, logq) - _LOG2
            out[sl] = 0.5 * (_xlogy_ratio(logp, logm) + _xlogy_ratio(logq, logm))
    return out.reshape(n, t).clamp(min=0.0)  # rounding can give -1e-9


@torch.no_grad()
def divergence_stats(
    logits_NTV: Tensor,
    base_logits_NTV: Tensor,
    mask_NT: Tensor,
    *,
    kind: Literal["js", "kl"] = "js",
    threshold: float = 0.1,
    chunk_tokens: int = 1024,
) -> dict[str, float]:
    """Summary of :func:`token_divergence` over response tokens.

    ``divergence_mean`` (token mean), ``divergence_max``, and ``divergence_frac_above``, the
    fraction of tokens with divergence > ``threshold``: the paper's sparsity measure (few
    positions carry the shift). threshold = 0.1 nats is our default (JS <= log 2 = 0.693), not
    a value taken from the paper. NaN for an empty mask.
    """
    d_NT = token_divergence(logits_NTV, base_logits_NTV, kind=kind, chunk_tokens=chunk_tokens)
    m = mask_NT.to(torch.bool)
    nan = torch.tensor(float("nan"), device=d_NT.device)
    return to_floats(
        {
            "divergence_mean": masked_mean(d_NT, m),
            "divergence_max": d_NT[m].max() if m.any() else nan,
            "divergence_frac_above": masked_mean((d_NT > threshold).float(), m),
        }
    )
