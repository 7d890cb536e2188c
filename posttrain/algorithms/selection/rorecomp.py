"""RoRecomp: priority batch mask and the compensation replay buffer."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.algorithms.selection._common import _check_rewards


def rorecomp_priority_mask(
    rewards: Tensor, lengths: Tensor, *, correct_above: float = 0.0, top_k: int | None = None
) -> Tensor:
    """RoRecomp priority batch: short-correct and long-incorrect responses of every group.

    Per group: correct = r > ``correct_above``. With ``top_k=None`` (median split):
    short-correct = correct and len <= median(len of the group's correct responses);
    long-wrong = wrong and len >= median(len of its wrong responses); the median is numpy's
    (mean of the two middle values). The split is inclusive, so a group's shortest correct and longest wrong
    responses are always prioritized: a lone correct answer among wrong ones (the group's only
    positive signal) and a group of equal lengths (no brevity signal, only the outcome's) are
    trained on, where a strict split would send them all to the buffer (issue 38, D8). Example:
    r = [1, 0, 0, 0], len = [5, 3, 4, 6]: the correct half {5} has median 5 -> row 0; the wrong half
    {3, 4, 6} has median 4 -> rows 2, 3: priority [T, F, T, T]. With ``top_k=k``: the k shortest
    correct and the k longest wrong responses (ties by index). Priority = short-correct or
    long-wrong; the rest goes to the compensation replay buffer (:func:`compensation_push`).
    Shapes: rewards, lengths ``[P, G]`` -> priority ``[P, G]`` bool.
    Paper: "RoRecomp: Enhancing Reasoning Efficiency via Rollout Response Recomposition in
    Reinforcement Learning", Li et al. 2025, arXiv:2509.25958; seed
    ``papers/004_f298e9ec572f7f27.txt:123`` (catalog L123). **Reconstruction, no code found**: the
    threshold (median or k), whether advantages are recomputed after selection, and the
    compensation interval are not established. Advantages are meant to be computed on the full
    group first.
    Nearest neighbour: Shuffle-R1 PTS also keeps the extremes of a group, but by advantage, not
    by length within the correct / wrong halves.
    """
    r_PG, len_PG = _check_rewards(rewards), lengths.detach().float()
    if len_PG.shape != r_PG.shape:
        raise ValueError(f"lengths {tuple(len_PG.shape)} must match rewards {tuple(r_PG.shape)}")
    correct_PG = r_PG > correct_above
    wrong_PG = ~correct_PG
    if r_PG.numel() == 0:
        return correct_PG
    if top_k is None:  # numpy's median of each half (NaN outside it, and for an empty half)
        nan = torch.full_like(len_PG, float("nan"))
        med_c = torch.nanquantile(torch.where(correct_PG, len_PG, nan), 0.5, dim=1, keepdim=True)
        med_w = torch.nanquantile(torch.where(wrong_PG, len_PG, nan), 0.5, dim=1, keepdim=True)
        return (correct_PG & (len_PG <= med_c)) | (wrong_PG & (len_PG >= med_w))
    inf = torch.full_like(len_PG, float("inf"))
    # rank of each response within its half: shortest correct first, longest wrong first, ties by index
    rank_c = _rank(torch.where(correct_PG, len_PG, inf))
    rank_w = _rank(torch.where(wrong_PG, -len_PG, inf))
    return (correct_PG & (rank_c < top_k)) | (wrong_PG & (rank_w < top_k))


def _rank(key_PG: Tensor) -> Tensor:
    """Position of each entry in its row's stable ascending sort (0 = smallest; ties by index)."""
    order = torch.sort(key_PG, dim=1, stable=True).indices
    return torch.empty_like(order).scatter_(1, order, torch.arange(key_PG.shape[1]).expand_as(order))


@dataclass(frozen=True)
class CompensationBuffer:
    """RoRecomp replay buffer of non-priority samples, as opaque integer ids, oldest first."""

    items: tuple[int, ...] = ()


def compensation_push(
    buffer: CompensationBuffer, sample_ids: Sequence[int], *, capacity: int | None = None
) -> CompensationBuffer:
    """Append ``sample_ids`` to the buffer; keep the newest ``capacity`` (None: unbounded).

    The caller keeps the samples themselves, keyed by id. Paper: see
    :func:`rorecomp_priority_mask` (the capacity is not given there).
    """
    items = buffer.items + tuple(int(i) for i in sample_ids)
    if capacity is not None:
        items = items[max(0, len(items) - capacity) :]
    return CompensationBuffer(items=items)


def compensation_draw(
    buffer: CompensationBuffer, *, batch_size: int, generator: torch.Generator
) -> tuple[tuple[int, ...], CompensationBuffer]:
    """Draw a compensation batch: ``batch_size`` ids uniformly without replacement, and remove them.

    Returns ``(ids, new_buffer)``; fewer ids when the buffer holds fewer. Uniform sampling and
    removal are this library's reading (the paper says "sample from the replay buffer"); when
    to run a compensation batch (a fixed interval or ratio) is left to the caller.
    """
    n = len(buffer.items)
    take = torch.randperm(n, generator=generator)[: max(0, min(batch_size, n))].tolist()
    taken = set(take)
    ids = tuple(buffer.items[i] for i in take)
    left = tuple(x for i, x in enumerate(buffer.items) if i not in taken)
    return ids, CompensationBuffer(items=left)
