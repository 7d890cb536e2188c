"""Step 4b of the loop: the batch selector chooses which rows of the step's rollout batch the policy
update trains on, and in which minibatches (``algorithm.batch_selector``, ``batch_selector_params``).

It runs after the advantages (computed on whole groups, as both methods prescribe) and before the
update, which takes its rows as explicit minibatches (``policy_update(minibatches=...)``), the same
plan every epoch. :data:`SELECTORS` lists each selector's parameters with their defaults.

* ``none``: every row; the update's own order (``train.minibatches`` chunks, reshuffled every
  epoch when the update is off-policy).
* ``shuffle_r1``: Shuffle-R1 (arXiv:2508.05612; catalog L139; code read from an unofficial copy,
  ridwanctg10/shuffle-r1 @ ecf8e42). Pairwise Trajectory Sampling keeps the K = int((G // 2)(1 -
  prune_ratio)) most contrastive (high, low) pairs of every group
  (:func:`selection.pairwise_trajectory_sampling`); Advantage-based Batch Shuffle then draws
  pairs in ``replay_times`` rounds, without replacement within a round, with P(pair) ∝ w^power
  (:func:`selection.advantage_batch_shuffle`), so strong pairs recur and weak ones may not appear.
  The drawn pairs' rows, in draw order, are split into ``train.minibatches`` chunks without
  reshuffling (the code's ``experience_resampling`` concatenates the rounds and ``update_actor``
  splits the batch in order). The advantages are the configured estimator's on the whole group;
  the code's are GRPO's with the unbiased std + 1e-6, which is ``algorithm.advantage = "grpo"``
  with its defaults. Stateless: the draws are seeded from ``(seed, "shuffle_r1", step)``.
* ``rorecomp``: RoRecomp (arXiv:2509.25958; catalog L123; a reconstruction, no code found). Each
  step trains on its priority batch, the short-correct and long-wrong rows of every group
  (:func:`selection.rorecomp_priority_mask`: ``reward > correct_above`` is correct; an inclusive median
  split, so a lone correct answer and an equal-length group are prioritized, or the ``top_k`` shortest /
  longest when ``top_k > 0``), in ``train.minibatches`` chunks. The other
  valid rows go to a compensation buffer (newest ``capacity`` kept) with the advantage they had.
  Every ``compensation_every`` steps (0: never) one more minibatch follows, the compensation batch:
  ``compensation_size`` rows (0: as many as the priority batch) drawn uniformly without replacement
  from the buffer as it was before this step, and removed from it. The buffer is part of the loop
  state (``entry_states["batch_selector"]``), so a resumed run continues it. Choices of this
  library where the paper is silent: the interval and size, drawing before pushing, and training
  replayed rows with their stored advantages and old log-probs recomputed under the current policy
  (no correction to the policy that sampled them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from posttrain.algorithms import selection
from posttrain.algorithms.registry import Registry
from posttrain.algorithms.selection.selectors import SELECTORS
from posttrain.rollout import Rollout
from posttrain.seeds import derive_seed

if TYPE_CHECKING:
    from posttrain.config.algorithm import AlgorithmConfig

STATE_KEY = "batch_selector"  # where a stateful selector's state lives in LoopState.entry_states


@dataclass
class UpdateBatch:
    """The rows the policy update trains on (``[N, ...]``) and its minibatches over them."""

    row_prompts: list[list[int]]
    rollouts: Rollout
    mask_NT: Tensor
    adv_N: Tensor  # [N] or [N, T]
    row_inputs: dict[str, Tensor]  # per-row loss inputs: rewards [N], group_ids [N]
    minibatches: list[Tensor] | None = None  # row indices of each minibatch in order; None: the update's order
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict | None = None  # a stateful selector's state after this step (checkpointed form)


@dataclass(frozen=True)
class BatchSelector:
    """The configured selector, bound to its parameters (defaults filled in)."""

    name: str
    params: dict
    minibatches: int  # train.minibatches
    seed: int

    @classmethod
    def from_config(cls, a: AlgorithmConfig, minibatches: int, seed: int) -> BatchSelector:
        """The selector ``algorithm.batch_selector`` with ``batch_selector_params`` over its defaults, drawing
        ``train.minibatches`` minibatches from the run's ``seed``.
        """
        return cls(a.batch_selector, {**SELECTORS[a.batch_selector], **a.batch_selector_params}, minibatches, seed)

    def select(self, batch: UpdateBatch, rewards_PG: Tensor, step: int, state: dict | None, pad_id: int) -> UpdateBatch:
        """Choose the rows and minibatches of ``batch`` (module docstring); ``state`` is this selector's
        saved state (``None``: none yet). Returns the batch to train on, with its metrics and state.
        """
        return REGISTRY.get(self.name)(self, batch, rewards_PG, step, state, pad_id)


Select = Callable[["BatchSelector", UpdateBatch, Tensor, int, "dict | None", int], UpdateBatch]
REGISTRY: Registry[Select] = Registry("batch selector")  # parameters and defaults: SELECTORS
register = REGISTRY.register


@register("none")
def _every_row(
    sel: BatchSelector, b: UpdateBatch, rewards_PG: Tensor, step: int, saved: dict | None, pad_id: int
) -> UpdateBatch:
    """Every row, in the update's own order."""
    return b


