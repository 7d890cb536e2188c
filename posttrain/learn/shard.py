"""Which share of an update's micro-batches this process runs: one process is the one shard of a world of one.

The update (``learn/update.py``), the log-prob passes and the critic's step (``learn/critic.py``) are written
once, for a :class:`Shard`. Within a minibatch the micro-batches are dealt round-robin to the ranks (at least
one per rank where there are rows enough). Each micro-batch's loss is weighted by d(aggregate)/d(loss) of the
*whole* minibatch (global normalizers), so the ranks' gradients add up to the one-process gradient; FSDP
averages them over the ranks, hence the factor ``world`` on each rank's loss.

FSDP's collectives (the all-gather of a layer's weights in every forward, the reduce-scatter of its gradients
in every backward) need the same number of passes on every rank: a rank with fewer micro-batches runs the
minibatch's first one again with weight 0 (padding passes). The per-token outputs of the micro-batches are
gathered to every rank, so every rank computes the same metrics. With ``world = 1`` nothing is padded,
gathered or scaled: the one process runs every micro-batch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class Shard:
    """The rank of this process among ``world`` learner processes (``torch.distributed``'s default group)."""

    rank: int = 0
    world: int = 1

    def deal(self, runs: list[Tensor]) -> list[tuple[int, Tensor, bool]]:
        """The passes of this rank over ``runs`` (micro-batches): ``(index, rows, live)``, as many on every
        rank (a padding pass repeats run 0 with ``live = False``).
        """
        mine = list(range(self.rank, len(runs), self.world))
        passes = math.ceil(len(runs) / self.world)
        return [(mine[i], runs[mine[i]], True) if i < len(mine) else (0, runs[0], False) for i in range(passes)]

    def gather(self, obj: object) -> list[object]:
        """``obj`` from every rank, in rank order (a collective: every rank calls it); ``[obj]`` in a world of one."""
        if self.world == 1:
            return [obj]
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def scale(self, live: bool) -> float:
        """The factor on a pass's loss: ``world`` (FSDP averages the ranks' gradients: x world sums them), 0 for
        a padding pass.
        """
        return float(self.world) if live else 0.0

    def portable(self, out: dict) -> dict:
        """A pass's outputs as they can be gathered: on the CPU when other ranks receive them, else as they are."""
        if self.world == 1:
            return out
        return {k: v.cpu() if isinstance(v, Tensor) else v for k, v in out.items()}


LOCAL = Shard()  # the one process of a world of one


def spread(runs: list[Tensor], n_rows: int, world: int) -> list[Tensor]:
    """``runs`` (a token-budget plan over ``n_rows`` consecutive rows), or ``world`` consecutive
    runs of near-equal size when the plan has fewer runs than ranks (and the rows allow).
    """
    if len(runs) >= world or n_rows < 2:
        return runs
    return [r for r in torch.arange(n_rows).tensor_split(min(world, n_rows)) if len(r)]


def plan_micro_batches(row_tokens: list[int], budget: int) -> list[Tensor]:
    """Consecutive runs of rows whose token counts sum to at most ``budget`` (a row over budget
    runs alone); ``budget = 0``: one run of every row.
    """
    if budget <= 0:
        return [torch.arange(len(row_tokens))]
    runs, start, used = [], 0, 0
    for i, n in enumerate(row_tokens):
        if i > start and used + n > budget:
            runs.append(torch.arange(start, i))
            start, used = i, 0
        used += n
    runs.append(torch.arange(start, len(row_tokens)))
    return runs


def over_runs(forward: Callable[[Tensor], object], row_tokens: list[int], budget: int,
              shard: Shard) -> list[tuple[Tensor, object]]:
    """``forward(rows)`` of every micro-batch of a token-budget plan over rows of ``row_tokens`` tokens, this
    shard's passes run here and every pass's result gathered, in the plan's order.
    """
    runs = spread(plan_micro_batches(row_tokens, budget), len(row_tokens), shard.world)
    done = []
    for j, rows, live in shard.deal(runs):
        out = forward(rows)
        if live:
            done.append((j, rows, out))
    return [(rows, out) for _, rows, out in sorted((x for part in shard.gather(done) for x in part),
                                                    key=lambda t: t[0])]


def grad_norm_of(norm: Tensor) -> float:
    """A clipped gradient norm as a float (FSDP returns a DTensor: its full value)."""
    return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
