"""The whole run's :class:`Config`: its sections, and the checks that read more than one section."""

from __future__ import annotations

from pydantic import model_validator

from posttrain.algorithms import (
    advantages,
    losses,
)
from posttrain.algorithms.selection.selectors import check_selector
from posttrain.config.algorithm import AlgorithmConfig
from posttrain.config.base import EXTERNAL_DRIVERS, LOSS_AGGREGATION, ROW_COUPLED_LOSSES, TURN_INPUTS, Section
from posttrain.config.learn import CriticConfig, TrainConfig
from posttrain.config.model import ModelConfig
from posttrain.config.produce import RolloutConfig
from posttrain.config.run import CheckpointConfig, ClusterConfig, DiagnosticsConfig, EvalConfig, LogConfig
from posttrain.config.task import RewardSpec, ScoringConfig, TaskConfig
from posttrain.config.trainers import DPOConfig, RFTConfig, RMConfig, SFTConfig
from posttrain.errors import unknown_name


class Config(Section):
    """A whole run. Field docstrings above give each section's meaning."""

    seed: int = 0
    out: str = "runs/latest"
    model: ModelConfig = ModelConfig()
    task: TaskConfig = TaskConfig()
    sft: SFTConfig = SFTConfig()
    dpo: DPOConfig = DPOConfig()
    rm: RMConfig = RMConfig()
    rft: RFTConfig = RFTConfig()
    rollout: RolloutConfig = RolloutConfig()
    algorithm: AlgorithmConfig = AlgorithmConfig()
    train: TrainConfig = TrainConfig()
    critic: CriticConfig = CriticConfig()
    reward: list[RewardSpec] = [RewardSpec(name="task")]
    scoring: ScoringConfig = ScoringConfig()
    cluster: ClusterConfig = ClusterConfig()
    eval: EvalConfig = EvalConfig()
    diagnostics: DiagnosticsConfig = DiagnosticsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    log: LogConfig = LogConfig()

    @model_validator(mode="after")
    def _known_names(self) -> Config:
        from posttrain.rewards import REGISTRY as REWARDS
        from posttrain.rewards import reward_names
        from posttrain.tasks import task_names

        if self.task.name not in ("dataset", "env") and self.task.name not in task_names():
            raise ValueError(unknown_name("task.name", "task", self.task.name, [*task_names(), "dataset", "env"]))
        for i, spec in enumerate(self.reward):
            if spec.name not in reward_names():
                raise ValueError(unknown_name(f"reward[{i}].name", "reward", spec.name, reward_names()))
            check = getattr(REWARDS.get(spec.name), "check", None)  # a reward's own load-free params check
            if check is not None:
                try:
                    check(spec.params)
                except Exception as e:  # noqa: BLE001 - ConfigError / ModelLoadError: said as this key's error
                    raise ValueError(f"reward[{i}].params ({spec.name}): {e}") from e
        if not self.reward:
            raise ValueError("reward: at least one [[reward]] component is needed")
        self._multi_turn_fits()
        self._async_fits()
        if self.algorithm.top_entropy_quantile < 1 and self.algorithm.batch_selector == "rorecomp":
            raise ValueError("algorithm.top_entropy_quantile < 1 with batch_selector = 'rorecomp': replayed rows "
                             "keep no entropy mask; use one or the other")
        if self.model.lora.enabled and self._samples_reference():
            raise ValueError("model.lora with reference samples (par's `samples`, or an estimator reading "
                             "reference_rewards: a_star): the reference is the policy with its adapter off, which the "
                             "hf engine cannot sample; train without LoRA, or use par with samples = 0")
        self._parameterization_fits()
        if self.rollout.engine == "vllm" and self.rollout.driver not in ("single_turn", "multi_turn"):
            raise ValueError(f"rollout.engine = 'vllm': the {self.rollout.driver!r} driver is tested with the hf "
                             "engine only so far; use rollout.driver = 'single_turn' (or 'multi_turn')")
        return self

    def _parameterization_fits(self) -> None:
        """A parameterization other than ``plain`` wraps the policy in the trainer's process: the layouts that
        ship weights elsewhere (or sample with another engine) cannot carry it yet.
        """
        name = self.algorithm.parameterization
        if name == "plain":
            return
        clashes = [what for what, on in (
            ("model.lora (an adapter)", self.model.lora.enabled),
            (f"train.processes = {self.train.processes}", self.train.processes > 1),
            ("cluster.backend = 'ray'", self.cluster.backend == "ray"),
            (f"rollout.engine = {self.rollout.engine!r}", self.rollout.engine != "hf"),
            (f"rollout.max_staleness = {self.rollout.max_staleness}", self.rollout.max_staleness > 0),
        ) if on]
        if clashes:
            raise ValueError(f"algorithm.parameterization = {name!r} runs with the hf engine in one process, "
                             f"synchronously, on the full model; not with {', '.join(clashes)}")

    @model_validator(mode="after")
    def _reference_values_fit(self) -> Config:
        """A file of precomputed reference rewards needs a run that reads them; the filter, a pool of prompts."""
        a = self.algorithm
        if a.reference_values is not None and not self._samples_reference():
            raise ValueError(f"algorithm.reference_values = {a.reference_values!r}: this run reads no reference "
                             "rewards (algorithm.advantage = 'a_star', or a par shaper with samples > 0); unset it")
        if a.filter_unsolved and a.reference_values is None:
            raise ValueError("algorithm.filter_unsolved needs algorithm.reference_values (the file that "
                             "`posttrain astar-values RECIPE` writes)")
        if a.filter_unsolved and self.task.name != "dataset":
            raise ValueError(f"algorithm.filter_unsolved drops prompts from a dataset's training pool; task "
                             f"{self.task.name!r} generates its prompts (use task.name = 'dataset', or unset it)")
        return self

    def _samples_reference(self) -> bool:
        """Responses are sampled from the frozen reference policy (``produce/ref_samples.py``)."""
        from posttrain.algorithms import advantages

        a = self.algorithm
        par = any(sp.name == "par" and sp.params.get("samples", 0) for sp in a.shapers)
        return par or "reference_rewards" in advantages.REGISTRY.required(a.advantage)

    @model_validator(mode="after")
    def _external_rows_fit(self) -> Config:
        """An entry that reads ``external`` needs a driver that puts external rows in the groups; such rows
        have no sampler log-probs, so nothing that reads those may run with that driver.
        """
        a, r = self.algorithm, self.rollout
        readers = [f"algorithm.{key} = {name!r}" for key, name, reg in (
            ("advantage", a.advantage, advantages.REGISTRY), ("loss", a.loss, losses.REGISTRY))
            if name in reg and "external" in reg.required(name)]
        if readers and r.driver not in EXTERNAL_DRIVERS:
            raise ValueError(
                f"{' and '.join(readers)} read(s) the external rows of a group (the input `external`), which only "
                f"the driver(s) {list(EXTERNAL_DRIVERS)} supply; got rollout.driver = {r.driver!r} (set "
                f"rollout.driver = {EXTERNAL_DRIVERS[0]!r})"
            )
        if r.driver not in EXTERNAL_DRIVERS:
            return self
        k = r.params().n_external
        if r.group_size <= k:
            raise ValueError(f"rollout.group_size: {r.group_size} leaves no on-policy sample beside "
                             f"rollout.driver_params.n_external = {k}; use a group of at least {k + 1}")
        behaviour = [key for key, on in (
            ("algorithm.old_logprobs = 'behaviour'", a.old_logprobs == "behaviour"),
            (f"algorithm.behaviour_correction = {a.behaviour_correction!r}", a.behaviour_correction != "none"),
            ("algorithm.off_policy_mask_threshold", a.off_policy_mask_threshold is not None),
        ) if on]
        if behaviour:
            raise ValueError(f"rollout.driver = {r.driver!r}: its external rows have no sampler log-probs, which "
                             f"{behaviour} read; use the learner's recomputed pi_old (the defaults)")
        if a.batch_selector == "rorecomp":
            raise ValueError(f"algorithm.batch_selector: rorecomp replays stored rows without their `external` flag; "
                             f"it does not run with rollout.driver = {r.driver!r}")
        return self

    def _async_fits(self) -> None:
        """What the producer thread of ``rollout.max_staleness > 0`` cannot run ahead of the learner."""
        from posttrain.algorithms import shaping
        from posttrain.algorithms.stateful import updater

        if self.rollout.max_staleness == 0:
            if self.rollout.partial != "finish":
                raise ValueError(f"rollout.partial = '{self.rollout.partial}' acts on batches sampled ahead of the "
                                 "learner; set rollout.max_staleness > 0 as well")
            return
        r = self.rollout
        if r.partial != "finish" and r.driver == "multi_turn":
            raise ValueError(f"rollout.partial = '{r.partial}' does not run with the multi_turn driver (an episode "
                             "cut between turns would span two policies); use rollout.partial = 'finish' there "
                             "(resubmit and continue run with the other drivers)")
        if self.rollout.driver == "partial_states":
            raise ValueError("rollout.max_staleness > 0: the partial_states driver's queue is filled by the steps "
                             "the learner has trained, which a producer running ahead does not know; use 0")
        from posttrain.algorithms import advantages

        if "baseline_rewards" in advantages.REGISTRY.required(self.algorithm.advantage):
            raise ValueError(f"rollout.max_staleness > 0 with algorithm.advantage = {self.algorithm.advantage!r}: its "
                             "baseline (the greedy response's reward) is sampled by the learner's current policy, "
                             "not by the older one that sampled the batch; use rollout.max_staleness = 0")
        stateful = [sp.name for sp in self.algorithm.shapers if updater(shaping, sp.name) is not None]
        if stateful:
            raise ValueError(f"rollout.max_staleness > 0: shaper(s) {stateful} keep a history that the learner's "
                             "steps advance, which a producer running ahead cannot read; use 0")

    def _multi_turn_fits(self) -> None:
        """An environment task runs the multi_turn driver (chosen for it unless another is set), scores its
        episodes itself, and is what turn-level estimators need.
        """
        env, r, a = self.task.name == "env", self.rollout, self.algorithm
        if env and "driver" not in r.model_fields_set and r.driver == "single_turn":
            r.driver = "multi_turn"
        if env != (r.driver == "multi_turn"):
            raise ValueError(
                "rollout.driver: the multi_turn driver and task.name = 'env' go together "
                f"(got driver={r.driver!r}, task.name={self.task.name!r})"
            )
        if env and [s.name for s in self.reward] != ["task"]:
            raise ValueError(
                f"reward: an environment scores its episodes itself (the `task` component); got "
                f"{[s.name for s in self.reward]}; other reward components are not supported with task.name = 'env'"
            )
        turn_needs = sorted(set(advantages.REGISTRY.required(a.advantage)) & set(TURN_INPUTS))
        if turn_needs and not env:
            raise ValueError(
                f"algorithm.advantage: {a.advantage!r} needs turn-level inputs {turn_needs} that only multi-turn "
                "episodes have (task.name = 'env' with a [task.env] section)"
            )
        if env and a.batch_selector == "rorecomp":
            raise ValueError("algorithm.batch_selector: rorecomp replays stored single-turn rows; it does not keep "
                             "a multi-turn episode's masks (use it with single-turn tasks)")

    @model_validator(mode="after")
    def _selection_fits(self) -> Config:
        from posttrain.tasks import TASKS

        a = self.algorithm
        check_selector(a.batch_selector, a.batch_selector_params, self.rollout.group_size)
        n = self.rollout.prompts_per_step * self.rollout.group_size
        if a.kl_reward_target is not None and a.kl_reward_horizon < n:
            raise ValueError(  # beta moves by at most 0.2 n / horizon per step: keep that below 20 %
                f"algorithm.kl_reward_horizon: {a.kl_reward_horizon} is below the {n} responses of a step "
                "(the adaptive KL coefficient could change sign); use at least that many"
            )
        rp = self.rollout.params()
        coupled = a.loss in ROW_COUPLED_LOSSES or getattr(rp, "affinity_lambda", 0.0) > 0
        if self.train.micro_batch_tokens and coupled:
            what = f"loss {a.loss!r}" if a.loss in ROW_COUPLED_LOSSES else "HINT's AAPO (driver_params.affinity_lambda)"
            raise ValueError(
                f"train.micro_batch_tokens: {what} couples the rows of a minibatch, so it cannot be split into "
                "micro-batches; set train.micro_batch_tokens=0 and use train.minibatches to bound memory"
            )
        need = LOSS_AGGREGATION.get(a.loss)
        if need is not None and a.aggregation != need:
            raise ValueError(
                f"algorithm.aggregation: loss {a.loss!r} needs {need!r} (its paper's objective; {a.aggregation!r} "
                f"would weigh its sequence terms by their token counts); set algorithm.aggregation={need!r}"
            )
        if self.rollout.driver == "hint_reroll":
            ds = self.task.dataset
            if ds is not None and not ds.fields.get("hint"):
                raise ValueError("rollout.driver: hint_reroll needs hints, and the dataset has none; map a column "
                                 "with task.dataset.fields.hint = COLUMN")
            if ds is None and not getattr(TASKS[self.task.name], "hints", False):
                with_hints = [n for n, t in TASKS.items() if getattr(t, "hints", False)]
                raise ValueError(f"rollout.driver: hint_reroll needs hints; task {self.task.name!r} gives none; tasks "
                                 f"with hints: {with_hints}, or 'dataset' with task.dataset.fields.hint")
        return self
