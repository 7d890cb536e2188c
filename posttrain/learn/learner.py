"""The Learner: owns the policy, its optimizer and schedule, the frozen reference and PPO's critic,
and turns a prepared batch into optimizer steps (the ``learn`` phase).

The policy update runs in minibatches (the batch selector's plan, or ``train.minibatches``), each in
micro-batches of at most ``train.micro_batch_tokens`` tokens whose gradients add up to the
minibatch's (global loss normalizers), with log-probs computed chunk by chunk (no float
``[N, T, V]`` tensor; ``learn/update.py``). The critic is a second learner on the same rollout
batch. After an update the pipeline (``produce/pipeline.py``) takes its weights for the rollout engine
through :meth:`Learner.weights_for`.

Every other forward pass the loop makes on a model is a Learner call too: the policy's token entropies,
the prompts' log-probs, the reference's log-probs and the critic's values (what ``prepare``'s input
providers read). Each runs without gradient in micro-batches of at most ``train.micro_batch_tokens``
tokens with the chunked output head (``learn/forwards.py``), and comes back on the CPU. The sharded
learner (``distributed/fsdp_learner.py``) runs them on its ranks, over the sharded models, each rank
taking its share of the micro-batches.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor

from posttrain.config import LearnSettings
from posttrain.learn.critic import POLICY_FROZEN, Critic
from posttrain.learn.forwards import FORWARDS
from posttrain.learn.parts import LearnParts
from posttrain.learn.update import policy_update
from posttrain.models.lora import adapter_state_dict, engine_weights
from posttrain.models.precision import autocast_dtype, compute
from posttrain.produce.batch import Batch
from posttrain.rollout import Rollout, RolloutEngine


class UpdateRows(Protocol):
    """The rows the policy update trains on and its minibatches (``prepare/selectors.py``'s ``UpdateBatch``)."""

    row_prompts: list[list[int]]
    rollouts: Rollout
    mask_NT: Tensor  # the loss mask times the rows' reward validity
    adv_N: Tensor  # [N] or [N, T]
    row_inputs: dict[str, Tensor]  # per-row loss inputs
    minibatches: list[Tensor] | None  # row indices of each minibatch in order; None: the update's own order


class Prepared(Protocol):
    """What the learn phase reads of a prepared batch (``prepare/prepare.py``'s ``Prepared``)."""

    chosen: UpdateRows
    row_prompts: list[list[int]]  # the prompt of every row of the batch
    mask_NT: Tensor  # the loss mask times the rows' reward validity, of every row of the batch
    inputs: dict[str, Tensor]  # the advantage inputs by name (values and token_rewards feed the critic)


class Learner:
    """Policy (+ reference, + critic) and their optimizers; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        parts: LearnParts,
        settings: LearnSettings,
        pad_id: int,
        ref_model: torch.nn.Module | None = None,
        critic: Critic | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.parts, self.settings, self.pad_id = parts, settings, pad_id
        self.ref_model, self.critic = ref_model, critic

    def extras(self) -> dict:
        """Models and optimizers checkpointed beside the policy (the critic's), by name."""
        return self.critic.extras() if self.critic is not None else {}

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters live."""
        return next(self.model.parameters()).device

    @property
    def budget(self) -> int:
        """Tokens (prompt + completion) one forward pass may hold: ``train.micro_batch_tokens`` (0: no bound)."""
        return self.settings.train.micro_batch_tokens

    @property
    def temperature(self) -> float:
        """The sampling temperature: log-probs and entropies are the sampler's (logits divided by it)."""
        return self.settings.temperature

    def model_for(self, role: str) -> torch.nn.Module:
        """The model a forward pass runs on, by its role in :data:`~posttrain.learn.forwards.FORWARDS`."""
        model = {"policy": self.model, "reference": self.ref_model,
                 "critic": self.critic.model.eval() if self.critic is not None else None}[role]
        if model is None:
            why = {"reference": "the frozen reference model (the loop loads it when the KL is in the loss or in "
                                "the reward)",
                   "critic": "the critic (the learner builds it when the estimator reads values)"}
            raise ValueError(f"this forward pass needs {why[role]}")
        return model

    def forward(self, name: str, **inputs: object) -> object:
        """Forward pass ``name`` of :data:`~posttrain.learn.forwards.FORWARDS` on ``inputs``, here, in micro-batches
        of ``train.micro_batch_tokens`` (the sharded learner runs it on its ranks).
        """
        fn, role = FORWARDS[name]
        return fn(self.model_for(role), **inputs, pad_id=self.pad_id, temperature=self.temperature,
                  budget=self.budget, packing=self.settings.train.packing)

    def token_entropies(self, row_prompts: list[list[int]], rollouts: Rollout) -> Tensor:
        """Entropy of the current policy at every completion token, ``[N, T]`` on the CPU (0 off the loss mask)."""
        h = self.forward("token_entropies", row_prompts=row_prompts, rollouts=rollouts)
        return h * rollouts.loss_mask.float().cpu()

    def reference_logprobs(self, row_prompts: list[list[int]], rollouts: Rollout) -> Tensor:
        """Log pi_ref(y_t | x, y_<t) of the frozen reference at every completion token, ``[N, T]`` on the CPU
        (not masked), at the sampling temperature.
        """
        return self.forward("reference_logprobs", row_prompts=row_prompts, rollouts=rollouts)

    def values(self, row_prompts: list[list[int]], rollouts: Rollout, mask_NT: Tensor) -> Tensor:
        """V(s_t) of the critic at every completion token (``critic.completion_values``), ``[N, T]`` on the
        CPU (where the advantages are computed), 0 where ``mask_NT`` is.
        """
        head = self.critic.head if self.critic is not None else None
        return self.forward("values", row_prompts=row_prompts, rollouts=rollouts, head=head) * mask_NT.float().cpu()

    def prompt_logprobs(self, prompt_ids: list[list[int]]) -> tuple[Tensor, Tensor]:
        """Log pi(x_j | x_<j) of the current policy at every prompt token after the first, ``[P, L - 1]``, and
        its mask, on the CPU (:func:`~posttrain.learn.forwards.prompts_logprobs`).
        """
        return self.forward("prompts_logprobs", prompt_ids=prompt_ids)

    def learn(self, prepared: Prepared, batch: Batch, step: int, entropy_state: object | None) -> dict[str, float]:
        """The critic's update, then the policy's (frozen while the critic warms up); the schedule
        moves by the optimizer steps taken. Returns the update's metrics (``train/optimizer_steps``).
        """
        critic = self.critic
        critic_metrics = self.critic_step(prepared, batch, step) if critic is not None else {}
        if critic is not None and critic.warming_up(step):
            return {**POLICY_FROZEN, **critic_metrics}
        metrics = self.policy_step(prepared, step, entropy_state)
        if metrics["train/optimizer_steps"]:
            self.scheduler.step()  # the schedule counts steps that updated the model
        return {**metrics, **critic_metrics}

    @staticmethod
    def critic_values(prepared: Prepared) -> Tensor:
        """The values the step's advantages read, ``[N, T]``: the critic's regression anchor."""
        return prepared.inputs["values"].reshape(len(prepared.row_prompts), -1)

    def critic_step(self, prepared: Prepared, batch: Batch, step: int) -> dict[str, float]:
        """The critic regresses V on the GAE returns (the policy's minibatches); its metrics."""
        return self.critic.update(self.settings, step, prepared.row_prompts, batch.rollouts, prepared.mask_NT,
                                  self.critic_values(prepared), batch.rewards_PG, self.pad_id, prepared.inputs)

    def policy_step(self, prepared: Prepared, step: int, entropy_state: object | None) -> dict[str, float]:
        """The policy's update on the chosen rows (epochs x minibatches of optimizer steps)."""
        c = prepared.chosen
        with compute(self.device, autocast_dtype(self.settings.model.autocast)):  # model.autocast: bf16 matmuls
            return policy_update(
                self.model, self.ref_model if self.parts.needs_ref else None, self.optimizer, self.parts, self.settings,
                c.row_prompts, c.rollouts, c.mask_NT, c.adv_N, c.row_inputs, self.pad_id, step,
                entropy_state=entropy_state, minibatches=c.minibatches,
            )

    def state_dict(self) -> Mapping[str, Tensor]:
        """The policy's weights that training changes (what an engine samples with): with LoRA only
        the adapter's tensors (the base is frozen), else every weight; under the module's own names.
        """
        return adapter_state_dict(self.model) if self.settings.model.lora.enabled else self.model.state_dict()

    def close(self) -> None:
        """Release what the learner runs beside this process (the sharded learner's ranks)."""

    def weights_for(self, engine: RolloutEngine) -> Mapping[str, Tensor]:
        """The policy's weights as ``engine`` takes them at a sync (:func:`~posttrain.models.lora.engine_weights`:
        a LoRA policy's adapter for an engine over the policy module or a copy of it, merged for vLLM or Ray
        workers, which hold plain models).
        """
        return engine_weights(self.model, engine)
