"""The learn phase's entries, bound once at set-up from ``[algorithm]``: the policy loss, its aggregation, the
per-token loss weights, the behaviour correction, the KL term and the entropy regularizer, and which models the
Learner must hold beside the policy (a frozen reference, a critic).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial
from typing import Literal

from posttrain.algorithms import aggregation, entropy, kl, loss_weights, losses
from posttrain.algorithms.offpolicy import REGISTRY as CORRECTIONS
from posttrain.algorithms.offpolicy import weights as correction_weights
from posttrain.algorithms.stateful import EntryState, split_params
from posttrain.config.algorithm import AlgorithmConfig
from posttrain.config.base import LOSS_INPUTS
from posttrain.produce.parts import REFERENCE_INPUTS, advantage_inputs, reference_samples


@dataclass(frozen=True)
class LossWeight:
    """A chosen per-token loss weight (``algorithm.loss_weights``) bound to its parameters."""

    name: str
    weigh: partial  # (**inputs) -> [N, T]: loss_weights.compute with its name and parameters
    inputs: tuple[str, ...]  # the inputs it reads, by loss_weights.INPUTS names

    @property
    def per_pass(self) -> bool:
        """It reads the policy being trained: computed in every micro-batch's forward pass, else once an update."""
        return any(k in loss_weights.CURRENT_POLICY for k in self.inputs)


@dataclass(frozen=True)
class LearnParts:
    """What the update runs on each micro-batch, and the models the Learner holds for it."""

    loss: partial  # losses.compute bound to the loss's name and parameters
    aggregate: partial  # (loss_NT, mask_NT) -> scalar
    loss_inputs: tuple[str, ...]  # the LOSS_INPUTS this loss declares
    loss_weights: tuple[LossWeight, ...]  # per-token factors of the policy loss (algorithms/loss_weights.py)
    correction: partial | None  # (old, behaviour, mask) -> importance weights [N, T]; None: no correction
    clip_band: tuple[float, float]  # the loss's (eps_low, eps_high): ratio statistics, loss weights
    kl: partial | None  # the KL estimator of the loss's KL term (kl_coef > 0), else None
    kl_coef: float
    entropy: partial | None  # per-token entropy term from logits, added to the loss
    entropy_state: EntryState | None  # a stateful entropy regularizer's updater (AEnt's coefficient)
    entropy_measure: partial | None  # logits -> the H_t it regularizes, whose batch mean feeds the updater
    entropy_coef: float  # the regularizer's configured (AEnt: starting) coefficient, for entropy/coef
    needs_ref: bool  # the update reads the reference's log-probs (the KL term, a loss reading ref_logprobs or ref_*)
    needs_reference: bool  # a frozen reference is held at all: the update's, the reward's KL, its samples, an input's
    needs_values: bool  # the estimator reads a critic's V(s_t) (gae; turn_ppo): the Learner builds the critic
    # what the update's own minibatches are drawn in: "group" when the loss or a loss weight is row_coupled (its
    # term over a group is exact only with the whole group in one minibatch), else "row"
    minibatch_unit: Literal["row", "group"] = "row"

    @classmethod
    def from_config(cls, a: AlgorithmConfig, max_new_tokens: int) -> LearnParts:
        """Bind the loss and its terms named in ``[algorithm]``; a loss's ``max_len`` is ``max_new_tokens``, the
        configured maximum response length (DRPO's L_max), not a batch's longest, unless ``loss_params`` sets it.
        """
        declared = losses.REGISTRY.params(a.loss)
        max_len = {"max_len": max_new_tokens} if "max_len" in declared else {}
        ent_own, ent_upd = split_params(entropy, a.entropy, a.entropy_params) if a.entropy else ({}, {})
        ent_state = EntryState.of(entropy, a.entropy, ent_upd) if a.entropy else None
        needs_ref = a.kl_coef > 0 or any(k.startswith("ref_") for k in losses.inputs(a.loss))
        return cls(
            loss=partial(losses.compute, a.loss, **(max_len | a.loss_params)),
            aggregate=partial(aggregation.reduce, a.aggregation, **a.aggregation_params),
            loss_inputs=tuple(k for k in LOSS_INPUTS if k in declared),
            loss_weights=tuple(LossWeight(s.name, partial(loss_weights.compute, s.name, **s.params),
                                          tuple(loss_weights.inputs(s.name))) for s in a.loss_weights),
            # a correction that reads no sampler log-probs weighs every token 1: nothing to multiply in
            correction=(partial(correction_weights, a.behaviour_correction, **a.behaviour_correction_params)
                        if CORRECTIONS.traits(a.behaviour_correction).reads_behaviour else None),
            clip_band=clip_band(a.loss, a.loss_params),
            kl=partial(kl.estimate, a.kl) if a.kl_coef > 0 else None,
            kl_coef=a.kl_coef,
            entropy=partial(entropy.compute, a.entropy, **ent_own) if a.entropy else None,
            entropy_state=ent_state,
            entropy_measure=partial(entropy.measure, a.entropy, **ent_own) if ent_state else None,
            entropy_coef=float(ent_own.get("coef", _default(entropy.REGISTRY.get(a.entropy), "coef")))
            if a.entropy else 0.0,
            needs_ref=needs_ref,
            needs_reference=needs_ref or a.kl_reward_coef > 0 or reference_samples(a) > 0
            or any(k in REFERENCE_INPUTS for k in advantage_inputs(a)),
            needs_values="values" in advantage_inputs(a),
            minibatch_unit="group" if losses.REGISTRY.traits(a.loss).row_coupled or any(
                loss_weights.REGISTRY.traits(s.name).row_coupled for s in a.loss_weights) else "row",
        )


def clip_band(loss: str, params: dict) -> tuple[float, float]:
    """The loss's clip band (eps_low, eps_high): its configured parameters, else its own defaults,
    else PPO's 0.2 (losses without a band; the ratio statistics still need one).
    """
    sig = inspect.signature(losses.REGISTRY.get(loss)).parameters

    def band(key: str) -> float:
        return float(params.get(key, sig[key].default if key in sig else 0.2))

    return band("eps_low"), band("eps_high")


def _default(fn: object, name: str) -> float:
    """The default of keyword parameter ``name`` of ``fn``."""
    return float(inspect.signature(fn).parameters[name].default)
