"""One rank's share of the policy update of a sharded learner (``train.processes > 1``,
``learn/distributed/fsdp.py``).

Every rank runs the same epochs, minibatches and optimizer steps as the one-process update
(``learn/update.py``: the same seeded shuffles, so the same rows in each minibatch). Within a
minibatch the micro-batches are dealt round-robin to the ranks (at least one per rank where there
are rows enough). Each micro-batch's loss is weighted by d(aggregate)/d(loss) of the *whole*
minibatch (global normalizers), so the ranks' gradients add up to the one-process gradient; FSDP
averages them over the ranks, hence the factor ``world`` on each rank's loss.

FSDP's collectives (the all-gather of a layer's weights in every forward, the reduce-scatter of
its gradients in every backward) need the same number of passes on every rank: a rank with fewer
micro-batches runs the minibatch's first one again with weight 0 (padding passes). The per-token
outputs (log-probs, entropies, ...) of the micro-batches are gathered to every rank, so every rank
computes the same metrics as the one-process update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from posttrain.algorithms.value import clipped_value_loss
from posttrain.config import Config
from posttrain.learn.chunked import LogitTerm
from posttrain.learn.critic import Critic, completion_values
from posttrain.learn.logprobs import completion_terms
from posttrain.learn.parts import LearnParts
from posttrain.learn.update import Minibatch, aggregation_weights, micro_loss, plan_micro_batches, step_metrics
from posttrain.rollout import Rollout


@dataclass(frozen=True)
class Shard:
    """The rank of this process among ``world`` learner processes (``torch.distributed``'s default group)."""

    rank: int
    world: int

    def deal(self, runs: list[Tensor]) -> list[tuple[int, Tensor, bool]]:
        """The passes of this rank over ``runs`` (micro-batches): ``(index, rows, live)``, as many on every
        rank (a padding pass repeats run 0 with ``live = False``).
        """
        mine = list(range(self.rank, len(runs), self.world))
        passes = math.ceil(len(runs) / self.world)
        return [(mine[i], runs[mine[i]], True) if i < len(mine) else (0, runs[0], False) for i in range(passes)]

    def gather(self, obj: object) -> list[object]:
        """``obj`` from every rank, in rank order (a collective: every rank calls it)."""
        out: list[object] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


def spread(runs: list[Tensor], n_rows: int, world: int) -> list[Tensor]:
    """``runs`` (a token-budget plan over ``n_rows`` consecutive rows), or ``world`` consecutive
    runs of near-equal size when the plan has fewer runs than ranks (and the rows allow).
    """
    if len(runs) >= world or n_rows < 2:
        return runs
    return [r for r in torch.arange(n_rows).tensor_split(min(world, n_rows)) if len(r)]


def sharded_minibatch_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    parts: LearnParts,
    cfg: Config,
    b: Minibatch,
    pad_id: int,
    entropy_state: object | None,
    *,
    shard: Shard,
) -> dict[str, float] | None:
    """The micro-batches of one optimizer step that fall to this rank (the module docstring); the step's metrics on
    every rank, or ``None`` on every rank when a loss or the gradient norm was not finite.
    """
    dev = next(model.parameters()).device
    mask = b.mask.to(dev)
    width = b.rollouts.token_ids.shape[1]
    runs = spread(plan_micro_batches([len(p) + width for p in b.prompts], cfg.train.micro_batch_tokens),
                  len(b.prompts), shard.world)
    weights_NT = aggregation_weights(parts.aggregate, mask)
    optimizer.zero_grad(set_to_none=True)
    done = []
    for j, rows, live in shard.deal(runs):
        loss_NT, out = micro_loss(model, parts, cfg, b, rows, pad_id, entropy_state)
        loss = (loss_NT * weights_NT[rows]).sum()
        (loss * (shard.world if live else 0.0)).backward()  # FSDP averages over the ranks: x world sums
        if live:
            done.append((j, float(loss.detach()), {k: v.cpu() if isinstance(v, Tensor) else v for k, v in out.items()}))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.train.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    gathered = sorted((item for part in shard.gather(done) for item in part), key=lambda t: t[0])
    losses = [loss for _, loss, _ in gathered]
    if not (math.isfinite(grad_norm) and all(math.isfinite(x) for x in losses)):
        optimizer.zero_grad(set_to_none=True)
        return None
    optimizer.step()
    kl_sum = sum(out.pop("kl_sum") for _, _, out in gathered)
    got = {k: torch.cat([out[k] for _, _, out in gathered]) for k in gathered[0][2]}
    return step_metrics(parts, b, got, b.mask, sum(losses), grad_norm, kl_sum, entropy_state, cfg.diagnostics.top_q)


