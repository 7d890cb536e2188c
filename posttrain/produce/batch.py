"""The produced batch: P scored groups, one type from the rollout driver to the learner.

A rollout driver returns the :class:`Batch` of one generation batch, its shaped rewards not yet set
(``rewards_PG = None``). ``collect`` (``produce/collect.py``) shapes it, keeps the groups that pass the
group filter (:meth:`Batch.select_groups`) and joins the generation batches of a step into the step's
batch (:meth:`Batch.cat`), which prepare and learn read.

Each field says, where it is declared, how it goes along (``_Along``):

- *per group* fields hold one entry per group, P first (tensors ``[P, ...]`` or a dict of them, a list per
  prompt, a list per row of G rows, the :class:`Rollout`, the multi-turn :class:`Turns`): selecting groups
  picks them, joining batches concatenates them;
- *what it took* (prompts consumed, timings, sampled tokens, failed reward calls, metrics, the driver's
  state) describes every group generated, discarded ones included: selecting keeps it, joining adds it up
  (metrics: the mean over the generation batches; the driver's state: the last one).

A new field is one line here with its ``_Along``; nothing else lists the fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import torch
from torch import Tensor

from posttrain.rollout import Rollout, concat_rollouts
from posttrain.rollout.multiturn import Turns
from posttrain.tasks.base import Example


@dataclass(frozen=True)
class _Along:
    """How a field follows :meth:`Batch.select_groups` and :meth:`Batch.cat`."""

    pick: Callable[[Any, list[int], int], Any] | None  # (value, groups, G) -> the groups' value; None: kept
    join: Callable[[list[Any], int], Any]  # (the batches' values, pad_id) -> the joined value


def _flat(values: list[list], pad_id: int) -> list:
    return [x for v in values for x in v]


def _mean_metrics(values: list[dict[str, float]], pad_id: int) -> dict[str, float]:
    return {k: sum(m.get(k, 0.0) for m in values) / len(values) for k in values[0]}


GROUP_TENSOR = _Along(lambda v, gs, G: v[gs], lambda vs, pad: torch.cat(vs))
GROUP_TENSORS = _Along(lambda v, gs, G: {k: x[gs] for k, x in v.items()},  # a dict of per-group tensors
                       lambda vs, pad: {k: torch.cat([v[k] for v in vs]) for k in vs[0]})
GROUP_LIST = _Along(lambda v, gs, G: [v[g] for g in gs], _flat)
ROW_LIST = _Along(lambda v, gs, G: [v[g * G + j] for g in gs for j in range(G)], _flat)
ROLLOUT = _Along(lambda v, gs, G: v.select_groups(gs), lambda vs, pad: concat_rollouts(vs, pad))
TURNS = _Along(lambda v, gs, G: v.select(gs), lambda vs, pad: Turns.cat(vs))
GROUP_TENSORS = _Along(lambda v, gs, G: {k: x[gs] for k, x in v.items()},
                       lambda vs, pad: {k: torch.cat([v[k] for v in vs]) for k in vs[0]})
TOTAL = _Along(None, lambda vs, pad: sum(vs))
ALL = _Along(None, _flat)
MEAN = _Along(None, _mean_metrics)
LAST = _Along(None, lambda vs, pad: vs[-1])


def _along(how: _Along, **kw: Any) -> Any:
    return field(metadata={"along": how}, **kw)


@dataclass
class Batch:
    """P scored groups of G rows and what it took to make them (module docstring)."""

    examples: list[Example] = _along(GROUP_LIST)
    prompt_ids: list[list[int]] = _along(GROUP_LIST)  # the prompt each group is trained on
    rollouts: Rollout = _along(ROLLOUT)  # the trained rows
    scored_texts: list[str] = _along(ROW_LIST)  # what the rewards read (a partial state's prefix + its continuation)
    rewards_PGK: Tensor = _along(GROUP_TENSOR)  # each component times its weight, unshaped
    valid_PG: Tensor = _along(GROUP_TENSOR)
    correct_PG: Tensor = _along(GROUP_TENSOR)  # the task's verifier said correct (accuracy, group diagnostics)
    rerolled_P: Tensor = _along(GROUP_TENSOR)  # bool [P]: HINT re-rolled the group with its hint
    metrics: dict[str, float] = _along(MEAN)  # every generated sample's (the policy's), not only the kept ones'
    failures: list[dict] = _along(ALL)  # reward calls that failed (error, timeout, crash, NaN), with their samples
    consumed: int = _along(TOTAL)  # prompts taken from the data stream
    generate_s: float = _along(TOTAL)
    reward_s: float = _along(TOTAL)  # scoring, then (set by collect) shaping and the group filter
    gen_tokens: int = _along(TOTAL)  # every sampled token, discarded ones included
    turns: Turns | None = _along(TURNS, default=None)  # multi-turn episodes' turn-level arrays [P, G, K]
    external_PG: Tensor | None = _along(GROUP_TENSOR, default=None)  # bool [P, G]: external rows (external_mix)
    # advantage inputs the produce phase sampled for the estimator, by name (collect.py's SAMPLED_INPUTS)
    sampled_inputs: dict[str, Tensor] = _along(GROUP_TENSORS, default_factory=dict)
    rewards_PG: Tensor | None = _along(GROUP_TENSOR, default=None)  # the components' sum, shaped (set by collect)
    driver_state: object = _along(LAST, default=None)  # the driver's state after this batch (set by collect)
    # advantage inputs sampled for the kept groups, by name (collect.sample_inputs: ReMax's greedy baseline)
    sampled_inputs: dict[str, Tensor] = _along(GROUP_TENSORS, default_factory=dict)

    def select_groups(self, groups: list[int]) -> Batch:
        """The given groups, in that order, of every per-group field; what it took stays the whole batch's."""
        G = self.rollouts.n
        picked = {f.name: f.metadata["along"].pick(getattr(self, f.name), groups, G) for f in fields(self)
                  if f.metadata["along"].pick is not None and getattr(self, f.name) is not None}
        return replace(self, **picked)

    @classmethod
    def cat(cls, batches: list[Batch], pad_id: int) -> Batch:
        """The generation batches one after the other (rows right-padded to one width with ``pad_id``)."""
        joined = {}
        for f in fields(cls):
            values = [getattr(b, f.name) for b in batches]
            absent = all(v is None for v in values)  # an optional field no batch has
            joined[f.name] = None if absent else f.metadata["along"].join(values, pad_id)
        return cls(**joined)
