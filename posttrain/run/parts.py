"""The registry entries of a run, looked up once at set-up and bound to their parameters."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from functools import partial

from torch import Tensor

from posttrain.algorithms import advantages, aggregation, entropy, kl, loss_weights, losses, selection, shaping
from posttrain.algorithms.offpolicy import weights as correction_weights
from posttrain.algorithms.stateful import EntryState, split_params
from posttrain.config import Config
from posttrain.config.base import LOSS_INPUTS, TURN_INPUTS


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


@dataclass
class Parts:
    """The registry entries of this run, bound to their parameters once at set-up."""

    advantage: partial  # advantage(rewards_PG, rewards_PGK, **inputs): picks what the estimator takes
    loss: partial
    aggregate: partial
    kl: partial | None
    kl_coef: float
    kl_reward: partial | None  # the KL estimator of the penalty in the reward (kl_reward_coef > 0), else None
    kl_reward_coef: float  # its starting beta
    kl_reward_target: float | None  # the adaptive controller's target KL (None: beta stays fixed)
    kl_reward_horizon: int
    entropy: partial | None  # per-token entropy term from logits, added to the loss
    shapers: list[partial]
    group_filter: partial
    loss_inputs: tuple[str, ...]  # the LOSS_INPUTS this loss declares
    needs_ref: bool  # a frozen reference model is needed (KL term, or a loss that reads ref_logprobs)
    needs_ref_rewards: bool = False  # a shaper reads the rewards of the reference responses (PAR)
    par_samples: int = 0  # PAR's M sampled reference responses per prompt (0: the example's demonstration)
    ref_samples: int = 0  # reference responses to sample per prompt (produce/ref_samples.py): PAR's, A*-PO's
    inputs: tuple[str, ...] = ()  # advantage inputs to provide (prepare/providers.py), in dependency order
    advantage_state: EntryState | None = None  # a history-aware estimator's updater (a_grae, ha_dw, capo)
    metric: str | None = None  # the estimator regroups by a per-response metric (canon): "entropy" | "length"
    prompt_fraction: float = advantages.LOW_FRACTION  # ... over this share of its least likely tokens
    entropy_state: EntryState | None = None  # a stateful entropy regularizer's updater (AEnt's coefficient)
    entropy_measure: partial | None = None  # logits -> the H_t it regularizes, whose batch mean feeds the updater
    entropy_coef: float = 0.0  # the regularizer's configured (AEnt: starting) coefficient, for entropy/coef
    shaper_states: tuple[EntryState | None, ...] = ()  # one per shaper (traac_length keeps history)
    step_reward: tuple[str, dict] | None = None  # the step scorer (name, params) of process-reward shapers
    clip_band: tuple[float, float] = (0.2, 0.2)  # the loss's (eps_low, eps_high): ratio statistics, loss weights
    correction: partial | None = None  # (old, behaviour, mask) -> importance weights [N, T]; None: no correction
    loss_weights: tuple[LossWeight, ...] = ()  # per-token factors of the policy loss (algorithms/loss_weights.py)

    @property
    def needs_reference(self) -> bool:
        """A frozen reference is needed: the KL in the loss, a loss reading ref_logprobs, the KL in the
        reward, or responses sampled from it (PAR, A*-PO).
        """
        return self.needs_ref or self.kl_reward is not None or self.ref_samples > 0

    @property
    def weight_row_inputs(self) -> tuple[str, ...]:
        """The provided inputs (``inputs``) a loss weight reads: ``prepare`` hands them to the update per row."""
        read = {k for w in self.loss_weights for k in w.inputs}
        return tuple(k for k in self.inputs if k in read)

    @property
    def needs_values(self) -> bool:
        """The estimator reads a critic's V(s_t) (gae; turn_ppo through turn_values): the loop builds the critic."""
        return "values" in self.inputs

    @classmethod
    def from_config(cls, cfg: Config) -> Parts:
        """Look every entry up by its configured name (the only place the loop consults names)."""
        a = cfg.algorithm
        declared = losses.REGISTRY.params(a.loss)
        # a loss's `max_len` is the configured maximum response length (DRPO's L_max), not a batch's longest
        max_len = {"max_len": cfg.rollout.max_new_tokens} if "max_len" in declared else {}
        adv_own, adv_upd = split_params(advantages, a.advantage, a.advantage_params)
        adv_needs = advantages.REGISTRY.required(a.advantage)
        weights = tuple(LossWeight(s.name, partial(loss_weights.compute, s.name, **s.params),
                                   tuple(loss_weights.inputs(s.name))) for s in a.loss_weights)
        ent_own, ent_upd = split_params(entropy, a.entropy, a.entropy_params) if a.entropy else ({}, {})
        ent_state = EntryState.of(entropy, a.entropy, ent_upd) if a.entropy else None
        ent_coef = float(ent_own.get("coef", _default(entropy.REGISTRY.get(a.entropy), "coef"))) if a.entropy else 0.0
        shaper_parts = [(sp.name, *split_params(shaping, sp.name, sp.params)) for sp in a.shapers]
        par_samples = max((int(own.get("samples", 0)) for name, own, _ in shaper_parts if name == "par"), default=0)
        adv_samples = int(adv_own.get("samples", _default(advantages.REGISTRY.get(a.advantage), "samples") or 0)) \
            if "reference_rewards" in adv_needs else 0
        return cls(
            par_samples=par_samples,
            ref_samples=max(par_samples, adv_samples),
            entropy=partial(entropy.compute, a.entropy, **ent_own) if a.entropy else None,
            entropy_state=ent_state,
            entropy_measure=partial(entropy.measure, a.entropy, **ent_own) if ent_state else None,
            entropy_coef=ent_coef,
            shapers=[partial(shaping.compute, name, **own) for name, own, _ in shaper_parts],
            shaper_states=tuple(EntryState.of(shaping, name, upd) for name, _, upd in shaper_parts),
            advantage_state=EntryState.of(advantages, a.advantage, adv_upd),
            group_filter=partial(selection.select, a.group_filter, **a.group_filter_params),
            loss_inputs=tuple(k for k in LOSS_INPUTS if k in declared),
            needs_ref=a.kl_coef > 0 or "ref_logprobs" in losses.inputs(a.loss),
            advantage=partial(
                _advantage, a.advantage, a.advantage in advantages.REWARD_COMPONENTS, adv_own
            ),
            loss=partial(losses.compute, a.loss, **(max_len | a.loss_params)),
            aggregate=partial(aggregation.reduce, a.aggregation, **a.aggregation_params),
            kl=partial(kl.estimate, a.kl) if a.kl_coef > 0 else None,
            kl_coef=a.kl_coef,
            kl_reward=partial(kl.estimate, a.kl_reward) if a.kl_reward_coef > 0 else None,
            kl_reward_coef=a.kl_reward_coef,
            kl_reward_target=a.kl_reward_target,
            kl_reward_horizon=a.kl_reward_horizon,
            inputs=provided_inputs([*adv_needs, *(k for w in weights for k in w.inputs)],
                                   a.advantage_metric, a.kl_reward_coef > 0),
            loss_weights=weights,
            metric=a.advantage_metric if "metric" in adv_needs else None,
            prompt_fraction=float(adv_own.get("low_fraction", advantages.LOW_FRACTION)),
            step_reward=(a.step_reward, dict(a.step_reward_params)) if a.step_reward else None,
            clip_band=clip_band(a.loss, a.loss_params),
            needs_ref_rewards=any("ref_rewards" in shaping.REGISTRY.required(sp.name) for sp in a.shapers),
            correction=(partial(correction_weights, a.behaviour_correction, **a.behaviour_correction_params)
                        if a.behaviour_correction != "none" else None),
        )


