"""``[train]`` (the RL update: optimizer, schedule, epochs, minibatches, micro-batches, ranks) and
``[critic]`` (the value model of PPO-style estimators).
"""

from __future__ import annotations

import importlib.util
from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.algorithms import value
from posttrain.config.base import Params, Section
from posttrain.errors import unknown_name


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
    optimizer: Literal["adamw", "adamw_8bit", "adamw_4bit"] = Field(
        "adamw", description="the policy's AdamW: adamw keeps fp32 moments (8 bytes a parameter); adamw_8bit / "
        "adamw_4bit are torchao's block-quantized moments (about 2 / 1 bytes a parameter; the lowbit_optim extra; "
        "compiled per parameter shape at the first step; docs/memory.md)")
    gradient_checkpointing: bool = Field(
        False, description="the policy's decoder layers recompute their activations in the backward pass: "
        "the update's activation memory drops to each layer's input, for one more forward of the trunk "
        "(models/checkpointing.py; docs/memory.md)")
    packing: bool = Field(
        False, description="the policy's log-prob forwards (the update's, pi_old's, the reference's, entropies) "
        "pack each micro-batch's rows (prompt + real completion tokens, no padding) into one sequence with "
        "per-row position ids and attention that never crosses rows; train.micro_batch_tokens then counts real "
        "tokens, not the padded width. Same log-probs and loss as unpacked; a group's prompt is no longer shared "
        "(learn/packing.py; docs/memory.md)")
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
        "accumulated to the minibatch's (the loss is that of one batch); the learner's other forwards (entropies, "
        "prompt and reference log-probs, critic values) run in such micro-batches too; 0 = each minibatch, and "
        "each of those, in one pass",
    )
    processes: int = Field(
        1,
        ge=1,
        description="learner processes: > 1 shards the policy over this many spawned ranks with FSDP2 (gloo on the "
        "CPU, NCCL on GPUs), each taking its share of every minibatch's micro-batches (docs/scaling.md)",
    )


    @field_validator("optimizer")
    @classmethod
    def _optimizer_installed(cls, v: str) -> str:
        if v != "adamw" and importlib.util.find_spec("torchao") is None:
            raise ValueError(f"train.optimizer = {v!r} needs torchao: pip install 'posttrain[lowbit_optim]'")
        return v


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
    head: str = Field(
        "scalar",
        description="the value head (posttrain/algorithms/value.py): scalar (one output, PPO's clipped squared "
        "error) or hl_gauss (value classification over bins, arXiv:2403.03950; recipes/ppo_hl_gauss.toml)",
    )
    head_params: Params = Field({}, description="the head's parameters, e.g. { bins = 51, low = -1.5, high = 1.5 }")

    @model_validator(mode="after")
    def _head_known(self) -> CriticConfig:
        """``critic.head`` names a value head that takes ``critic.head_params`` (a bad one fails here, not mid-run)."""
        if self.head not in value.REGISTRY:
            raise ValueError(unknown_name("critic.head", value.REGISTRY.kind, self.head, value.names()))
        extra = sorted(set(self.head_params) - set(value.REGISTRY.params(self.head)))
        if extra:
            raise ValueError(f"critic.head_params: value head {self.head!r} has no parameter(s) {extra}; accepted: "
                             f"{value.REGISTRY.params(self.head)}")
        try:
            value.head(self.head, **self.head_params)
        except ValueError as e:
            raise ValueError(f"critic.head_params: {e}") from None
        return self
