"""The whole run's :class:`Config`: its sections, and the checks that read more than one section.

What the chosen registry entries need and cannot run with is one generic check over their declared
traits (``config/checks.py``); the checks here read settings, not methods.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from posttrain.algorithms import advantages, shaping
from posttrain.config.algorithm import AlgorithmConfig
from posttrain.config.base import TURN_INPUTS, Section
from posttrain.config.checks import check_entries
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
    plugins: list[str] = Field([], description="the user's Python files (relative to the recipe) or modules, "
                               "imported before validation (posttrain/plugins.py; docs/api.md)")
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
        from posttrain.tasks import TASKS, task_names

        if self.task.name not in ("dataset", "env") and self.task.name not in task_names():
            raise ValueError(unknown_name("task.name", "task", self.task.name, [*task_names(), "dataset", "env"]))
        task_check = getattr(TASKS.get(self.task.name), "check", None)  # a task's own load-free params check
        if task_check is not None:
            task_check(self.task.params)
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
        if self.rollout.max_staleness == 0 and self.rollout.on_new_weights != "finish":
            raise ValueError(f"rollout.on_new_weights = '{self.rollout.on_new_weights}' acts on batches sampled ahead "
                             "of the learner; set rollout.max_staleness > 0 as well")
        check_entries(self)  # the driver, the batch selector, and what every chosen entry declares
        self._environment_fits()
        if self.model.lora.enabled and self._samples_reference():
            raise ValueError("model.lora with reference samples (par's `samples`, or an estimator reading "
                             "reference_rewards: a_star): the reference is the policy with its adapter off, which the "
                             "hf engine cannot sample; train without LoRA, or use par with samples = 0")
        return self

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
        """Responses are sampled from the frozen reference policy (``produce/ref_samples.py``): a shaper that
        reads reference rewards with ``samples`` > 0 (par), or an estimator that requires them (a_star).
        """
        a = self.algorithm
        shaper = any("ref_rewards" in shaping.REGISTRY.required(sp.name)
                     and sp.params.get("samples", shaping.REGISTRY.default(sp.name, "samples", 0)) for sp in a.shapers)
        return shaper or "reference_rewards" in advantages.REGISTRY.required(a.advantage)

    def _environment_fits(self) -> None:
        """An environment task scores its episodes itself (the default reward, the task's own verifier), and is
        what turn-level estimators need.
        """
        env, a = self.task.name == "env", self.algorithm
        own = [s.name for s in type(self).model_fields["reward"].default]
        if env and [s.name for s in self.reward] != own:
            raise ValueError(
                f"reward: an environment scores its episodes itself (the {own} component); got "
                f"{[s.name for s in self.reward]}; other reward components are not supported with task.name = 'env'"
            )
        turn_needs = sorted(set(advantages.REGISTRY.required(a.advantage)) & set(TURN_INPUTS))
        if turn_needs and not env:
            raise ValueError(
                f"algorithm.advantage: {a.advantage!r} needs turn-level inputs {turn_needs} that only multi-turn "
                "episodes have (task.name = 'env' with a [task.env] section)"
            )

    @model_validator(mode="after")
    def _kl_horizon_fits(self) -> Config:
        a = self.algorithm
        n = self.rollout.prompts_per_step * self.rollout.group_size
        if a.kl_reward_target is not None and a.kl_reward_horizon < n:
            raise ValueError(  # beta moves by at most 0.2 n / horizon per step: keep that below 20 %
                f"algorithm.kl_reward_horizon: {a.kl_reward_horizon} is below the {n} responses of a step "
                "(the adaptive KL coefficient could change sign); use at least that many"
            )
        return self
