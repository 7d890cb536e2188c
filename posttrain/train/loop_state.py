"""Stateful components of the loop under one protocol: a stable key, ``load`` and ``advance``.

A history-aware estimator (A-GRAE, HA-DW, CAPO), a stateful shaper (TRAAC), AEnt's adaptive
entropy coefficient, the adaptive KL controller, RoRecomp's compensation buffer and a rollout
driver's own state (ReST-GRPO's queue) each keep something from step to step. Each registers a
:class:`Component` here; the loop loads every component's state from the checkpointed loop state
(``LoopState.entry_states[key]``) at the start of a step, hands it to the phase that uses it by
key, and advances every component with the step's :class:`StepRecord` at its end. Nothing else in
the loop knows which components a run has.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from torch import Tensor

from posttrain.algorithms import kl
from posttrain.config import Config
from posttrain.learn.parts import LearnParts
from posttrain.prepare.parts import PrepareParts
from posttrain.prepare.selectors import STATE_KEY as SELECTOR_KEY
from posttrain.produce.parts import ProduceParts


@dataclass(frozen=True)
class Phases:
    """Each phase's entries, bound from ``[algorithm]`` by the phase itself; the loop hands each phase its own."""

    produce: ProduceParts
    prepare: PrepareParts
    learn: LearnParts

    @classmethod
    def from_config(cls, cfg: Config) -> Phases:
        """Bind every phase's entries once, at set-up (the only place the loop reads entry names)."""
        a = cfg.algorithm
        return cls(ProduceParts.from_config(a), PrepareParts.from_config(a),
                   LearnParts.from_config(a, cfg.rollout.max_new_tokens))


@dataclass
class StepRecord:
    """What a step produced, for the components to advance with."""

    rewards_PG: Tensor  # shaped rewards of the trained groups
    raw_rewards_PG: Tensor  # unshaped (the sum of the weighted components)
    lengths_PG: Tensor
    update_metrics: dict[str, float] = field(default_factory=dict)
    kl_metrics: dict[str, float] = field(default_factory=dict)  # kl_reward/* of this step
    selector_state: dict | None = None  # the batch selector's state after this step
    driver_state: object = None  # the rollout driver's state after this step


@dataclass
class Component:
    """One stateful part: ``load(saved) -> live state``; ``advance(live, record) -> saved`` (plain,
    checkpointable values; ``None``: nothing to keep).
    """

    key: str
    load: Callable[[object], object]
    advance: Callable[[object, StepRecord], object]


def components(phases: Phases, driver: str) -> list[Component]:
    """The stateful components of this run's phases and rollout driver."""
    out: list[Component] = []
    prep, learn = phases.prepare, phases.learn
    if prep.advantage_state is not None:
        es = prep.advantage_state
        out.append(Component("advantage", es.load,
                             lambda st, r, es=es: es.advance(st, r.rewards_PG, {"lengths": r.lengths_PG})))
    for i, es in enumerate(phases.produce.shaper_states):
        if es is not None:  # a shaper's history is of the raw rewards
            out.append(Component(f"shaper{i}", es.load,
                                 lambda st, r, es=es: es.advance(st, r.raw_rewards_PG, {"lengths": r.lengths_PG})))
    if learn.entropy_state is not None:
        out.append(Component("entropy", learn.entropy_state.load, lambda st, r: _advance_entropy(learn, st, r)))
    if prep.kl_reward_target is not None:
        out.append(Component("kl_reward", lambda saved: float((saved or {}).get("coef", prep.kl_reward_coef)),
                             lambda coef, r: _advance_kl(prep, coef, r)))
    out.append(Component(SELECTOR_KEY, lambda saved: saved, lambda st, r: r.selector_state))
    out.append(Component(driver, lambda saved: saved, lambda st, r: r.driver_state))  # stateless: None
    return out


def load_all(rollouts: list[Component], saved: dict) -> dict[str, object]:
    """Every component's live state, by key."""
    return {c.key: c.load(saved.get(c.key)) for c in rollouts}


def advance_all(rollouts: list[Component], live: dict[str, object], record: StepRecord) -> dict:
    """The loop state's ``entry_states`` after this step (components with nothing to keep left out)."""
    out = {c.key: c.advance(live[c.key], record) for c in rollouts}
    return {k: v for k, v in out.items() if v is not None}


def shaper_states(parts: ProduceParts, live: dict[str, object]) -> list[object | None]:
    """The live state of each shaper, in order (``None`` for stateless ones)."""
    return [live.get(f"shaper{i}") for i in range(len(parts.shapers))]


def _advance_entropy(parts: LearnParts, state: object, r: StepRecord) -> dict | None:
    """AEnt: the coefficient moved by this step's ``entropy/regularized`` (the batch token-mean of
    the entropy it regularizes), unchanged when no update ran.
    """
    h = r.update_metrics.get("entropy/regularized")
    if h is None:
        return asdict(state) if state is not None else None
    return parts.entropy_state.advance(state, h, {})


def _advance_kl(parts: PrepareParts, coef: float, r: StepRecord) -> dict:
    """The adaptive KL controller (Ziegler et al. 2019, :func:`~posttrain.algorithms.kl.adaptive_kl_coef`)
    fed this step's ``kl_reward/kl`` over its responses.
    """
    kl_now = r.kl_metrics.get("kl_reward/kl", float("nan"))
    n = r.rewards_PG.numel()
    return {"coef": kl.adaptive_kl_coef(coef, kl_now, n, target=parts.kl_reward_target,
                                        horizon=parts.kl_reward_horizon)}
