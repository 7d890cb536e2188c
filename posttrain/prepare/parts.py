"""The prepare phase's entries, bound once at set-up from ``[algorithm]``: the advantage estimator (and its
history, for a stateful one), the inputs its providers compute, and the KL penalty carried in the reward.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from torch import Tensor

from posttrain.algorithms import advantages, kl, loss_weights
from posttrain.algorithms.stateful import EntryState, split_params
from posttrain.config.algorithm import AlgorithmConfig
from posttrain.produce.parts import advantage_inputs


@dataclass(frozen=True)
class PrepareParts:
    """What ``prepare`` runs: the providers of ``inputs``, then the estimator, then the loss weights' row inputs."""

    advantage: partial  # advantage(rewards_PG, rewards_PGK, **inputs): picks what the estimator takes
    advantage_state: EntryState | None  # a history-aware estimator's updater (a_grae, ha_dw, capo)
    inputs: tuple[str, ...]  # advantage inputs to provide (prepare/providers.py), in dependency order
    metric: str | None  # the estimator regroups by a per-response metric (canon): "entropy" | "length"
    prompt_fraction: float  # ... over this share of its least likely tokens (prompt_confidence)
    kl_reward: partial | None  # the KL estimator of the penalty in the reward (kl_reward_coef > 0), else None
    kl_reward_coef: float  # its starting beta
    kl_reward_target: float | None  # the adaptive controller's target KL (None: beta stays fixed)
    kl_reward_horizon: int
    weight_row_inputs: tuple[str, ...]  # provided inputs a loss weight reads: handed to the update per row

    @classmethod
    def from_config(cls, a: AlgorithmConfig) -> PrepareParts:
        """Bind the estimator and the reward's KL penalty named in ``[algorithm]``."""
        own, upd = split_params(advantages, a.advantage, a.advantage_params)
        inputs = advantage_inputs(a)
        read = {k for s in a.loss_weights for k in loss_weights.inputs(s.name)}
        return cls(
            advantage=partial(_advantage, a.advantage, a.advantage in advantages.REWARD_COMPONENTS, own),
            advantage_state=EntryState.of(advantages, a.advantage, upd),
            inputs=inputs,
            metric=a.advantage_metric if "metric" in advantages.REGISTRY.required(a.advantage) else None,
            prompt_fraction=float(own.get("low_fraction", advantages.LOW_FRACTION)),
            kl_reward=partial(kl.estimate, a.kl_reward) if a.kl_reward_coef > 0 else None,
            kl_reward_coef=a.kl_reward_coef,
            kl_reward_target=a.kl_reward_target,
            kl_reward_horizon=a.kl_reward_horizon,
            weight_row_inputs=tuple(k for k in inputs if k in read),
        )


def _advantage(
    name: str, components: bool, params: dict, rewards_PG: Tensor, rewards_PGK: Tensor, **inputs: Tensor
) -> Tensor:
    """Apply estimator ``name`` to the summed rewards, or to the weighted components ``[P, G, K]``
    for multi-reward estimators (``advantages.REWARD_COMPONENTS``: GDPO, GD2PO).
    """
    return advantages.compute(name, rewards_PGK if components else rewards_PG, **params, **inputs)
