"""Advantage estimators: rewards ``[P, G]`` (+ named extra inputs) -> advantages.

Contract (``DESIGN.md``): ``compute(name, rewards, **kwargs)``. ``rewards`` is float ``[P, G]``
(P prompts, G completions per prompt). Extra inputs arrive by documented names (``lengths``,
``mask``, ``logprobs``, ``entropies``, ``values``, ``token_rewards``, ``state``); each estimator
accepts the ones it needs and ignores the rest, so the loop can pass what it has without knowing
which estimator it runs. Sequence-level estimators return ``[P, G]``; token-level ones
``[P, G, T]``. Outputs never carry gradient.

Conventions shared by the entries below:

- *Correct* means ``reward > CORRECT_THRESHOLD`` (0.5). This reads binary ``{0, 1}`` and
  ``{-1, 1}`` verifier rewards alike, and a correctness reward plus a small format bonus. Entries
  that count correct responses (pass rate, polarity) say so in their docstring.
- A group of one (``G == 1``) has no group baseline: group-relative entries return 0 for it, unless
  the method brings an outside baseline (``remax``'s greedy reward, ``ngrpo``'s virtual sample)
  or is not group-relative (``nsr``, ``w_reinforce``). verl instead uses mean 0 / std 1 for a
  singleton group; the difference only matters for a group of one.
- Token-level entries return ``[P, G, T]`` already multiplied by ``mask`` (0 on padding).
- Token rewards: the sequence reward ``rewards [P, G]`` is placed on the last response token (the
  last position where ``mask`` is 1); ``token_rewards [P, G, T]``, when given, are *added* per
  token (e.g. a KL penalty ``-beta * k1`` or process rewards). Do not also put the outcome score in
  ``token_rewards``: it would count twice.
- Stateful entries (``a_grae``, ``ha_dw``, ``capo``) take ``state`` (a frozen dataclass; ``None``
  means the initial state), read it, and return only the advantages, so ``compute`` keeps its one
  Tensor result. The caller advances the state after the step with the pure function
  ``<name>_update_state(state, rewards, ...) -> State`` of this module::

      adv = advantages.compute("ha_dw", rewards, state=st)
      st = advantages.ha_dw_update_state(st, rewards)

- Extra inputs beyond the DESIGN list, by name: ``metric [P, G]`` (``canon``),
  ``baseline_rewards [P]`` (``remax``), ``prompt_confidence [P]`` and ``answer_confidence [P, G]``
  (``progrpo``); multi-reward entries (``gdpo``, ``gd2po``) take ``rewards [P, G, K]``. Turn-level
  entries (``turns``) take, per turn of a K-turn episode, ``turn_rewards``, ``turn_mask``,
  ``state_ids``, ``agent_ids``, ``expert_match`` ``[P, G, K]``, ``turn_values`` ``[P, G, K + 1]``
  (``hiper``: ``turn_values_low``, ``turn_values_high``, ``switch``, optional ``subgoal_mask
  [P, G, T]``), and ``turn_ids [P, G, T]`` (the turn of each sampled token, -1 on context). The RL
  loop computes ``metric``, ``prompt_confidence`` and ``entropies`` only for an estimator that
  requires them (``posttrain/prepare/providers.py``).

Modules (the package re-exports every name: callers use ``advantages.X``, not the modules):

- ``_common``: ``REGISTRY``, ``register``, ``names``, ``StdMode``, ``CORRECT_THRESHOLD``, and the
  helpers ``_group_std``, ``_correct``, ``_whiten``, ``_token_rewards``, ``_to_tokens``.
- ``group``: group baselines ``grpo``, ``dr_grpo``, ``rloo``, ``opo``, ``grpo_passk``, ``remax``,
  ``grpo_onpolicy_stats`` (RL-PLUS: statistics of the on-policy samples, ``external [P, G]``), ``a_star``
  and its ``optimal_value`` (A*-PO's V*), ``aapo_momentum`` (GRPO plus a clipped margin over a reference response).
- ``token``: ``reinforce_pp``, ``reinforce_pp_baseline``, ``gae``, ``tf_reward`` (its ``induced_rewards
  [P, G, T]`` from ``induced_token_rewards``); ``discounted_returns`` and ``gae_advantages_and_returns``.
- ``reweight``: other group baselines and rescalings ``qae``, ``ngrpo``, ``mapo``, ``f_grpo``,
  ``passk``.
- ``signals``: entries that read a signal beyond the reward: ``lens``, ``ddca``, ``canon``,
  ``progrpo`` (with ``low_prob_confidence``, ``LOW_FRACTION``), ``entropy_adv``, ``a3po``.
- ``history``: the stateful ``a_grae``, ``ha_dw``, ``capo``, their ``State`` classes and updaters.
- ``negative``: negative-sample variants ``grpo_n``, ``nsr``, ``w_reinforce``.
- ``multi_reward``: ``gdpo``, ``gd2po`` and ``REWARD_COMPONENTS``.
- ``turns``: turn-level estimators of multi-turn episodes ``trloo``, ``gigpo``, ``mars_turn``,
  ``uis1``; each has a pure ``<name>_turns`` (one advantage per turn, ``[P, G, K]``) and returns
  tokens ``[P, G, T]`` through ``broadcast_turns``; shared helpers ``turn_returns``, ``group_center``.
- ``turns_critic``: the turn-level estimators that read a critic, ``turn_ppo`` (``turn_gae``) and
  ``hiper`` (``hiper_turns``), and where a turn's value is read and fit (``turn_starts``,
  ``turn_start_values``, ``turn_start_targets``).
"""

