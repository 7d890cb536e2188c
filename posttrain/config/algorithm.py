"""``[algorithm]``: the registry entries the prepare and learn phases look up at set-up, with their
parameters.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.algorithms import (
    advantages,
    aggregation,
    entropy,
    kl,
    loss_weights,
    losses,
    offpolicy,
    selection,
    shaping,
)
from posttrain.algorithms.registry import Registry
from posttrain.algorithms.stateful import updater_params
from posttrain.config.base import (
    ADVANTAGE_INPUTS,
    LOSS_INPUTS,
    SHAPER_INPUTS,
    TOKEN_LOSS_INPUTS,
    Params,
    Section,
    StageSpec,
)
from posttrain.errors import unknown_name
from posttrain.models import parameterization


class AlgorithmConfig(Section):
    """The registry entries the loop looks up at setup; ``*_params`` are their keyword parameters."""

    shapers: list[StageSpec] = []  # reward shapers applied in order to the summed rewards [P, G]
    group_filter: str = "none"  # selection entry deciding which groups are trained on
    group_filter_params: Params = {}
    advantage: str = "grpo"
    advantage_params: Params = {}
    reference_values: str | None = Field(
        None,
        description="a JSONL file of `posttrain astar-values` (A*-PO's offline stage, arXiv:2505.20686): the "
        "reference rewards of the prompts it lists are read from it, not sampled (a_star's V*, par's samples); a "
        "prompt it lacks is sampled when the run meets it; its rewards per prompt must equal the run's samples",
    )
    filter_unsolved: bool = Field(
        False,
        description="with reference_values and a dataset task: drop from the training pool, before training, the "
        "prompts whose reference samples the task's verifier found all incorrect (A*-PO's filter_incorrect)",
    )
    advantage_metric: Literal["entropy", "length"] = Field(
        "entropy",
        description="the per-response `metric` [P, G] for estimators that take one (canon): mean token "
        "entropy under the sampling policy (one no-grad forward), or response length",
    )
    loss: str = "ppo_clip"
    loss_params: Params = {}  # the loss's own keyword defaults apply to what is not set here
    loss_weights: list[StageSpec] = Field(
        [],
        description="per-token weights multiplied, in order, into the policy loss: the entries of "
        "posttrain/algorithms/loss_weights.py (`posttrain algorithms` lists them), e.g. opsm (DeepSeek-V3.2's "
        "off-policy sequence masking; threshold), top_entropy (80/20, arXiv:2506.01939; rho = 0.2), aapo (HINT's "
        'Affinity^lam on re-rolled groups; lam = 1): [{ name = "top_entropy", params = { rho = 0.2 } }]',
    )
    aggregation: str = "token_mean"
    aggregation_params: Params = {}
    kl: str = "k3"
    kl_coef: float = Field(0.0, ge=0)
    step_reward: str | None = Field(
        None,
        description="step (process) reward scoring each reasoning step, for shapers that read `step_rewards` "
        "(prm_clip, prm_delta): reference_steps (exact step labels of tasks that know them) or prm (a process "
        "reward model; posttrain/rewards/prm.py)",
    )
    step_reward_params: Params = {}
    kl_reward: str = Field(
        "k1",
        description="KL estimator of the penalty in the reward (`kl_reward_coef`); k1 as in PPO-RLHF and REINFORCE++",
    )
    kl_reward_coef: float = Field(
        0.0,
        ge=0,
        description="beta of the KL penalty in the reward: token_rewards = -beta * KL_t(policy || reference) on every "
        "response token, for estimators that take token_rewards (gae, reinforce_pp)",
    )
    kl_reward_target: float | None = Field(
        None,
        gt=0,
        description="adaptive KL controller (Ziegler et al. 2019, verl kl_ctrl.type = adaptive): beta starts at "
        "kl_reward_coef and moves each step toward this per-token KL; None keeps beta fixed",
    )
    kl_reward_horizon: int = Field(10000, ge=1, description="the adaptive controller's horizon, in responses")
    entropy: str | None = None  # entropy regularizer added to the per-token loss (e.g. entropy_bonus)
    entropy_params: Params = {}
    behaviour_correction: str = Field(
        "none",
        description="importance weights pi_old / mu for tokens the sampler drew (posttrain/algorithms/offpolicy.py): "
        "none, tis (token, capped), icepop (token, masked outside a band), seq_mask (sequence band + token TIS), "
        "mis (sequence ratio, masked above a cap)",
    )
    behaviour_correction_params: Params = {}
    old_logprobs: Literal["recompute", "behaviour"] = Field(
        "recompute",
        description="pi_old of the PPO ratio: recomputed by the learner before the update (off-policy updates), "
        "or the sampler's own log-probs mu (no extra forward; the behaviour correction's weights are then 1)",
    )
    parameterization: str = Field(
        "plain",
        description="what the loop trains and samples, built from the policy "
        "(posttrain/models/parameterization.py): plain (the policy), ref_logit_mix (logits averaged with the "
        "frozen starting model's)",
    )
    parameterization_params: Params = {}
    batch_selector: str = Field(
        "none",
        description="which rows the update trains on, in which minibatches (posttrain/prepare/selectors.py): none, "
        "shuffle_r1 (pairwise sampling + advantage-weighted shuffle), rorecomp (priority + compensation batches)",
    )
    batch_selector_params: Params = Field(
        {},
        description="its parameters over the defaults: shuffle_r1: prune_ratio 0.5, weight 'sum' (max, mean, pos), "
        "replay_times 8, power 1.0; rorecomp: correct_above 0.0, top_k 0 (median split), compensation_every 4 "
        "(0: never), compensation_size 0 (the priority batch's size), capacity 1024",
    )

    @model_validator(mode="after")
    def _known_entries(self) -> AlgorithmConfig:
        """Every entry is registered, takes the parameters given it, and gets the inputs it requires."""
        for check in (entries_known, advantage_inputs_fit, shapers_known, step_reward_fits, entropy_known,
                      group_filter_known, inputs_provided):
            check(self)
        return self

    @model_validator(mode="after")
    def _loss_params_values(self) -> AlgorithmConfig:
        """A bad loss parameter value (VESPO's k < 0, dual_clip <= 1) fails here, before any model loads."""
        if self.loss not in losses.REGISTRY or not set(losses.inputs(self.loss)) <= set(LOSS_INPUTS):
            return self  # _known_entries says why
        import torch

        if losses.FOLDED_WEIGHTS in self.loss_params:
            raise ValueError(f"algorithm.loss_params: {losses.FOLDED_WEIGHTS!r} is an input (the behaviour "
                             "correction's weights, algorithm.behaviour_correction), not a parameter")
        z = torch.zeros(1, 1)
        row_inputs = {k: z if k in TOKEN_LOSS_INPUTS else torch.zeros(1) for k in losses.inputs(self.loss)}
        try:
            losses.compute(self.loss, z, z, torch.zeros(1), torch.ones(1, 1), **row_inputs, **self.loss_params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"algorithm.loss_params: {self.loss_params} rejected by {self.loss!r}: {e}") from None
        folds = losses.FOLDED_WEIGHTS in losses.REGISTRY.params(self.loss)
        if folds and self.behaviour_correction in offpolicy.SEQUENCE_WEIGHTS:
            raise ValueError(
                f"algorithm.behaviour_correction: {self.loss!r} folds per-token weights into its sequence ratio "
                f"(sum_t log w_t), and {self.behaviour_correction!r} repeats a sequence's ratio on each token, so it "
                "would count once per token; use a token-level correction (tis, icepop) or seq_mask"
            )
        return self

    @model_validator(mode="after")
    def _loss_weights_known(self) -> AlgorithmConfig:
        """Each loss weight is an entry, listed once, with parameters it takes and values it accepts."""
        seen: set[str] = set()
        for i, spec in enumerate(self.loss_weights):
            key = f"algorithm.loss_weights[{i}]"
            if spec.name not in loss_weights.REGISTRY:
                raise ValueError(unknown_name(key, loss_weights.REGISTRY.kind, spec.name, loss_weights.names()))
            if spec.name in seen:
                raise ValueError(f"{key}: {spec.name!r} is listed twice; list each loss weight once")
            seen.add(spec.name)
            unread = sorted(set(loss_weights.inputs(spec.name)) - set(loss_weights.INPUTS))
            if unread:
                raise ValueError(f"{key}: {spec.name!r} reads input(s) {unread} that the update does not offer "
                                 f"(it offers {list(loss_weights.INPUTS)})")
            try:
                loss_weights.check(spec.name, spec.params)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{key}.params: {e}") from None
        return self

    @model_validator(mode="after")
    def _corrections_survive_the_estimator(self) -> AlgorithmConfig:
        """A noisy-verifier correction needs an estimator that keeps it (``shaping.correction_lost``), and
        an outside baseline (remax's greedy reward) shapers that can shape it (``shaping.baseline_unshapable``).
        """
        for i, spec in enumerate(self.shapers):
            why = shaping.correction_lost(spec.name, self.advantage, self.advantage_params)
            why = why or shaping.baseline_unshapable(spec.name, self.advantage)
            if why is not None:
                raise ValueError(f"algorithm.shapers[{i}]: {why}")
        return self


# The keys naming one entry each, with their registry (their parameters: ``<key>_params``).
SINGLE_ENTRIES = (
    ("advantage", advantages.REGISTRY),
    ("loss", losses.REGISTRY),
    ("aggregation", aggregation.REGISTRY),
    ("kl", kl.REGISTRY),
    ("kl_reward", kl.REGISTRY),
    ("behaviour_correction", offpolicy.REGISTRY),
    ("parameterization", parameterization.REGISTRY),
)
# Every key of [algorithm] that chooses entries, with its registry: the one table of which key looks up which
# registry (the lists ``shapers`` and ``loss_weights`` choose several; config/checks.py reads the traits).
REGISTRIES: dict[str, Registry] = {
    **dict(SINGLE_ENTRIES),
    "group_filter": selection.REGISTRY,
    "entropy": entropy.REGISTRY,
    "shapers": shaping.REGISTRY,
    "loss_weights": loss_weights.REGISTRY,
}


def entries_known(a: AlgorithmConfig) -> None:
    """Each key of :data:`SINGLE_ENTRIES` names a registered entry, given only parameters it takes (an
    advantage estimator's include its history updater's).
    """
    for key, registry in SINGLE_ENTRIES:
        name = getattr(a, key)
        if name not in registry:
            raise ValueError(unknown_name(f"algorithm.{key}", registry.kind, name, registry.names()))
        params = getattr(a, f"{key}_params", None) or {}
        accepted = registry.params(name) + (updater_params(advantages, name) if key == "advantage" else [])
        extra = sorted(set(params) - set(accepted))
        if extra and key != "advantage":
            raise ValueError(
                f"algorithm.{key}_params: {registry.kind} {name!r} has no parameter(s) {extra}; "
                f"accepted: {accepted} (set algorithm.{key}_params={{}} to use its defaults)"
            )
        if extra:
            raise ValueError(f"algorithm.advantage_params: {name!r} has no parameter(s) {extra}; accepted: {accepted}")


def advantage_inputs_fit(a: AlgorithmConfig) -> None:
    """The estimator's inputs are not given as parameters, and the settings that make an input (the KL penalty
    in the reward, the response metric) have an estimator that reads it.
    """
    inputs_given = sorted(set(a.advantage_params) & set(ADVANTAGE_INPUTS))
    if inputs_given:
        raise ValueError(
            f"algorithm.advantage_params: {inputs_given} are inputs the loop computes, not parameters"
            + (" (choose the metric with algorithm.advantage_metric)" if "metric" in inputs_given else "")
        )
    if a.kl_reward_coef > 0 and "token_rewards" not in advantages.REGISTRY.params(a.advantage):
        users = [n for n in advantages.names() if "token_rewards" in advantages.REGISTRY.params(n)]
        raise ValueError(
            f"algorithm.kl_reward_coef: {a.advantage!r} takes no token rewards (got {a.kl_reward_coef}); "
            f"the KL penalty in the reward needs one of {users} (or use algorithm.kl_coef, the KL in the loss)"
        )
    if a.kl_reward_target is not None and a.kl_reward_coef <= 0:
        raise ValueError("algorithm.kl_reward_target: the adaptive controller needs a starting kl_reward_coef > 0")
    if a.advantage_metric != "entropy" and "metric" not in advantages.REGISTRY.required(a.advantage):
        users = [n for n in advantages.names() if "metric" in advantages.REGISTRY.required(n)]
        raise ValueError(
            f"algorithm.advantage_metric: {a.advantage!r} takes no metric (got {a.advantage_metric!r}); "
            f"only {users} do"
        )


def shapers_known(a: AlgorithmConfig) -> None:
    """Each shaper is registered, given parameters it takes, and gets the inputs it requires; shapers act
    on the summed reward, so not with an estimator that normalises each component on its own.
    """
    for i, spec in enumerate(a.shapers):
        if spec.name not in shaping.REGISTRY:
            raise ValueError(
                unknown_name(f"algorithm.shapers[{i}]", "reward shaper", spec.name, shaping.REGISTRY.names())
            )
        accepted = shaping.REGISTRY.params(spec.name) + updater_params(shaping, spec.name)
        unknown = sorted(set(spec.params) - set(accepted) - set(SHAPER_INPUTS))
        if unknown:
            raise ValueError(
                f"algorithm.shapers[{i}]: {spec.name!r} has no parameter(s) {unknown}; accepted: {accepted}"
            )
        missing = [k for k in shaping.REGISTRY.required(spec.name) if k not in (*SHAPER_INPUTS, *spec.params)]
        if missing:
            raise ValueError(
                f"algorithm.shapers[{i}]: {spec.name!r} needs {missing} (as params, or inputs "
                f"the loop provides: {list(SHAPER_INPUTS)})"
            )
    if a.advantage in advantages.REWARD_COMPONENTS and a.shapers:
        raise ValueError(
            f"algorithm.shapers: {a.advantage!r} normalises each reward component on its own, and "
            "shapers act on the summed reward; use shapers with a single-reward estimator"
        )


def step_reward_fits(a: AlgorithmConfig) -> None:
    """A step scorer is registered, chosen exactly when a shaper reads step rewards."""
    from posttrain.rewards.steps import REGISTRY as STEP_REWARDS

    readers = [sp.name for sp in a.shapers if "step_rewards" in shaping.REGISTRY.required(sp.name)]
    if a.step_reward is not None and a.step_reward not in STEP_REWARDS:
        raise ValueError(unknown_name("algorithm.step_reward", "step reward", a.step_reward, STEP_REWARDS.names()))
    if readers and a.step_reward is None:
        raise ValueError(
            f"algorithm.shapers: {readers} read step rewards; choose a step scorer with algorithm.step_reward "
            f"(choices: {STEP_REWARDS.names()})"
        )
    if not readers and (a.step_reward is not None or a.step_reward_params):
        users = [n for n in shaping.names() if "step_rewards" in shaping.REGISTRY.required(n)]
        raise ValueError(
            f"algorithm.step_reward: no shaper reads step rewards (got {a.step_reward!r}); only {users} do"
        )


def entropy_known(a: AlgorithmConfig) -> None:
    """The entropy regularizer, when set, is registered and given parameters it (or its updater) takes."""
    if a.entropy is None:
        return
    if a.entropy not in entropy.REGISTRY:
        raise ValueError(unknown_name("algorithm.entropy", "entropy regularizer", a.entropy, entropy.REGISTRY.names()))
    accepted = [k for k in entropy.REGISTRY.params(a.entropy) if k != "state"]
    accepted += [k for k in updater_params(entropy, a.entropy) if k not in accepted]
    bad = sorted(set(a.entropy_params) - set(accepted))
    if bad:
        raise ValueError(f"algorithm.entropy_params: {a.entropy!r} has no parameter(s) {bad}; accepted: {accepted}")


def group_filter_known(a: AlgorithmConfig) -> None:
    """The group filter is registered and given parameters it takes."""
    if a.group_filter not in selection.REGISTRY:
        raise ValueError(
            unknown_name("algorithm.group_filter", "group filter", a.group_filter, selection.REGISTRY.names())
        )
    bad = sorted(set(a.group_filter_params) - set(selection.REGISTRY.params(a.group_filter)))
    if bad:
        raise ValueError(
            f"algorithm.group_filter_params: {a.group_filter!r} has no parameter(s) {bad}; "
            f"accepted: {selection.REGISTRY.params(a.group_filter)}"
        )


def inputs_provided(a: AlgorithmConfig) -> None:
    """The estimator and the loss require only inputs the loop provides (``token_rewards`` only with a KL
    penalty in the reward, ``kl_reward_coef > 0``).
    """
    adv_provided = tuple(k for k in ADVANTAGE_INPUTS if k != "token_rewards" or a.kl_reward_coef > 0)
    for key, registry, provided in (
        ("advantage", advantages.REGISTRY, adv_provided),
        ("loss", losses.REGISTRY, LOSS_INPUTS),
    ):
        name = getattr(a, key)
        missing = [k for k in registry.required(name) if k not in provided]
        if missing:
            raise ValueError(
                f"algorithm.{key}: {name!r} needs input(s) {missing} that the training loop does not "
                f"provide yet (it provides {list(provided)})"
            )
