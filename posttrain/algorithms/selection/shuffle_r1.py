"""Shuffle-R1: Pairwise Trajectory Sampling and Advantage-based Batch Shuffle."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
from torch import Tensor

from posttrain.algorithms.selection._common import _check_rewards

PairWeight = Literal["sum", "max", "mean", "pos"]


class PairSelection(NamedTuple):
    """Pairwise Trajectory Sampling output.

    ``pairs``: long ``[P, K, 2]`` completion indices (high-advantage, low-advantage) in the group;
    ``weights``: float ``[P, K]`` pair weights for the shuffle; ``advantages``: float ``[P, G]``.
    """

    pairs: Tensor
    weights: Tensor
    advantages: Tensor


def pairwise_trajectory_sampling(
    rewards: Tensor,
    *,
    prune_ratio: float = 0.5,
    weight: PairWeight = "sum",
    eps: float = 1e-6,
) -> PairSelection:
    """Shuffle-R1 Pairwise Trajectory Sampling (PTS): keep the most contrastive pairs per group.

    A_i = (r_i - mean_g r) / (sigma_u + eps), sigma_u the unbiased std (a singleton group uses
    mean 0, std 1, as the code does). Sort the group by A descending (ties keep their order), pair
    1st with last, 2nd with 2nd-last, ..., and keep the first K = int((G // 2) * (1 - prune_ratio))
    pairs, which are the outermost, hence most contrastive. The code does not re-sort the pairs.
    Pair weight w (``sampling_weight``): sum |A_a| + |A_b| (default), max, mean, or pos
    = |max(A_a, A_b)|. Shapes: rewards ``[P, G]`` -> :class:`PairSelection` with K pairs a group.
    Paper: "Shuffle-R1: Efficient RL framework for Multimodal Large Language Models via
    Data-centric Dynamic Shuffle", Zhu et al. 2025, arXiv:2508.05612; seed
    ``papers/004_f298e9ec572f7f27.txt:139`` (catalog L139). Code read from an unofficial copy,
    ridwanctg10/shuffle-r1 ``shuffle_r1/custom_algos.py`` (``purning_ratio=0.5``); the official
    repository held only a README, so this is provisional. The code asserts G even; here an odd G
    leaves the median completion unpaired (the same two-pointer loop, without the assert).
    Nearest neighbour: the group filters drop whole groups; PTS drops the middle of every group.
    """
    r_PG = _check_rewards(rewards)
    P, G = r_PG.shape
    if G > 1 and P > 0:
        mean = r_PG.mean(dim=1, keepdim=True)
        std = r_PG.std(dim=1, keepdim=True, unbiased=True)
    else:
        mean, std = torch.zeros(P, 1), torch.ones(P, 1)
    adv_PG = (r_PG - mean) / (std + eps)
    K = int((G // 2) * (1.0 - prune_ratio))
    order_PG = torch.sort(adv_PG, dim=1, descending=True, stable=True).indices
    hi_PK = order_PG[:, :K]
    lo_PK = order_PG.flip(dims=[1])[:, :K]
    pairs_PK2 = torch.stack([hi_PK, lo_PK], dim=2)
    a_hi, a_lo = adv_PG.gather(1, hi_PK), adv_PG.gather(1, lo_PK)
    if weight == "sum":
        w_PK = a_hi.abs() + a_lo.abs()
    elif weight == "max":
        w_PK = torch.maximum(a_hi.abs(), a_lo.abs())
    elif weight == "mean":
        w_PK = (a_hi.abs() + a_lo.abs()) / 2
    elif weight == "pos":
        w_PK = torch.maximum(a_hi, a_lo).abs()
    else:
        raise ValueError(f"weight must be 'sum', 'max', 'mean' or 'pos'; got {weight!r}")
    return PairSelection(pairs=pairs_PK2, weights=w_PK, advantages=adv_PG)


def shuffle_probabilities(weights: Tensor, *, power: float = 1.0) -> Tensor:
    """Shuffle-R1 pair sampling probabilities: p_j = w_j^power / sum_k w_k^power.

    Shapes: ``[N]`` -> ``[N]``. ``sampling_method="power"``, ``sampling_coeff`` p = 1. When every
    weight is 0 (the code would give NaN) the probabilities are uniform. Paper: see
    :func:`pairwise_trajectory_sampling`.
    """
    w = weights.detach().double().clamp_min(0.0) ** power
    total = w.sum()
    if weights.numel() == 0 or total <= 0:
        return torch.full_like(weights, 1.0 / max(weights.numel(), 1), dtype=torch.float)
    return (w / total).float()


def advantage_batch_shuffle(
    weights: Tensor,
    *,
    generator: torch.Generator,
    replay_times: int = 8,
    power: float = 1.0,
    pairs_per_round: int | None = None,
) -> Tensor:
    """Shuffle-R1 Advantage-based Batch Shuffle (ABS): resample pairs in proportion to weight.

    ``replay_times`` rounds; each draws ``pairs_per_round`` pairs **without** replacement with
    p_j ∝ w_j^power (:func:`shuffle_probabilities`), so a strong pair can appear in several rounds
    and a weak one in none; the rounds are concatenated into the update batch. Default
    ``pairs_per_round = max(1, N // replay_times)`` keeps the batch at about N pairs (the code
    asserts N divisible by ``replay_times``). With ``replay_times == 1`` the pairs are returned in
    order, unshuffled, as in the code. Zero-weight pairs are drawn only after every positive-weight
    pair of the round (``np.random.choice`` would raise instead).
    Shapes: weights ``[N]`` (flattened PTS pair weights) -> long ``[replay_times * per_round]``
    pair indices. Paper: see :func:`pairwise_trajectory_sampling` (``experience_resampling``).
    Nearest neighbour: a plain shuffle gives every pair exactly one appearance.
    """
    n = weights.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    if replay_times <= 1:
        return torch.arange(n)
    per_round = min(n, pairs_per_round if pairs_per_round is not None else max(1, n // replay_times))
    probs = shuffle_probabilities(weights.flatten(), power=power)
    positive = (probs > 0).nonzero().flatten()
    zero = (probs <= 0).nonzero().flatten()
    rounds: list[Tensor] = []
    for _ in range(replay_times):
        k_pos = min(per_round, positive.numel())
        drawn = positive[:0]
        if k_pos > 0:
            drawn = positive[
                torch.multinomial(probs[positive], k_pos, replacement=False, generator=generator)
            ]
        rest = zero[torch.randperm(zero.numel(), generator=generator)[: per_round - k_pos]]
        rounds.append(torch.cat([drawn, rest]))
    return torch.cat(rounds)
