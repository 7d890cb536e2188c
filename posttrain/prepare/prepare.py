"""The ``prepare`` phase: a collected batch -> the advantage inputs, the advantages, and the rows and
minibatches the update trains on (the batch selector).

Every method-specific piece is a lookup made at set-up: the inputs the estimator declares come from
their providers (``prepare/providers.py``: forward passes through the Learner, sampled inputs from the
batch), the estimator and the selector from their registries, and stateful ones read their live state
by key (``train/loop_state.py``). Nothing here samples.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from posttrain.prepare.providers import InputContext, StepInputs, kl_reward_metrics, provide
from posttrain.prepare.selectors import STATE_KEY, BatchSelector, UpdateBatch
from posttrain.produce.batch import Batch


@dataclass
class Prepared:
    """What the learner trains on, and what preparing it measured."""

    chosen: UpdateBatch  # the rows, advantages, per-row loss inputs and minibatches of the update
    adv: Tensor  # the estimator's advantages, [P, G] or [P, G, T]
    row_prompts: list[list[int]]  # the prompt of every row of the batch
    mask_NT: Tensor  # the loss mask times the rows' reward validity, of every row of the batch
    inputs: dict[str, Tensor]  # the advantage inputs by name (values and token_rewards feed the critic)
    kl_coef: float  # the KL-in-the-reward beta used
    metrics: dict[str, float]


def prepare(
    ctx: InputContext,
    selector: BatchSelector,
    batch: Batch,
    live: dict[str, object],
    step: int,
) -> Prepared:
    """Advantage inputs -> advantages -> the batch selector's rows and minibatches."""
    parts = ctx.parts
    P, G = batch.rewards_PG.shape
    rollouts = batch.rollouts
    mask_NT = rollouts.loss_mask * batch.valid_PG.reshape(-1, 1)
    kl_coef = float(live.get("kl_reward", parts.kl_reward_coef))  # adaptive: the controller's state
    step_in = StepInputs(batch, mask_NT, kl_coef)
    inputs = provide(ctx, step_in)
    adv = parts.advantage(batch.rewards_PG, batch.rewards_PGK, state=live.get("advantage"), **inputs)
    row_prompts = step_in.row_prompts
    row_inputs = {
        "rewards": batch.rewards_PG.reshape(-1),
        "group_ids": torch.arange(P).repeat_interleave(G),
        "hint_rerolled": batch.rerolled_P.repeat_interleave(G),  # AAPO's groups (HINT)
    }
    if batch.external_PG is not None:  # the external_mix driver's demonstration rows (RL-PLUS's loss)
        row_inputs["external"] = batch.external_PG.reshape(-1)
    for k in parts.weight_row_inputs:  # provided inputs a loss weight reads (80/20's entropies), one per row
        row_inputs[k] = inputs[k].reshape(P * G, *inputs[k].shape[2:])
    chosen = selector.select(
        UpdateBatch(row_prompts, rollouts, mask_NT, adv.reshape(P * G, *adv.shape[2:]), row_inputs),
        batch.rewards_PG, step, live.get(STATE_KEY), ctx.pad_id,
    )
    metrics = {**kl_reward_metrics(inputs.get("token_rewards"), mask_NT.view(P, G, -1), kl_coef), **chosen.metrics}
    return Prepared(chosen, adv, row_prompts, mask_NT, inputs, kl_coef, metrics)
