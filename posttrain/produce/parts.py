"""The produce phase's entries, bound once at set-up from ``[algorithm]``: the reward shapers, the group
filter, the step scorer, and which advantage inputs it must sample (ReMax's greedy baseline, the reference
responses of PAR and A*-PO).

The inputs a run provides are decided here, on the lowest phase floor, because produce samples some of
them and prepare (``prepare/parts.py``) computes the rest: both read :func:`advantage_inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from posttrain.algorithms import advantages, loss_weights, selection, shaping
from posttrain.algorithms.stateful import EntryState, split_params
from posttrain.config.algorithm import AlgorithmConfig
from posttrain.config.base import TURN_INPUTS

# The advantage inputs that have a provider (prepare/providers.py) or are sampled (produce/collect.py), in the
# order they are computed (CANON's entropy metric reads the entropies; turn_values read the values, turn_ids and
# turn_mask).
PROVIDED_INPUTS = ("values", "entropies", "metric", "prompt_confidence", "token_rewards", "induced_rewards",
                   "baseline_rewards", "reference_rewards",
                   *(k for k in TURN_INPUTS if k != "turn_values"), "turn_values", "external")

# The provided inputs whose provider runs the frozen reference model: the Learner holds one when a run needs them.
REFERENCE_INPUTS = ("induced_rewards",)


@dataclass(frozen=True)
class ProduceParts:
    """What ``collect`` applies after the rollout driver: shapers, group filter, step scorer, sampled inputs."""

    shapers: tuple[partial, ...]  # shaping.compute bound to each shaper's name and own parameters, in order
    shaper_states: tuple[EntryState | None, ...]  # one per shaper (traac_length keeps history)
    group_filter: partial  # rewards [P, G] -> keep [P] (selection.select with its name and parameters)
    step_reward: tuple[str, dict] | None  # the step scorer (name, params) of process-reward shapers
    needs_ref_rewards: bool  # a shaper reads the rewards of reference responses (PAR)
    ref_reward_samples: int  # M sampled reference responses per prompt for those shapers (0: the demonstration)
    ref_samples: int  # reference responses to sample per prompt (produce/ref_samples.py): the shapers', A*-PO's
    inputs: tuple[str, ...]  # the advantage inputs this run provides (the sampled ones are made here)

    @classmethod
    def from_config(cls, a: AlgorithmConfig) -> ProduceParts:
        """Bind the shapers, the group filter and the step scorer named in ``[algorithm]``."""
        bound = [(sp.name, *split_params(shaping, sp.name, sp.params)) for sp in a.shapers]
        return cls(
            shapers=tuple(partial(shaping.compute, name, **own) for name, own, _ in bound),
            shaper_states=tuple(EntryState.of(shaping, name, upd) for name, _, upd in bound),
            group_filter=partial(selection.select, a.group_filter, **a.group_filter_params),
            step_reward=(a.step_reward, dict(a.step_reward_params)) if a.step_reward else None,
            needs_ref_rewards=any("ref_rewards" in shaping.REGISTRY.required(sp.name) for sp in a.shapers),
            ref_reward_samples=shaper_reference_samples(a),
            ref_samples=reference_samples(a),
            inputs=advantage_inputs(a),
        )


def shaper_reference_samples(a: AlgorithmConfig) -> int:
    """The most reference responses per prompt a shaper reading ``ref_rewards`` asks to be sampled (its
    ``samples`` parameter; PAR's M), 0 when they all score the example's demonstration instead.
    """
    wanted = [int(split_params(shaping, sp.name, sp.params)[0].get("samples", _default(shaping, sp.name, "samples")))
              for sp in a.shapers if "ref_rewards" in shaping.REGISTRY.required(sp.name)]
    return max(wanted, default=0)


def reference_samples(a: AlgorithmConfig) -> int:
    """Responses per prompt to sample from the frozen starting policy (``produce/ref_samples.py``): the most a
    shaper or the estimator (one requiring ``reference_rewards``, A*-PO's V*) asks for; 0: none.
    """
    estimator = 0
    if "reference_rewards" in advantages.REGISTRY.required(a.advantage):
        own = split_params(advantages, a.advantage, a.advantage_params)[0]
        estimator = int(own.get("samples", _default(advantages, a.advantage, "samples")))
    return max(shaper_reference_samples(a), estimator)


def advantage_inputs(a: AlgorithmConfig) -> tuple[str, ...]:
    """The inputs to provide, in dependency order: what the estimator and the loss weights require, the token
    entropies an entropy ``advantage_metric`` is built from, the KL penalty's ``token_rewards`` when the reward
    carries it, and the critic's values, turn ids and mask that ``turn_values`` are read from.
    """
    want = set(advantages.REGISTRY.required(a.advantage))
    want |= {k for s in a.loss_weights for k in loss_weights.inputs(s.name)}
    if a.kl_reward_coef > 0:
        want.add("token_rewards")
    if "metric" in want and a.advantage_metric == "entropy":
        want.add("entropies")
    if "turn_values" in want:  # the critic's token values, read at each reached turn's first token
        want |= {"values", "turn_ids", "turn_mask"}
    return tuple(n for n in PROVIDED_INPUTS if n in want)


def _default(module: object, name: str, param: str) -> float:
    """The default of keyword parameter ``param`` of entry ``name`` of ``module``'s registry (0 if it has none)."""
    return module.REGISTRY.default(name, param, 0)