@torch.no_grad()
def sharded_logprobs(
    model: torch.nn.Module, row_prompts: list[list[int]], rollouts: Rollout, *, pad_id: int, temperature: float,
    budget: int, shard: Shard, terms: Sequence[LogitTerm] = (),
) -> Tensor:
    """:func:`~posttrain.learn.update.batched_logprobs` with the micro-batches dealt to the ranks and
    the rows gathered back: ``[N, T]`` (with logit ``terms``: ``[N, T, 1 + len(terms)]``) on every rank, on the CPU.
    """
    width = rollouts.token_ids.shape[1]
    runs = spread(plan_micro_batches([len(p) + width for p in row_prompts], budget), len(row_prompts), shard.world)
    done = []
    for j, rows, live in shard.deal(runs):
        lp, _, extra = completion_terms(model, [row_prompts[i] for i in rows.tolist()], rollouts.token_ids[rows],
                                        rollouts.attention_mask[rows], pad_id=pad_id, temperature=temperature,
                                        terms=terms)
        if live:
            done.append((j, (torch.stack([lp, *extra], -1) if terms else lp).float().cpu()))
    gathered = sorted((item for part in shard.gather(done) for item in part), key=lambda t: t[0])
    return torch.cat([lp for _, lp in gathered])


def sharded_value_step(
    critic: Critic, prompts: list[list[int]], ids_NT: Tensor, attn_NT: Tensor, values_NT: Tensor,
    returns_NT: Tensor, mask_NT: Tensor, pad_id: int, *, shard: Shard,
) -> tuple[float, float, float] | None:
    """:func:`~posttrain.learn.critic.value_step` on a sharded critic (``critic.model`` a
    :class:`~posttrain.learn.logprobs.RootForward`): the minibatch's rows split into ``world`` runs
    dealt to the ranks, each run's loss over the whole minibatch's token count, the same result on
    every rank.
    """
    n_rows = len(prompts)
    runs = [r for r in torch.arange(n_rows).tensor_split(min(shard.world, n_rows)) if len(r)]
    total = mask_NT.sum()
    critic.optimizer.zero_grad(set_to_none=True)
    done = []
    for _, rows, live in shard.deal(runs):
        v = critic.model(completion_values, [prompts[i] for i in rows.tolist()], ids_NT[rows], attn_NT[rows],
                         pad_id=pad_id)
        dev = v.device
        loss_NT, clipped_NT = clipped_value_loss(v, values_NT[rows].to(dev), returns_NT[rows].to(dev),
                                                 mask_NT[rows].to(dev), cliprange=critic.cfg.cliprange_value)
        loss = critic.cfg.loss_coef * loss_NT.sum() / total.to(dev)
        (loss * (shard.world if live else 0.0)).backward()  # FSDP averages over the ranks: x world sums
        if live:
            done.append((float(loss.detach()), float(clipped_NT.sum())))
    grad_norm = torch.nn.utils.clip_grad_norm_(critic.model.parameters(), critic.cfg.grad_clip)
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    gathered = [item for part in shard.gather(done) for item in part]
    loss = sum(x for x, _ in gathered)
    if not (math.isfinite(loss) and math.isfinite(grad_norm)):
        critic.optimizer.zero_grad(set_to_none=True)
        return None
    critic.optimizer.step()
    return loss, sum(c for _, c in gathered) / float(total), grad_norm
