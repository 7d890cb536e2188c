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
    short-correct = correct and len < median(len of the group's correct responses);
    long-wrong = wrong and len > median(len of its wrong responses); the median is numpy's
    (mean of the two middle values). With ``top_k=k``: the k shortest correct and the k longest
    wrong responses (ties by index). Priority = short-correct or long-wrong; the rest goes to the
    compensation replay buffer (:func:`compensation_push`).
    Shapes: rewards, lengths ``[P, G]`` -> priority ``[P, G]`` bool.
    Paper: "RoRecomp: Enhancing Reasoning Efficiency via Rollout Response Recomposition in
    Reinforcement Learning", Li et al. 2025, arXiv:2509.25958; seed
    ``papers/004_f298e9ec572f7f27.txt:123`` (catalog L123). **Reconstruction, no code found**: the
    threshold (median or k), whether advantages are recomputed after selection, and the
    compensation interval are not established. Advantages are meant to be computed on the full
    group first. A lone correct (or wrong) response equals its own median and is not selected.
    Nearest neighbour: Shuffle-R1 PTS also keeps the extremes of a group, but by advantage, not
    by length within the correct / wrong halves.
    """
    r_PG, len_PG = _check_rewards(rewards), lengths.detach().float()
    if len_PG.shape != r_PG.shape:
        raise ValueError(f"lengths {tuple(len_PG.shape)} must match rewards {tuple(r_PG.shape)}")
    correct_PG = r_PG > correct_above
    out = torch.zeros_like(correct_PG)
    for p in range(r_PG.shape[0]):  # groups are small; a loop keeps the median rule readable
        for subset, short in ((correct_PG[p], True), (~correct_PG[p], False)):
            idx = subset.nonzero().flatten()
            if idx.numel() == 0:
                continue
            lens = len_PG[p, idx]
            if top_k is None:
                med = torch.quantile(lens, 0.5)
                chosen = idx[lens < med] if short else idx[lens > med]
            else:
                order = torch.sort(lens, descending=not short, stable=True).indices
                chosen = idx[order[:top_k]]
            out[p, chosen] = True
    return out


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
