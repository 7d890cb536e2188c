"""The one generic check over the registry entries a run chooses (:func:`check_entries`, from :class:`Config`).

Every registry entry declares at registration what it needs and what it cannot run with
(:class:`~posttrain.algorithms.registry.Traits`: ``REGISTRY.register("drpo", row_coupled=True, note=...)``).
:func:`chosen_entries` lists the entries a config chooses as (config key, registry, name), and each rule
below reads one trait of them against the config's settings or against each other. A refusal names both
keys, both values and the entry's ``note``. A new method declares its traits; it adds no rule here.

- ``async_safe = False``: not with ``rollout.max_staleness > 0`` (a producer running ahead of the learner).
- ``row_coupled``: not with ``train.micro_batch_tokens > 0`` (a micro-batch holds part of a minibatch), nor with a
  batch selector of ``plans_minibatches`` (its minibatches cut groups apart; the update's own keep them whole).
- ``aggregation``: ``algorithm.aggregation`` must be that one.
- ``drivers`` / ``engines``: ``rollout.driver`` / ``rollout.engine`` must be one of them.
- ``replays_rows`` (a batch selector): not with an entry whose rows it cannot store (``replayable = False``).
- ``reads_behaviour`` (and ``algorithm.old_logprobs = 'behaviour'``): not with a driver of ``external_rows``,
  whose external rows no sampler drew; an entry that requires the input ``external`` needs such a driver.
- ``one_process``: not with LoRA, learner ranks, Ray, an engine other than hf, or ``max_staleness > 0``.
- ``needs_critic``: refuses nothing; :func:`needs_critic` tells the loop to build the critic.

The rollout drivers (``produce/``) and the batch selectors (``prepare/``) register on floors above the
config's, so they are imported when a config is checked (:func:`driver_registry`, :func:`selector_registry`),
never when this package is. A driver also declares its options and what no trait says
(``produce.drivers.DriverSpec``: runs the task's environment, its own check): :func:`check_driver`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from posttrain.algorithms.registry import Registry, Traits
from posttrain.algorithms.selection.selectors import check_selector
from posttrain.config.algorithm import REGISTRIES
from posttrain.errors import unknown_name

if TYPE_CHECKING:
    from posttrain.config.root import Config
    from posttrain.produce.drivers import DriverSpec


@dataclass(frozen=True)
class Chosen:
    """One entry a config chooses: the key that chooses it, its registry and its name."""

    key: str
    registry: Registry
    name: str

    @property
    def traits(self) -> Traits:
        """What the entry declared at registration (its name is known: the sections checked it)."""
        return self.registry.traits(self.name)

    @property
    def why(self) -> str:
        """The entry's note in parentheses, for a refusal ("" when it gave none)."""
        return f" ({self.traits.note})" if self.traits.note else ""

    def __str__(self) -> str:
        return f"{self.key} = {self.name!r}"


def driver_registry() -> tuple[Registry, dict[str, DriverSpec]]:
    """The rollout drivers and their specs (importing ``produce`` registers every driver)."""
    from posttrain.produce.drivers import DRIVERS, SPECS

    return DRIVERS, SPECS


def selector_registry() -> Registry:
    """The batch selectors (``prepare/selectors.py``)."""
    from posttrain.prepare.selectors import REGISTRY

    return REGISTRY


def chosen_entries(cfg: Config) -> list[Chosen]:
    """Every registry entry ``cfg`` chooses, as (config key, registry, name); an optional entry (entropy,
    the KL estimators, the step reward, the environment) only when the config turns it on.
    """
    from posttrain.envs.base import ENVS
    from posttrain.rewards import REGISTRY as REWARDS
    from posttrain.rewards.steps import REGISTRY as STEP_REWARDS

    a, r = cfg.algorithm, cfg.rollout
    out = [Chosen("rollout.driver", driver_registry()[0], r.driver)]
    out += [Chosen(f"reward[{i}].name", REWARDS, s.name) for i, s in enumerate(cfg.reward)]
    out += [Chosen(f"algorithm.shapers[{i}]", REGISTRIES["shapers"], s.name) for i, s in enumerate(a.shapers)]
    out += [Chosen(f"algorithm.{key}", REGISTRIES[key], getattr(a, key))
            for key in ("group_filter", "advantage", "loss", "aggregation", "behaviour_correction", "parameterization")]
    out.append(Chosen("algorithm.batch_selector", selector_registry(), a.batch_selector))
    out += [Chosen(f"algorithm.loss_weights[{i}]", REGISTRIES["loss_weights"], s.name)
            for i, s in enumerate(a.loss_weights)]
    optional = (("entropy", a.entropy is not None), ("kl", a.kl_coef > 0), ("kl_reward", a.kl_reward_coef > 0))
    out += [Chosen(f"algorithm.{key}", REGISTRIES[key], getattr(a, key)) for key, on in optional if on]
    if a.step_reward is not None:
        out.append(Chosen("algorithm.step_reward", STEP_REWARDS, a.step_reward))
    if cfg.task.env is not None:
        out.append(Chosen("task.env.name", ENVS, cfg.task.env.name))
    return out


