"""Selection: which prompts, groups and samples to train on.

Two kinds of functions live here.

* **Group filters** (the registry): ``select(name, rewards, **kwargs) -> keep [P] bool``.
  ``rewards`` is float ``[P, G]`` (P prompts, G completions each); ``keep[p]`` is True when group
  ``p`` goes on to training. Keyword arguments an entry does not declare are ignored, so the loop
  can pass everything it has. Entries: ``none``, ``dynamic_sampling`` (DAPO), ``rest_grpo``
  (ReST-RL), ``all_correct`` (NGRPO). The loop applies the chosen one (``algorithm.group_filter``) to
  every generation batch in collection (``posttrain/produce/collect.py``).
* **Samplers and bookkeeping** with other outputs, each documented where it is defined: the DAPO
  accumulator (``dynamic_sampling_step``), ReST-GRPO prefix sampling, Shuffle-R1 pairs and
  shuffle, RoRecomp priority/compensation batches, HINT's re-roll decision and hint prompt, the
  pass-rate history with 1-shot RLVR's historical-variance ranking, and the high-entropy token mask.
  Where the loop uses them:

  - Shuffle-R1 and RoRecomp: batch selectors (``algorithm.batch_selector``,
    ``posttrain/prepare/selectors.py``; their parameters and check are ``selectors`` here);
  - HINT's re-roll: a rollout driver (``rollout.driver = "hint_reroll"``,
    ``posttrain/produce/drivers/hint.py``);
  - ReST-GRPO's prefixes: online, in the ``partial_states`` rollout driver
    (``posttrain/produce/drivers/partial_states.py``; the paper builds them offline between rounds);
  - the pass-rate history and its ranking: offline, on a run's ``prompt_stats.jsonl``
    (``posttrain rank-prompts``, ``posttrain/train/prompt_stats.py``);
  - the high-entropy mask: the ``top_entropy`` loss weight (``posttrain/algorithms/loss_weights.py``).

  ``rest_prefix_weights`` and ``dynamic_sampling_step`` are library-only (the loop's DAPO filter
  accumulates groups itself, ``posttrain/produce/collect.py``).

Everything is pure: tensors in, tensors / index lists out. Stateful methods take and return a
frozen dataclass; randomness comes only from an explicit ``torch.Generator``.

Modules (the package re-exports every name: callers use ``selection.X``, not the modules):

- ``_common``: ``REGISTRY``, ``register``, ``names``, ``GroupFilter`` and the helpers
  ``_check_rewards``, ``_spread_PG``.
- ``filters``: the group filters ``keep_all`` (``none``), ``dynamic_sampling``, ``rest_grpo``,
  ``all_correct``; the DAPO accumulator ``DynamicSamplingState``, ``dynamic_sampling_step``,
  ``StopReason``.
- ``rest_prefixes``: ReST-GRPO ``rest_partial_state_mask``, ``line_prefixes``,
  ``rest_prefix_weights``, ``rest_sample_prefixes``.
- ``shuffle_r1``: ``PairSelection``, ``PairWeight``, ``pairwise_trajectory_sampling``,
  ``shuffle_probabilities``, ``advantage_batch_shuffle``.
- ``rorecomp``: ``rorecomp_priority_mask``, ``CompensationBuffer``, ``compensation_push``,
  ``compensation_draw``.
- ``hint``: ``HINT_PREAMBLE``, ``hint_reroll_mask``, ``hint_prompt``.
- ``pass_rate``: ``PromptId``, ``PassRateHistory``, ``update``, ``record``, ``pass_rate_std``,
  ``rank_by_historical_variance``.
- ``entropy_tokens``: ``high_entropy_mask`` (imported from the module, not re-exported).
- ``selectors``: ``SELECTORS`` and ``check_selector``, the batch selectors' parameters and the
  config's check of them (imported from the module; the selectors run in ``prepare/selectors.py``).
"""

from __future__ import annotations

from torch import Tensor

# isort: off
# Imported in the order of the single-file module, so REGISTRY keeps the same insertion order.
from posttrain.algorithms.selection._common import (
    REGISTRY,
    GroupFilter,
    names,
    register,
    _check_rewards as _check_rewards,
    _spread_PG as _spread_PG,
)
from posttrain.algorithms.selection.filters import (
    DynamicSamplingState,
    StopReason,
    all_correct,
    dynamic_sampling,
    dynamic_sampling_step,
    keep_all,
    rest_grpo,
)
from posttrain.algorithms.selection.rest_prefixes import (
    line_prefixes,
    rest_partial_state_mask,
    rest_prefix_weights,
    rest_sample_prefixes,
)
from posttrain.algorithms.selection.shuffle_r1 import (
    PairSelection,
    PairWeight,
    advantage_batch_shuffle,
    pairwise_trajectory_sampling,
    shuffle_probabilities,
)
from posttrain.algorithms.selection.rorecomp import (
    CompensationBuffer,
    compensation_draw,
    compensation_push,
    rorecomp_priority_mask,
)
from posttrain.algorithms.selection.hint import HINT_PREAMBLE, hint_prompt, hint_reroll_mask
from posttrain.algorithms.selection.pass_rate import (
    PassRateHistory,
    PromptId,
    pass_rate_std,
    rank_by_historical_variance,
    record,
    update,
)
# isort: on

__all__ = [
    "HINT_PREAMBLE",
    "REGISTRY",
    "CompensationBuffer",
    "DynamicSamplingState",
    "GroupFilter",
    "PairSelection",
    "PairWeight",
    "PassRateHistory",
    "PromptId",
    "StopReason",
    "advantage_batch_shuffle",
    "all_correct",
    "compensation_draw",
    "compensation_push",
    "dynamic_sampling",
    "dynamic_sampling_step",
    "hint_prompt",
    "hint_reroll_mask",
    "keep_all",
    "line_prefixes",
    "names",
    "pairwise_trajectory_sampling",
    "pass_rate_std",
    "rank_by_historical_variance",
    "register",
    "rest_grpo",
    "rest_partial_state_mask",
    "rest_prefix_weights",
    "rest_sample_prefixes",
    "rorecomp_priority_mask",
    "select",
    "shuffle_probabilities",
    "record",
    "update",
]


def select(name: str, rewards: Tensor, **kwargs: object) -> Tensor:
    """Apply group filter ``name`` to ``rewards [P, G]`` and return the keep mask ``[P]`` bool.

    Keyword arguments the filter does not declare are ignored; those it declares are passed on.
    """
    fn = REGISTRY.get(name)
    return fn(_check_rewards(rewards), **REGISTRY.declared(name, kwargs))
