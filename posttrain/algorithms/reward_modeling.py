"""Reward-model losses (``posttrain rm``): Bradley-Terry on preference pairs and ODIN's length terms.

Pure tensor functions; the trainer that uses them is ``posttrain/trainers/rm.py``. Notation: for a pair
(x, y_w, y_l) a reward model gives scalars r_w = r(x, y_w) and r_l = r(x, y_l); a batch holds B pairs,
so N = 2B responses (chosen rows first, then rejected rows, as the trainer lays them out).

- :func:`bradley_terry`: the pairwise loss of InstructGPT (Ouyang et al. 2022, arXiv:2203.02155, eq. 1)
  with the optional margin of Llama 2 (Touvron et al. 2023, arXiv:2307.09288, eq. 2).
- :func:`pearson`, :func:`odin_length_loss`, :func:`odin_orthogonality`: ODIN (Chen et al. 2024,
  "ODIN: Disentangled Reward Mitigates Hacking in RLHF", arXiv:2402.07319): two linear heads on the same
  last-token features, a quality head r_Q and a length head r_L; BT ranks r_Q + r_L, a correlation loss
  makes r_Q uncorrelated with the response length and r_L correlated with it, and an orthogonality loss
  keeps the two heads' weight vectors apart. Only r_Q is kept for scoring.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def bradley_terry(chosen_B: Tensor, rejected_B: Tensor, *, margin: float | Tensor = 0.0) -> Tensor:
    """Per-pair Bradley-Terry loss ``[B]``: l = -log sigmoid(r_w - r_l - m).

    Under the Bradley-Terry model P(y_w > y_l | x) = sigmoid(r_w - r_l), so this is the negative
    log-likelihood of the observed preference (InstructGPT, arXiv:2203.02155, eq. 1; averaged over the
    batch by the caller). ``margin`` m (a scalar or ``[B]``, >= 0) asks for r_w to exceed r_l by at least
    about m before the loss flattens (Llama 2, arXiv:2307.09288, eq. 2, where m comes from the annotators'
    rating of how much better y_w is); m = 0 is plain BT. At r_w = r_l and m = 0 the loss is log 2.
    """
    return -F.logsigmoid(chosen_B - rejected_B - margin)


def pearson(x_N: Tensor, y_N: Tensor, *, eps: float = 1e-8) -> Tensor:
    """Pearson correlation of two ``[N]`` vectors (a scalar in [-1, 1]), differentiable in both.

    rho = sum(xc yc) / (sqrt(sum(xc^2) + eps) sqrt(sum(yc^2) + eps)), xc = x - mean(x), yc = y - mean(y).
    The eps inside each root keeps the value (0) and the gradient finite when one vector is constant,
    e.g. a batch whose responses all have the same length; it shifts rho by a relative ~eps / sum(xc^2).
    """
    xc, yc = x_N - x_N.mean(), y_N - y_N.mean()
    return (xc * yc).sum() / ((xc.pow(2).sum() + eps).sqrt() * (yc.pow(2).sum() + eps).sqrt())


def odin_length_loss(quality_N: Tensor, length_reward_N: Tensor, lengths_N: Tensor) -> Tensor:
    """ODIN's length-disentangling loss (arXiv:2402.07319): L_L = |rho(r_Q, L)| - rho(r_L, L).

    ``quality_N``, ``length_reward_N``: the two heads' rewards of the N responses of a batch (chosen and
    rejected together); ``lengths_N``: their lengths in tokens. Minimizing it drives the quality head's
    correlation with length to 0 and the length head's to 1. The authors' code writes it as
    |rho(r_Q, L)| + (1 - rho(r_L, L)), the same up to the constant 1 (RLHFlow's ``odin/gemma_two_head.py``,
    computed over the batch gathered from every rank; here over the batch).
    """
    lengths = lengths_N.to(quality_N.dtype)
    return pearson(quality_N, lengths).abs() - pearson(length_reward_N, lengths)


def odin_orthogonality(quality_w: Tensor, length_w: Tensor) -> Tensor:
    """ODIN's orthogonality loss (arXiv:2402.07319): L_O = |<w_Q, w_L>| / (||w_Q|| ||w_L||).

    The absolute cosine of the two heads' weight vectors (each ``[H]`` or ``[1, H]``), so the heads read
    different directions of the shared features. Departure: the authors' DeepSpeed code
    (``TwoHeadRewardModel.proj_with_normalized_weight``) also subtracts each vector's mean before
    normalizing; here the plain cosine, as the paper writes it.
    """
    return F.cosine_similarity(quality_w.reshape(1, -1), length_w.reshape(1, -1), eps=1e-8)[0].abs()


def odin_loss(
    quality_N: Tensor,
    length_reward_N: Tensor,
    lengths_N: Tensor,
    quality_w: Tensor,
    length_w: Tensor,
    *,
    margin: float = 0.0,
    length_coef: float = 1.0,
    ortho_coef: float = 1.0,
) -> tuple[Tensor, dict[str, Tensor]]:
    """ODIN's whole objective (arXiv:2402.07319; seed ``papers/004_f298e9ec572f7f27.txt:125``) on a
    batch of B pairs (N = 2B rows, chosen first).

    L = mean_B BT(r_w, r_l; m) + lambda_L L_L + lambda_O L_O with r = r_Q + r_L (the ranking uses both
    heads, so length can explain preferences through r_L instead of r_Q). Defaults lambda_L = lambda_O = 1
    are the authors' scripts' (``LENGTH_CORR=1.0``, ``RM_ORTHO_REG=1.0``). Returns the scalar loss and its
    parts, detached: ``bt``, ``length`` (L_L), ``ortho`` (L_O), ``quality_corr`` (rho(r_Q, L)) and
    ``length_corr`` (rho(r_L, L)).
    """
    b = quality_N.shape[0] // 2
    total_N = quality_N + length_reward_N
    bt = bradley_terry(total_N[:b], total_N[b:], margin=margin).mean()
    length_term = odin_length_loss(quality_N, length_reward_N, lengths_N)
    ortho = odin_orthogonality(quality_w, length_w)
    lengths = lengths_N.to(quality_N.dtype)
    with torch.no_grad():
        parts = {"bt": bt.detach(), "length": length_term.detach(), "ortho": ortho.detach(),
                 "quality_corr": pearson(quality_N, lengths), "length_corr": pearson(length_reward_N, lengths)}
    return bt + length_coef * length_term + ortho_coef * ortho, parts
