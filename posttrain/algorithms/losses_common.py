"""The policy-loss registry and the helpers its entries share.

:mod:`posttrain.algorithms.losses` re-exports every name here with ``compute``; the entries kept in
their own modules (``losses_hybrid``, ``losses_rover``, ``losses_shiq``, ``losses_soft``, ...) register through
this module, so ``losses`` can import them without either importing the other back.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("policy loss")
register = REGISTRY.register
names = REGISTRY.names

inputs = REGISTRY.required  # extra inputs an entry requires (keyword-only, no default)
# an entry declaring this keyword gets ``weights`` through it, unapplied (it folds them into its own weight)
FOLDED_WEIGHTS = "behaviour_weights"
# inputs that are functions of the current policy's logits and keep their gradient, like the log-probs (every other
# tensor input is detached): ``logsumexp`` [N, T], log Z_theta(s_t), the level of the logits (ShiQ's value)
GRAD_INPUTS = ("logsumexp",)


def _log_ratio(logp_NT: Tensor, old_logp_NT: Tensor) -> Tensor:
    # clamp as verl does so a stale or corrupted old log-prob cannot overflow exp()
    return torch.clamp(logp_NT - old_logp_NT, -20.0, 20.0)


def _lengths(mask_NT: Tensor) -> Tensor:
    return mask_NT.sum(dim=-1).clamp(min=1.0)


def _seq_mean(x_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """Per-sequence masked mean ``[N]``."""
    return (x_NT * mask_NT).sum(dim=-1) / _lengths(mask_NT)


def _masked_mean(x_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """Masked mean over the whole batch (scalar)."""
    return (x_NT * mask_NT).sum() / mask_NT.sum().clamp(min=1.0)


def _per_token(seq_loss_N: Tensor, like_NT: Tensor) -> Tensor:
    """Broadcast a per-sequence loss to every token (its token mean is the sequence loss)."""
    return seq_loss_N[:, None].expand_as(like_NT)
