"""Each phase's settings: the sections of a :class:`~posttrain.config.Config` one phase reads, and no more.

Only the config package, the loops (``train/``, ``trainers/``) and the run set-up (``run/``) see a whole
``Config``. They hand the produce phase a :class:`ProduceSettings` and the learn phase a
:class:`LearnSettings`, cut here from the validated config, so that a phase's code shows by its type what
it depends on: the learner cannot read the task or the reward components, a rollout driver cannot read the
optimizer. The sections themselves are the validated pydantic sections (frozen here by being shared,
never edited: a phase that wants another value asks the loop for it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the sections are the validated config's own objects: nothing of them is imported at run time
    from posttrain.config.algorithm import AlgorithmConfig
    from posttrain.config.learn import CriticConfig, TrainConfig
    from posttrain.config.model import ModelConfig
    from posttrain.config.produce import RolloutConfig
    from posttrain.config.root import Config
    from posttrain.config.run import ClusterConfig
    from posttrain.config.task import ScoringConfig, TaskConfig


@dataclass(frozen=True)
class ProduceSettings:
    """What producing a batch reads: sampling and driver (``[rollout]``), the task's prompt settings, how
    reward failures count, each reward component's weight, the reference-value file, and the run's seed.
    """

    seed: int
    rollout: RolloutConfig
    task: TaskConfig
    scoring: ScoringConfig
    reward_weights: tuple[float, ...]  # [[reward]] weights, in order
    algorithm: AlgorithmConfig  # reference_values / filter_unsolved (the produce entries bind via ProduceParts)

    @classmethod
    def of(cls, cfg: Config) -> ProduceSettings:
        """The produce phase's cut of ``cfg``."""
        return cls(cfg.seed, cfg.rollout, cfg.task, cfg.scoring, tuple(s.weight for s in cfg.reward), cfg.algorithm)


@dataclass(frozen=True)
class LearnSettings:
    """What the update reads: the optimizer's schedule of epochs, minibatches and micro-batches
    (``[train]``), the critic, the model's precision and adapter, where learner ranks run (``[cluster]``),
    the loss entries' parameters (``[algorithm]``), and the two sampling values a log-prob depends on.
    """

    seed: int
    plugins: tuple[str, ...]  # imported again on a spawned rank or a Ray actor
    model: ModelConfig
    train: TrainConfig
    critic: CriticConfig
    algorithm: AlgorithmConfig
    cluster: ClusterConfig
    temperature: float  # rollout.temperature: log-probs are of the tempered policy that sampled
    max_new_tokens: int  # rollout.max_new_tokens: a constant-length loss normalizer (Dr.GRPO)
    top_q: float  # diagnostics.top_q: the policy/entropy_top fraction

    @classmethod
    def of(cls, cfg: Config) -> LearnSettings:
        """The learn phase's cut of ``cfg``."""
        return cls(cfg.seed, tuple(cfg.plugins), cfg.model, cfg.train, cfg.critic, cfg.algorithm, cfg.cluster,
                   cfg.rollout.temperature, cfg.rollout.max_new_tokens, cfg.diagnostics.top_q)
