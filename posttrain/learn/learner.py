"""The Learner: owns the policy, its optimizer and schedule, the frozen reference and PPO's critic,
and turns a prepared batch into optimizer steps (the ``learn`` phase).

The policy update runs in minibatches (the batch selector's plan, or ``train.minibatches``), each in
micro-batches of at most ``train.micro_batch_tokens`` tokens whose gradients add up to the
minibatch's (global loss normalizers), with log-probs computed chunk by chunk (no float
``[N, T, V]`` tensor; ``learn/update.py``). The critic is a second learner on the same rollout
batch. After an update the learner hands its weights to the rollout engine with ``sync_to``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor

from posttrain.config import Config
from posttrain.learn.critic import POLICY_FROZEN, Critic
from posttrain.learn.update import policy_update
from posttrain.models.lora import adapter_state_dict, engine_weights
from posttrain.models.precision import autocast_dtype, compute
from posttrain.prepare.prepare import Prepared
from posttrain.produce.collect import Batch
from posttrain.rollout import RolloutEngine
from posttrain.run.parts import Parts


class Learner:
    """Policy (+ reference, + critic) and their optimizers; see the module docstring."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        parts: Parts,
        cfg: Config,
        pad_id: int,
        ref_model: torch.nn.Module | None = None,
        critic: Critic | None = None,
    ) -> None:
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.parts, self.cfg, self.pad_id = parts, cfg, pad_id
        self.ref_model, self.critic = ref_model, critic

    @classmethod
    def build(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        parts: Parts,
        cfg: Config,
        pad_id: int,
        ref_model: torch.nn.Module | None,
        policy_path: str,
        ckpt: Path | None,
        console: Console,
    ) -> Learner:
        """The learner of this run: with PPO's critic when the estimator reads ``values`` (gae),
        built from the policy's start (or ``critic.path``) and restored from ``ckpt``.
        """
        device = str(next(model.parameters()).device)
        critic = Critic.build(cfg, policy_path, ckpt, device) if parts.needs_values else None
        if critic is not None:
            console.print(critic.note)
        if cfg.train.processes > 1:  # the policy on FSDP2 ranks in spawned processes (distributed/fsdp_learner.py)
            from posttrain.learn.distributed.fsdp_learner import ShardedLearner

            return ShardedLearner.start(model, optimizer, scheduler, parts, cfg, pad_id, ref_model, critic, console)
        return cls(model, optimizer, scheduler, parts, cfg, pad_id, ref_model, critic)

    def extras(self) -> dict:
        """Models and optimizers checkpointed beside the policy (the critic's), by name."""
        return self.critic.extras() if self.critic is not None else {}

    @property
    def device(self) -> torch.device:
        """Where the policy's parameters live."""
        return next(self.model.parameters()).device

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
        return self.critic.update(self.cfg, step, prepared.row_prompts, batch.comps, prepared.mask_NT,
                                  self.critic_values(prepared), batch.rewards_PG, self.pad_id, prepared.inputs)

    def policy_step(self, prepared: Prepared, step: int, entropy_state: object | None) -> dict[str, float]:
        """The policy's update on the chosen rows (epochs x minibatches of optimizer steps)."""
        c = prepared.chosen
        with compute(self.device, autocast_dtype(self.cfg.model.autocast)):  # model.autocast: bf16 matmuls
            return policy_update(
                self.model, self.ref_model if self.parts.needs_ref else None, self.optimizer, self.parts, self.cfg,
                c.row_prompts, c.comps, c.mask_NT, c.adv_N, c.row_inputs, self.pad_id, step,
                entropy_state=entropy_state, minibatches=c.minibatches,
            )

    def state_dict(self) -> Mapping[str, Tensor]:
        """The policy's weights that training changes (what an engine samples with): with LoRA only
        the adapter's tensors (the base is frozen), else every weight; under the module's own names.
        """
        return adapter_state_dict(self.model) if self.cfg.model.lora.enabled else self.model.state_dict()

    def close(self) -> None:
        """Release what the learner runs beside this process (the sharded learner's ranks)."""

    def weights_for(self, engine: RolloutEngine) -> Mapping[str, Tensor]:
        """The policy's weights as ``engine`` takes them at a sync (:func:`~posttrain.models.lora.engine_weights`:
        a LoRA policy's adapter for an engine over the policy module or a copy of it, merged for vLLM or Ray
        workers, which hold plain models).
        """
        return engine_weights(self.model, engine)

    def sync_to(self, engine: RolloutEngine, version: int) -> None:
        """Hand the policy's weights to ``engine`` as policy ``version`` (:meth:`weights_for`)."""
        engine.sync(self.weights_for(engine), version)