def check_driver(cfg: Config) -> None:
    """``rollout.driver`` is a registered driver, goes with ``task.name = "env"`` exactly when it runs the
    task's environment (chosen for an environment task unless another is set), takes the options in
    ``rollout.driver_params``, and passes its own check.
    """
    drivers, specs = driver_registry()
    r = cfg.rollout
    if r.driver not in drivers:
        raise ValueError(unknown_name("rollout.driver", drivers.kind, r.driver, drivers.names()))
    env = cfg.task.name == "env"
    episodic = [n for n in drivers.names() if specs[n].episodes]
    if env and "driver" not in r.model_fields_set and not specs[r.driver].episodes and episodic:
        r.driver = episodic[0]
    if env != specs[r.driver].episodes:
        raise ValueError(f"rollout.driver: a driver that runs the task's environment ({episodic}) and task.name = "
                         f"'env' go together (got driver={r.driver!r}, task.name={cfg.task.name!r})")
    r.params()  # raises with the key and the options the driver takes
    own = specs[r.driver].check
    if own is not None:
        from posttrain.config.phases import ProduceSettings  # phases reads the sections, which read this module

        own(ProduceSettings.of(cfg))


def check_entries(cfg: Config) -> None:
    """The driver and the batch selector (:func:`check_driver`, ``check_selector``), then every rule of
    :data:`RULES` over :func:`chosen_entries`; raises ``ValueError`` naming the keys, values and reason.
    """
    check_driver(cfg)
    a = cfg.algorithm
    check_selector(a.batch_selector, a.batch_selector_params, cfg.rollout.group_size)
    entries = chosen_entries(cfg)
    for rule in RULES:
        rule(cfg, entries)


def needs_critic(cfg: Config) -> bool:
    """A chosen entry reads a value model's V(s_t) (``needs_critic``): the loop builds the critic."""
    return any(e.traits.needs_critic for e in chosen_entries(cfg))


def refuse_running_ahead(cfg: Config, entries: list[Chosen]) -> None:
    """``async_safe = False`` needs the learner's current step: no producer running ahead."""
    s = cfg.rollout.max_staleness
    for e in entries:
        if s > 0 and not e.traits.async_safe:
            raise ValueError(f"rollout.max_staleness = {s}: {e} cannot run ahead of the learner{e.why}; "
                             "use rollout.max_staleness = 0")


def refuse_lost_rows(cfg: Config, entries: list[Chosen]) -> None:
    """A selector that replays stored rows, beside an entry whose per-row state a stored row loses."""
    for replay in (e for e in entries if e.traits.replays_rows):
        for e in entries:
            if not e.traits.replayable:
                raise ValueError(f"{replay} replays stored rows, and {e} keeps per-row state they lose{e.why}: "
                                 "use one or the other")


def refuse_ranks(cfg: Config, entries: list[Chosen]) -> None:
    """``one_process``: the hf engine, one process, synchronous, the full model."""
    s, n = cfg.rollout.max_staleness, cfg.train.processes
    clashes = [what for what, on in (
        ("model.lora (an adapter)", cfg.model.lora.enabled),
        (f"train.processes = {n}", n > 1),
        ("cluster.backend = 'ray'", cfg.cluster.backend == "ray"),
        (f"rollout.engine = {cfg.rollout.engine!r}", cfg.rollout.engine != "hf"),
        (f"rollout.max_staleness = {s}", s > 0),
    ) if on]
    for e in entries:
        if e.traits.one_process and clashes:
            raise ValueError(f"{e} runs with the hf engine in one process, synchronously, on the full model{e.why}; "
                             f"not with {', '.join(clashes)}")


