"""The registry entries of a run, looked up once at set-up and bound to their parameters."""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass
from functools import partial

from torch import Tensor

from posttrain.algorithms import advantages, aggregation, entropy, kl, losses, selection, shaping
from posttrain.algorithms.stateful import EntryState, split_params
from posttrain.config import LOSS_INPUTS, Config


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
    needs_entropies: bool = False  # the estimator shapes advantages with token entropies (entropy_adv)
    needs_baseline_rewards: bool = False  # the estimator subtracts the greedy response's reward (ReMax)
    needs_values: bool = False  # the estimator reads a critic's V(s_t) (gae): the loop builds the critic
    advantage_state: EntryState | None = None  # a history-aware estimator's updater (a_grae, ha_dw, capo)
    metric: str | None = None  # the estimator regroups by a per-response metric (canon): "entropy" | "length"
    needs_prompt_confidence: bool = False  # the estimator reads the prompt's confidence c(q) (progrpo)
    prompt_fraction: float = advantages.LOW_FRACTION  # ... over this share of its least likely tokens
    entropy_state: EntryState | None = None  # a stateful entropy regularizer's updater (AEnt's coefficient)
    entropy_measure: partial | None = None  # logits -> the H_t it regularizes, whose batch mean feeds the updater
    entropy_coef: float = 0.0  # the regularizer's configured (AEnt: starting) coefficient, for entropy/coef
    shaper_states: tuple[EntryState | None, ...] = ()  # one per shaper (traac_length keeps history)
    aapo_lambda: float = 0.0  # HINT's AAPO exponent for re-rolled groups' loss (0: off)
    step_reward: tuple[str, dict] | None = None  # the step scorer (name, params) of process-reward shapers
    clip_band: tuple[float, float] = (0.2, 0.2)  # the loss's (eps_low, eps_high): ratio statistics, AAPO's band

    @classmethod
    def from_config(cls, cfg: Config) -> Parts:
        """Look every entry up by its configured name (the only place the loop consults names)."""
        a = cfg.algorithm
        declared = losses.REGISTRY.params(a.loss)
        adv_own, adv_upd = split_params(advantages, a.advantage, a.advantage_params)
        adv_needs = advantages.REGISTRY.required(a.advantage)
        ent_own, ent_upd = split_params(entropy, a.entropy, a.entropy_params) if a.entropy else ({}, {})
        ent_state = EntryState.of(entropy, a.entropy, ent_upd) if a.entropy else None
        ent_coef = float(ent_own.get("coef", _default(entropy.REGISTRY.get(a.entropy), "coef"))) if a.entropy else 0.0
        shaper_parts = [(sp.name, *split_params(shaping, sp.name, sp.params)) for sp in a.shapers]
        return cls(
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
            loss=partial(losses.compute, a.loss, **a.loss_params),
            aggregate=partial(aggregation.reduce, a.aggregation, **a.aggregation_params),
            kl=partial(kl.estimate, a.kl) if a.kl_coef > 0 else None,
            kl_coef=a.kl_coef,
            kl_reward=partial(kl.estimate, a.kl_reward) if a.kl_reward_coef > 0 else None,
            kl_reward_coef=a.kl_reward_coef,
            kl_reward_target=a.kl_reward_target,
            kl_reward_horizon=a.kl_reward_horizon,
            needs_entropies="entropies" in adv_needs or ("metric" in adv_needs and a.advantage_metric == "entropy"),
            metric=a.advantage_metric if "metric" in adv_needs else None,
            needs_prompt_confidence="prompt_confidence" in adv_needs,
            prompt_fraction=float(adv_own.get("low_fraction", advantages.LOW_FRACTION)),
            needs_baseline_rewards="baseline_rewards" in advantages.REGISTRY.required(a.advantage),
            needs_values="values" in advantages.REGISTRY.required(a.advantage),
            aapo_lambda=float(getattr(cfg.rollout.params(), "affinity_lambda", 0.0)),
            step_reward=(a.step_reward, dict(a.step_reward_params)) if a.step_reward else None,
            clip_band=clip_band(a.loss, a.loss_params),
            needs_ref_rewards=any("ref_rewards" in shaping.REGISTRY.required(sp.name) for sp in a.shapers),
        )


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


def load_states(parts: Parts, saved: dict) -> tuple[object | None, list[object | None]]:
    """The state objects of the stateful advantage and shapers from the loop state's dicts."""
    adv = parts.advantage_state.load(saved.get("advantage")) if parts.advantage_state else None
    shapers = [es.load(saved.get(f"shaper{i}")) if es else None for i, es in enumerate(parts.shaper_states)]
    return adv, shapers


def advance_states(
    parts: Parts,
    adv_state: object | None,
    shaper_states: list[object | None],
    rewards_PG: Tensor,
    raw_rewards_PG: Tensor,
    lengths_PG: Tensor,
) -> dict:
    """Fold this step into every state (advantage: the shaped rewards it saw; shapers: the raw
    ones); returns the loop state's dict form.
    """
    out: dict = {}
    inputs = {"lengths": lengths_PG}
    if parts.advantage_state is not None:
        out["advantage"] = parts.advantage_state.advance(adv_state, rewards_PG, inputs)
    for i, (es, st) in enumerate(zip(parts.shaper_states, shaper_states, strict=True)):
        if es is not None:
            out[f"shaper{i}"] = es.advance(st, raw_rewards_PG, inputs)
    return out


def load_entropy_state(parts: Parts, saved: dict) -> object | None:
    """A stateful entropy regularizer's state (AEnt's coefficient) from the loop state's dict."""
    return parts.entropy_state.load(saved.get("entropy")) if parts.entropy_state else None


def advance_entropy_state(parts: Parts, state: object | None, update_metrics: dict[str, float]) -> dict:
    """``{"entropy": state}`` advanced with this step's ``entropy/regularized`` (the batch token-mean
    of the regularized entropy, from the update), unchanged when no update ran; ``{}`` if stateless.
    """
    if parts.entropy_state is None:
        return {}
    h = update_metrics.get("entropy/regularized")
    if h is None:
        return {"entropy": asdict(state)} if state is not None else {}
    return {"entropy": parts.entropy_state.advance(state, h, {})}


def load_kl_coef(parts: Parts, saved: dict) -> float:
    """The KL-in-the-reward coefficient for this step: the adaptive controller's, kept in the loop
    state, or the configured ``kl_reward_coef``.
    """
    return float(saved.get("kl_reward", {}).get("coef", parts.kl_reward_coef))


def advance_kl_coef(parts: Parts, coef: float, kl_metrics: dict[str, float], n_responses: int) -> dict:
    """``{"kl_reward": {"coef": next beta}}`` from the adaptive controller (Ziegler et al. 2019,
    :func:`~posttrain.algorithms.kl.adaptive_kl_coef`) fed this step's ``kl_reward/kl``; ``{}``
    when beta is fixed.
    """
    if parts.kl_reward_target is None:
        return {}
    kl_now = kl_metrics.get("kl_reward/kl", float("nan"))
    nxt = kl.adaptive_kl_coef(coef, kl_now, n_responses, target=parts.kl_reward_target, horizon=parts.kl_reward_horizon)
    return {"kl_reward": {"coef": nxt}}
