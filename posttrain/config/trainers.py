"""The trainers around the RL loop: ``[sft]``, ``[dpo]``, ``[rm]`` and ``[rft]``."""

from __future__ import annotations

from typing import ClassVar, Literal, get_args

from pydantic import Field, model_validator

from posttrain.config.base import Params, Section
from posttrain.errors import unknown_name


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
    loss: str = Field("mle", description="the per-token loss on the demonstrations (posttrain.algorithms.sft_losses)")
    loss_params: Params = {}

    @model_validator(mode="after")
    def _known_loss(self) -> SFTConfig:
        import torch

        from posttrain.algorithms import sft_losses

        reg = sft_losses.REGISTRY
        if self.loss not in reg:
            raise ValueError(unknown_name("sft.loss", reg.kind, self.loss, reg.names()))
        needs = reg.required(self.loss)
        missing = [k for k in needs if k not in sft_losses.INPUTS]
        if missing:
            raise ValueError(f"sft.loss: {self.loss!r} needs input(s) {missing} that the SFT trainer does not "
                             f"provide (it provides {list(sft_losses.INPUTS)})")
        accepted = [k for k in reg.params(self.loss) if k not in needs]
        bad = sorted(set(self.loss_params) - set(accepted))
        if bad:
            raise ValueError(f"sft.loss_params: {self.loss!r} has no parameter(s) {bad}; accepted: {accepted}")
        z = torch.zeros(1, 1)
        try:  # a bad parameter value (a negative coef) fails here, before any model loads
            sft_losses.compute(self.loss, z, torch.ones(1, 1), **{k: z for k in needs}, **self.loss_params)
        except (TypeError, ValueError) as e:
            raise ValueError(f"sft.loss_params: {self.loss_params} rejected by {self.loss!r}: {e}") from None
        return self


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
    length-debiased with ODIN (arXiv:2402.07319) or FiMi-RM (arXiv:2505.12843, provisional). The model is
    ``model.path`` (or the tiny model) as a one-output sequence classifier; ``RUN/reward_model`` is what
    ``[[reward]] name = "reward_model"`` loads (``params = {path = "RUN/reward_model"}``). Pairs come from the same
    sources as ``[dpo]``.
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
    debias: Literal["none", "odin", "fimi"] = Field(
        "none", description="none = plain BT; odin = a quality head and a length head, the quality head decorrelated "
        "from response length and alone saved (ODIN, arXiv:2402.07319); fimi = a small model fits the reward from "
        "the length and the reward is decorrelated from that fit (FiMi-RM stage 3, arXiv:2505.12843, provisional)",
    )
    odin_length_coef: float = Field(
        1.0, ge=0, description="odin: lambda_L on |corr(r_Q, length)| - corr(r_L, length) (authors' scripts: 1.0)"
    )
    odin_ortho_coef: float = Field(
        1.0, ge=0, description="odin: lambda_O on |cos(w_Q, w_L)| of the two heads' weights (authors' scripts: 1.0)"
    )
    fimi_warmup_steps: int = Field(
        50, ge=0, description="fimi: plain Bradley-Terry steps before the fitting and debiasing blocks (ours)"
    )
    fimi_every: int = Field(
        8, ge=1, description="fimi: steps per block; fitting-model and reward-model blocks alternate (rendering: 8)"
    )
    fimi_mse_coef: float = Field(
        0.0, ge=0, description="fimi: weight of mean (r_hat - r)^2 in the fitting model's loss (a review's; 0 = off)"
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
        # a field named <choice>_... belongs to that debias choice: set away from its default under another, it is
        # an error (read from the fields, so a new choice brings its own keys without a rule here)
        choices = get_args(type(self).model_fields["debias"].annotation)
        for key, info in type(self).model_fields.items():
            owner = key.split("_", 1)[0]
            if owner in choices and owner != self.debias and getattr(self, key) != info.default:
                raise ValueError(f"rm.{key}: only debias = {owner!r} uses it (got {getattr(self, key)!r} with "
                                 f"debias = {self.debias!r}); set rm.debias = {owner!r} or leave the default "
                                 f"{info.default!r}")
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