@register("shuffle_r1", plans_minibatches=True, note="its minibatches are drawn pairs, not whole groups")
def _shuffle_r1(
    sel: BatchSelector, b: UpdateBatch, rewards_PG: Tensor, step: int, saved: dict | None, pad_id: int
) -> UpdateBatch:
    """Shuffle-R1's pairs in advantage-weighted rounds (module docstring). Stateless.

    Seed: ``papers/004_f298e9ec572f7f27.txt:139``.
    """
    p = sel.params
    P, G = rewards_PG.shape
    pts = selection.pairwise_trajectory_sampling(rewards_PG, prune_ratio=p["prune_ratio"], weight=p["weight"])
    pairs_M2 = (pts.pairs + G * torch.arange(P).view(P, 1, 1)).reshape(-1, 2)  # group -> batch rows
    gen = torch.Generator().manual_seed(derive_seed(sel.seed, "shuffle_r1", step))
    order = selection.advantage_batch_shuffle(
        pts.weights.reshape(-1), generator=gen, replay_times=int(p["replay_times"]), power=float(p["power"])
    )
    drawn_M2 = pairs_M2[order]
    minibatches = [c.reshape(-1) for c in drawn_M2.chunk(sel.minibatches)]  # a pair stays in one minibatch
    metrics = {
        "selection/pairs": float(pairs_M2.shape[0]),
        "selection/train_rows": float(drawn_M2.numel()),
        "selection/unique_rows_frac": drawn_M2.unique().numel() / max(P * G, 1),
        "selection/pair_weight_mean": float(pts.weights.mean()) if pts.weights.numel() else 0.0,
    }
    return replace(b, minibatches=minibatches, metrics=metrics)


@register("rorecomp", replays_rows=True, plans_minibatches=True,
          note="its compensation batches replay rows stored at earlier steps, with their stored advantages")