def refuse_other_drivers_and_engines(cfg: Config, entries: list[Chosen]) -> None:
    """``drivers`` / ``engines``: the entry runs only with these."""
    r = cfg.rollout
    for e in entries:
        t = e.traits
        if t.drivers is not None and r.driver not in t.drivers:
            raise ValueError(f"rollout.driver = {r.driver!r}: {e} runs with the driver(s) {list(t.drivers)} "
                             f"only{e.why}; set rollout.driver = {t.drivers[0]!r}, or change {e.key}")
        if t.engines is not None and r.engine not in t.engines:
            fit = [n for n in e.registry.names() if r.engine in (e.registry.traits(n).engines or (r.engine,))]
            raise ValueError(f"rollout.engine = {r.engine!r}: {e} runs with the engine(s) {list(t.engines)} "
                             f"only{e.why}; with {r.engine!r} use {e.key} = one of {fit}, or rollout.engine = "
                             f"{t.engines[0]!r}")


def refuse_external_without_rows(cfg: Config, entries: list[Chosen]) -> None:
    """An entry that requires the input ``external`` needs a driver that puts external rows in a group."""
    drivers, _ = driver_registry()
    readers = [str(e) for e in entries if "external" in e.registry.required(e.name)]
    supply = [n for n in drivers.names() if drivers.traits(n).external_rows]
    if readers and not drivers.traits(cfg.rollout.driver).external_rows:
        fix = f" (set rollout.driver = {supply[0]!r})" if supply else ""
        raise ValueError(f"{' and '.join(readers)} read(s) the external rows of a group (the input `external`), "
                         f"which only the driver(s) {supply} supply; got rollout.driver = {cfg.rollout.driver!r}{fix}")


def refuse_behaviour_without_sampler(cfg: Config, entries: list[Chosen]) -> None:
    """Rows no sampler drew (``external_rows``) have no behaviour log-probs for what reads them."""
    readers = [str(e) for e in entries if e.traits.reads_behaviour]
    if cfg.algorithm.old_logprobs == "behaviour":
        readers.insert(0, "algorithm.old_logprobs = 'behaviour'")
    for d in entries:
        if d.traits.external_rows and readers:
            raise ValueError(f"{d}: its external rows have no sampler log-probs{d.why}, which "
                             f"{' and '.join(readers)} read(s); use the learner's recomputed pi_old (the defaults)")


def refuse_micro_batches(cfg: Config, entries: list[Chosen]) -> None:
    """``row_coupled``: a micro-batch cannot hold part of a minibatch."""
    n = cfg.train.micro_batch_tokens
    for e in entries:
        if n and e.traits.row_coupled:
            raise ValueError(f"train.micro_batch_tokens = {n}: {e} couples the rows of a minibatch{e.why}, so it "
                             "cannot be split into micro-batches; set train.micro_batch_tokens = 0 and use "
                             "train.minibatches to bound memory")


def refuse_split_groups(cfg: Config, entries: list[Chosen]) -> None:
    """``row_coupled`` beside ``plans_minibatches``: the update keeps a coupled entry's groups whole in every
    minibatch (``LearnParts.minibatch_unit``), but a selector that draws its own minibatches would cut them apart.
    """
    for planner in (e for e in entries if e.traits.plans_minibatches):
        for e in entries:
            if e.traits.row_coupled:
                raise ValueError(f"{planner} draws its own minibatches{planner.why}, and {e} couples the rows of a "
                                 f"minibatch{e.why}, so a minibatch must hold whole groups: use one or the other")


def refuse_other_aggregation(cfg: Config, entries: list[Chosen]) -> None:
    """``aggregation``: the one aggregation under which the entry's objective holds."""
    have = cfg.algorithm.aggregation
    for e in entries:
        need = e.traits.aggregation
        if need is not None and need != have:
            raise ValueError(f"algorithm.aggregation = {have!r}: {e} needs {need!r}{e.why}; set "
                             f"algorithm.aggregation = {need!r}")


RULES: tuple[Callable[[Config, list[Chosen]], None], ...] = (
    refuse_running_ahead,
    refuse_lost_rows,
    refuse_ranks,
    refuse_other_drivers_and_engines,
    refuse_external_without_rows,
    refuse_behaviour_without_sampler,
    refuse_micro_batches,
    refuse_split_groups,
    refuse_other_aggregation,
)
