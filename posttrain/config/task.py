"""``[task]`` (the prompts: a built-in task, a dataset or an environment), ``[[reward]]`` and
``[scoring]`` (how rewards are computed).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, JsonValue, model_validator

from posttrain.config.base import Params, Section
from posttrain.data.spec import DatasetSpec
from posttrain.errors import unknown_name


class EnvSpec(Section):
    """``task.name = "env"``: the multi-turn environment (``posttrain.envs``) and its episode limits."""

    name: str = Field(description="a registered environment (guess_number, retry_arith, calc_tool, grid, ...)")
    params: Params = Field({}, description="the environment's constructor parameters")
    max_turns: int = Field(0, ge=0, description="most policy turns an episode takes; 0: the environment's own limit")
    max_tokens: int = Field(
        128, ge=1, description="most tokens an episode holds after its prompt (actions and replies together)"
    )
    step_timeout_s: float = Field(10.0, gt=0, description="an environment step that takes longer scores its "
                                  "episode None (logged with its transcript)")

    @model_validator(mode="after")
    def _known_env(self) -> EnvSpec:
        from posttrain.envs import ENVS
        from posttrain.envs.base import check_env_params

        if self.name not in ENVS:
            raise ValueError(unknown_name("task.env.name", ENVS.kind, self.name, ENVS.names()))
        check_env_params(self.name, self.params)  # its parameters (a wrapped game's id too), nothing built
        return self


class TaskConfig(Section):
    """Where prompts, demonstrations and the verifier come from: a built-in task (``name``,
    ``params``), with ``name = "dataset"`` the data files or ``datasets`` source in
    ``[task.dataset]`` (see ``posttrain.data.spec.DatasetSpec``), or with ``name = "env"`` the
    multi-turn environment in ``[task.env]``.
    """

    name: str = "arithmetic"
    params: dict[str, JsonValue] = Field({}, description="the built-in task's parameters (reasoning_gym: tables too, "
                                         "datasets = { NAME = weight, ... })")
    system_prompt: str | None = None
    dataset: DatasetSpec | None = None
    env: EnvSpec | None = None

    @model_validator(mode="after")
    def _env_section(self) -> TaskConfig:
        if (self.name == "env") != (self.env is not None):
            raise ValueError(
                "task: name = 'env' and a [task.env] section go together "
                f"(got name={self.name!r}, env={'set' if self.env else 'missing'})"
            )
        if self.env is not None and self.params:
            raise ValueError("task.params: an environment takes its settings from [task.env] params")
        return self

    @model_validator(mode="after")
    def _dataset_or_builtin(self) -> TaskConfig:
        if (self.name == "dataset") != (self.dataset is not None):
            raise ValueError(
                "task: name = 'dataset' and a [task.dataset] section go together "
                f"(got name={self.name!r}, dataset={'set' if self.dataset else 'missing'})"
            )
        if self.dataset is not None:
            if self.params:
                raise ValueError("task.params: a dataset task takes its settings from [task.dataset]")
            ds = self.dataset.system_prompt
            if ds is not None and self.system_prompt is not None and ds != self.system_prompt:
                raise ValueError("task.system_prompt and task.dataset.system_prompt differ; set one")
            if self.system_prompt is None and ds is not None:
                self.system_prompt = ds  # re-runs this validator once, with the prompts equal
        return self


class RewardSpec(Section):
    """One reward component; the training reward is the weighted sum of components."""

    name: str
    weight: float = 1.0
    params: Params = {}


class ScoringConfig(Section):
    """How rewards are scored: worker processes with timeouts, and what a failed score becomes."""

    workers: int = Field(2, ge=0, description="reward worker processes; 0 scores in the trainer (no timeouts)")
    timeout_s: float = Field(10.0, gt=0, description="longest one reward call may run before it scores None")
    deadline_s: float = Field(60.0, gt=0, description="longest the scoring of one generation batch may take")
    on_error: Literal["zero", "mask"] = Field(
        "zero", description="a None score (error, timeout, NaN) becomes 0, or masks the sample out of the update"
    )
