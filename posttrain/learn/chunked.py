"""Log-probabilities, entropies and logit-based terms without a float ``[N, T, V]`` tensor.

The policy's trunk runs once and gives the final hidden states ``[N, T, H]``; the output head
(``lm_head``) then runs over chunks of at most ``chunk_tokens`` positions, and each chunk's
logits live only inside that chunk. Log-probs and the entropy alone go through
``learn/fused_head.py`` (one autograd function, the backward written out: it keeps each chunk's
probabilities while they fit in 1 GiB and recomputes the chunk's logits otherwise). With logit
terms the chunk runs under ``torch.utils.checkpoint`` and is recomputed in the backward pass, so
the peak is one chunk's logits and their gradient, not the batch's. With a 49,152-token
vocabulary a ``[64, 512]`` batch would need 6.4 GB for fp32 logits alone; 341-position chunks
(64 MiB of logits) keep the peak a few hundred MB.

``logit_terms`` are per-token functions of the (temperature-scaled) logits, ``[1, C, V] ->
[1, C]`` (an entropy regularizer's term, the entropy it measures): they run inside the chunk, so
they get the logits without the batch ever holding them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from posttrain.learn.fused_head import FusedHeadLogprob

LogitTerm = Callable[[Tensor], Tensor]

# Bytes of fp32 logits one chunk may hold (x ~3 with log_softmax and its gradient).
CHUNK_BYTES = 64 * 2**20


def chunk_positions(vocab: int, budget_bytes: int = CHUNK_BYTES) -> int:
    """Positions per chunk so that one chunk's fp32 logits take at most ``budget_bytes``."""
    return max(1, budget_bytes // (4 * vocab))


def head_of(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output projection whose product with the final hidden states is the logits, or
    ``None`` when the model transforms logits further (soft-capping, scaling), so callers fall back
    to the model's own forward.
    """
    cfg = getattr(model, "config", None)
    if any(getattr(cfg, k, None) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else None
    return head if isinstance(head, torch.nn.Linear) else None


def _chunk(
    head: torch.nn.Module, temperature: float, terms: Sequence[LogitTerm], with_entropy: bool,
    h_CH: Tensor, ids_C: Tensor,
) -> tuple[Tensor, ...]:
    """Per position of one chunk: log pi(token), then each term, then (no gradient) the entropy."""
    logits = head(h_CH).float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, ids_C[:, None])[:, 0] - logz
    out = [logp, *(t(logits[None])[0] for t in terms)]
    if with_entropy:
        with torch.no_grad():
            p = torch.softmax(logits, dim=-1)
            out.append(logz - (p * logits).sum(-1))  # H = log Z - E_p[logit]
    return tuple(out)


def token_logprobs(
    head: torch.nn.Module,
    hidden_NTH: Tensor,
    ids_NT: Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
    terms: Sequence[LogitTerm] = (),
    chunk_tokens: int | None = None,
) -> tuple[Tensor, list[Tensor], Tensor | None]:
    """Log pi(ids) ``[N, T]`` from final hidden states, each of ``terms`` ``[N, T]`` and the
    entropy ``[N, T]`` (no gradient; ``None`` unless ``with_entropy``), chunk by chunk.

    Gradients reach ``hidden_NTH`` and the head's weights through the log-probs and the terms.
    """
    n, t, h = hidden_NTH.shape
    size = chunk_tokens or chunk_positions(head.out_features)
    flat_h, flat_ids = hidden_NTH.reshape(n * t, h), ids_NT.reshape(n * t).to(hidden_NTH.device)
    if not terms:  # log-probs (and the entropy) alone: the hand-written backward of learn/fused_head.py
        logp, entropy = FusedHeadLogprob.apply(flat_h, head.weight, head.bias, flat_ids, temperature, size,
                                               with_entropy)
        return logp.view(n, t), [], entropy.view(n, t) if with_entropy else None
    grad = torch.is_grad_enabled() and (hidden_NTH.requires_grad or head.weight.requires_grad)
    pieces = []
    for s in range(0, n * t, size):
        args = (head, temperature, tuple(terms), with_entropy, flat_h[s : s + size], flat_ids[s : s + size])
        pieces.append(checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
    cols = [torch.cat(c).view(n, t) for c in zip(*pieces, strict=True)]
    logp, rest = cols[0], cols[1:]
    entropy = rest.pop() if with_entropy else None
    return logp, rest, entropy