from __future__ import annotations

import torch
from torch import Tensor

# isort: off
# Imported in the order the estimators were registered in the single-file module, so REGISTRY
# keeps the same insertion order (``names()`` is sorted either way).
from posttrain.algorithms.advantages._common import (
    CORRECT_THRESHOLD,
    REGISTRY,
    StdMode,
    names,
    register,
    _correct as _correct,
    _group_std as _group_std,
    _to_tokens as _to_tokens,
    _token_rewards as _token_rewards,
    _whiten as _whiten,
)
from posttrain.algorithms.advantages.group import (
    dr_grpo,
    grpo,
    grpo_onpolicy_stats,
    grpo_passk,
    opo,
    optimal_value,
    remax,
    rloo,
)
from posttrain.algorithms.advantages.token import (
    discounted_returns,
    gae,
    gae_advantages_and_returns,
    induced_token_rewards,
    reinforce_pp,
    reinforce_pp_baseline,
    tf_reward,
)
from posttrain.algorithms.advantages.reweight import f_grpo, mapo, ngrpo, passk, qae, _comb_ratio as _comb_ratio
from posttrain.algorithms.advantages.signals import (
    LOW_FRACTION,
    a3po,
    canon,
    ddca,
    entropy_adv,
    lens,
    low_prob_confidence,
    progrpo,
)
from posttrain.algorithms.advantages.history import (
    AGRAEState,
    CAPOState,
    HADWState,
    a_grae,
    a_grae_update_state,
    capo,
    capo_update_state,
    ha_dw,
    ha_dw_update_state,
)
from posttrain.algorithms.advantages.negative import grpo_n, nsr, w_reinforce
from posttrain.algorithms.advantages.multi_reward import (
    REWARD_COMPONENTS,
    gd2po,
    gdpo,
    _per_reward_grpo as _per_reward_grpo,
    _sequence_weights as _sequence_weights,
)
from posttrain.algorithms.advantages.turns import (
    broadcast_turns,
    gigpo,
    gigpo_turns,
    group_center,
    mars_turn,
    mars_turns,
    trloo,
    trloo_turns,
    turn_returns,
    uis1,
    uis1_turns,
)
from posttrain.algorithms.advantages.turns_critic import (
    hiper,
    hiper_turns,
    turn_gae,
    turn_ppo,
    turn_start_targets,
    turn_start_values,
    turn_starts,
)
# isort: on

__all__ = [
    "AGRAEState",
    "CAPOState",
    "CORRECT_THRESHOLD",
    "HADWState",
    "LOW_FRACTION",
    "REGISTRY",
    "REWARD_COMPONENTS",
    "StdMode",
    "a3po",
    "a_grae",
    "a_grae_update_state",
    "broadcast_turns",
    "canon",
    "capo",
    "capo_update_state",
    "compute",
    "ddca",
    "discounted_returns",
    "dr_grpo",
    "entropy_adv",
    "f_grpo",
    "gae",
    "gae_advantages_and_returns",
    "gd2po",
    "gdpo",
    "gigpo",
    "gigpo_turns",
    "group_center",
    "grpo",
    "grpo_n",
    "grpo_onpolicy_stats",
    "grpo_passk",
    "ha_dw",
    "ha_dw_update_state",
    "hiper",
    "hiper_turns",
    "induced_token_rewards",
    "lens",
    "low_prob_confidence",
    "mapo",
    "mars_turn",
    "mars_turns",
    "names",
    "ngrpo",
    "nsr",
    "opo",
    "optimal_value",
    "passk",
    "progrpo",
    "qae",
    "register",
    "reinforce_pp",
    "reinforce_pp_baseline",
    "remax",
    "rloo",
    "tf_reward",
    "trloo",
    "trloo_turns",
    "turn_gae",
    "turn_ppo",
    "turn_returns",
    "turn_start_targets",
    "turn_start_values",
    "turn_starts",
    "uis1",
    "uis1_turns",
    "w_reinforce",
]


def compute(name: str, rewards: Tensor, **kwargs: object) -> Tensor:
    """Look up estimator ``name`` and apply it to ``rewards [P, G]``.

    Keyword arguments the estimator does not declare are ignored, so callers may pass every
    extra input they have (``lengths``, ``mask``, ...). Parameters it does declare are checked.
    """
    fn = REGISTRY.get(name)
    if rewards.dim() < 2:
        raise ValueError(f"rewards must be [P, G] (or [P, G, K]); got shape {tuple(rewards.shape)}")
    with torch.no_grad():
        return fn(rewards.float(), **REGISTRY.declared(name, kwargs))
