"""The run's learner: in this process (``learn/learner.py``), or on ``train.processes`` FSDP2 ranks
(``learn/distributed/fsdp_learner.py``), with PPO's critic when the estimator reads values.

It stands beside both so that neither imports the other's module back (the sharded learner is a
subclass of the one-process one).
"""

from __future__ import annotations

from pathlib import Path

import torch
from rich.console import Console

from posttrain.config import LearnSettings
from posttrain.learn.critic import Critic
from posttrain.learn.distributed.fsdp_learner import ShardedLearner
from posttrain.learn.learner import Learner
from posttrain.learn.packing import check_packing
from posttrain.learn.parts import LearnParts
from posttrain.models.checkpointing import enable_checkpointing


def build_learner(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    parts: LearnParts,
    settings: LearnSettings,
    pad_id: int,
    ref_model: torch.nn.Module | None,
    policy_path: str,
    ckpt: Path | None,
    console: Console,
) -> Learner:
    """The learner of this run: with PPO's critic when the estimator reads ``values`` (gae),
    built from the policy's start (or ``critic.path``) and restored from ``ckpt``; on FSDP2 ranks in
    spawned processes (or Ray actors) when ``train.processes > 1``.
    """
    device = str(next(model.parameters()).device)
    if settings.train.gradient_checkpointing and settings.train.processes == 1:  # ranks checkpoint their own copy
        layers = enable_checkpointing(model)  # (its hooks are local functions a spawned rank could not unpickle)
        console.print(f"gradient checkpointing: {layers} decoder layers recompute their activations in the backward")
    if settings.train.packing:  # a probe of two packed rows: an attention that lets them mix is refused here
        console.print(check_packing(model))
    critic = Critic.build(settings, policy_path, ckpt, device) if parts.needs_values else None
    if critic is not None:
        console.print(critic.note)
    if settings.train.processes > 1:
        return ShardedLearner.start(model, optimizer, scheduler, parts, settings, pad_id, ref_model, critic, console)
    return Learner(model, optimizer, scheduler, parts, settings, pad_id, ref_model, critic)