# The advantage inputs that have a provider (prepare/providers.py), in the order they are computed
# (CANON's entropy metric reads the entropies; turn_values read the values, turn_ids and turn_mask).
PROVIDED_INPUTS = ("values", "entropies", "metric", "prompt_confidence", "token_rewards", "baseline_rewards",
                   "reference_rewards",
                   *(k for k in TURN_INPUTS if k != "turn_values"), "turn_values", "external")


def provided_inputs(required: list[str], metric: str, kl_in_reward: bool) -> tuple[str, ...]:
    """The inputs to provide for an estimator that requires ``required``: those, the token entropies
    an entropy ``metric`` is built from, and the KL penalty's ``token_rewards`` when it is on.
    """
    want = set(required) | ({"token_rewards"} if kl_in_reward else set())
    if "metric" in want and metric == "entropy":
        want.add("entropies")
    if "turn_values" in want:  # the critic's token values, read at each reached turn's first token
        want |= {"values", "turn_ids", "turn_mask"}
    return tuple(n for n in PROVIDED_INPUTS if n in want)


def _advantage(
    name: str, components: bool, params: dict, rewards_PG: Tensor, rewards_PGK: Tensor, **inputs: Tensor
) -> Tensor:
    """Apply estimator ``name`` to the summed rewards, or to the weighted components ``[P, G, K]``
    for multi-reward estimators (``advantages.REWARD_COMPONENTS``: GDPO, GD2PO).
    """
    return advantages.compute(name, rewards_PGK if components else rewards_PG, **params, **inputs)


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