def _rorecomp(
    sel: BatchSelector, b: UpdateBatch, rewards_PG: Tensor, step: int, saved: dict | None, pad_id: int
) -> UpdateBatch:
    """RoRecomp's priority batch, plus a compensation batch from its buffer (module docstring).

    Seed: ``papers/004_f298e9ec572f7f27.txt:123``.
    """
    p = sel.params
    P, G = rewards_PG.shape
    lengths_PG = b.rollouts.lengths[: P * G].view(P, G).float()
    prio_N = selection.rorecomp_priority_mask(
        rewards_PG, lengths_PG, correct_above=float(p["correct_above"]), top_k=int(p["top_k"]) or None
    ).reshape(-1)
    valid_N = b.mask_NT.sum(dim=1) > 0
    prio_rows = (prio_N & valid_N).nonzero().flatten()
    rest_rows = (~prio_N & valid_N).nonzero().flatten()
    st = saved or {"items": [], "samples": {}, "next_id": 0}
    buffer = selection.CompensationBuffer(tuple(st["items"]))
    samples: dict[int, dict] = dict(st["samples"])
    drawn: tuple[int, ...] = ()
    every = int(p["compensation_every"])
    if every and (step + 1) % every == 0:  # a compensation step: draw from the buffer as it was
        size = int(p["compensation_size"]) or prio_rows.numel()
        gen = torch.Generator().manual_seed(derive_seed(sel.seed, "rorecomp", step))
        drawn, buffer = selection.compensation_draw(buffer, batch_size=size, generator=gen)
    replay = [samples.pop(i) for i in drawn]
    next_id = int(st["next_id"])
    new_ids = list(range(next_id, next_id + rest_rows.numel()))
    for i, row in zip(new_ids, rest_rows.tolist(), strict=True):
        samples[i] = _stored_row(b, row, tag=step * P + row // G)
    buffer = selection.compensation_push(buffer, new_ids, capacity=int(p["capacity"]))
    kept = set(buffer.items)
    samples = {i: s for i, s in samples.items() if i in kept}
    out = _append_rows(b, replay, P, pad_id) if replay else b
    minibatches = [c for c in prio_rows.chunk(sel.minibatches) if c.numel()]
    if replay:
        minibatches.append(torch.arange(P * G, P * G + len(replay)))
    metrics = {
        "selection/priority_frac": prio_rows.numel() / max(int(valid_N.sum()), 1),
        "selection/compensation_rows": float(len(replay)),
        "selection/buffer_size": float(len(buffer.items)),
    }
    state = {"items": list(buffer.items), "samples": samples, "next_id": next_id + len(new_ids)}
    return replace(out, minibatches=minibatches, metrics=metrics, state=state)


def _stored_row(b: UpdateBatch, row: int, tag: int) -> dict:
    """One row as plain Python values (checkpointable, compared exactly on resume)."""
    n = int(b.mask_NT[row].sum())
    adv = b.adv_N[row]
    return {
        "prompt": list(b.row_prompts[row]),
        "tokens": b.rollouts.token_ids[row, :n].tolist(),
        "logprobs": b.rollouts.behaviour_logprobs[row, :n].tolist(),
        "adv": adv[:n].tolist() if adv.dim() else [float(adv)],
        "reward": float(b.row_inputs["rewards"][row]),
        "rerolled": bool(b.row_inputs["hint_rerolled"][row]) if "hint_rerolled" in b.row_inputs else False,
        "finished": bool(b.rollouts.finished[row]),
        "version": int(b.rollouts.policy_version[row]),
        "text": b.rollouts.texts[row],
        "tag": tag,  # the group it came from (step * P + group), for group_ids
    }


def _append_rows(b: UpdateBatch, rows: list[dict], P: int, pad_id: int) -> UpdateBatch:
    """``b`` with the stored ``rows`` appended after its own (right-padded to a common width)."""
    width = max(b.rollouts.token_ids.shape[1], *(len(r["tokens"]) for r in rows))

    def pad(x: Tensor, value: float) -> Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    def stack(key: str, value: float, dtype: torch.dtype) -> Tensor:
        return torch.stack([pad(torch.tensor([r[key]], dtype=dtype), value)[0] for r in rows])

    tokens = stack("tokens", pad_id, b.rollouts.token_ids.dtype)
    mask = torch.stack([pad(torch.ones(1, len(r["tokens"]), dtype=b.rollouts.loss_mask.dtype), 0)[0] for r in rows])
    lp = b.rollouts.behaviour_logprobs
    rollouts = Rollout(  # replayed rows' prompts are in the batch's row_prompts, not in prompt_ids
        prompt_ids=b.rollouts.prompt_ids,
        token_ids=torch.cat([pad(b.rollouts.token_ids, pad_id), tokens]),
        attention_mask=torch.cat([pad(b.rollouts.attention_mask, 0), mask]),
        loss_mask=torch.cat([pad(b.rollouts.loss_mask, 0), mask]),
        behaviour_logprobs=torch.cat([pad(lp, 0.0), stack("logprobs", 0.0, lp.dtype)]),
        finished=torch.cat([b.rollouts.finished, torch.tensor([r["finished"] for r in rows])]),
        texts=[*b.rollouts.texts, *(r["text"] for r in rows)],
        n=b.rollouts.n,
        policy_version=torch.cat([b.rollouts.policy_version, torch.tensor([r.get("version", 0) for r in rows])]),
    )
    if b.adv_N.dim() == 1:
        adv = torch.cat([b.adv_N, torch.tensor([r["adv"][0] for r in rows], dtype=b.adv_N.dtype)])
    else:
        adv = torch.cat([pad(b.adv_N, 0.0), stack("adv", 0.0, b.adv_N.dtype)])
    tags = sorted({r["tag"] for r in rows})
    inputs = {
        "rewards": torch.tensor([r["reward"] for r in rows], dtype=b.row_inputs["rewards"].dtype),
        "group_ids": torch.tensor([P + tags.index(r["tag"]) for r in rows]),  # distinct from this step's groups
        "hint_rerolled": torch.tensor([r.get("rerolled", False) for r in rows]),
    }
    return UpdateBatch(
        row_prompts=[*b.row_prompts, *(r["prompt"] for r in rows)],
        rollouts=rollouts,
        mask_NT=torch.cat([pad(b.mask_NT, 0), mask.to(b.mask_NT.dtype)]),
        adv_N=adv,
        row_inputs={k: torch.cat([v, inputs[k].to(v.dtype)]) for k, v in b.row_inputs.items()},
    )
