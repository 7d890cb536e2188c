"""Stateful seed methods: state in, advantages out; ``<name>_update_state`` advances the state.

A-GRAE, HA-DW and CAPO, with their frozen ``State`` dataclasses and pure updaters.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from posttrain.algorithms.advantages._common import StdMode, _correct, register
from posttrain.algorithms.advantages.group import grpo


@dataclass(frozen=True)
class AGRAEState:
    """Training progress for ``a_grae``: a running batch accuracy m-bar in [0, 1]."""

    mean_accuracy: float


def a_grae_update_state(state: AGRAEState | None, rewards: Tensor, *, momentum: float = 0.0) -> AGRAEState:
    """Fold this batch's accuracy into the progress: m <- momentum m + (1 - momentum) acc (acc if None).

    ``momentum = 0`` (the default) is the authors' code: the progress is the current batch's accuracy.
    A momentum above 0 smooths it over past batches (ours, for small batches).
    """
    acc = float(_correct(rewards.float()).mean())
    if state is None:
        return AGRAEState(mean_accuracy=acc)
    return AGRAEState(mean_accuracy=momentum * state.mean_accuracy + (1.0 - momentum) * acc)


@register("a_grae")
def a_grae(
    rewards: Tensor,
    *,
    state: AGRAEState | None = None,
    alpha: float = 1.0,
    momentum: float = 0.0,
    eps: float = 1e-6,
) -> Tensor:
    """A-GRAE: difficulty curriculum over the batch plus attenuation of correct trajectories.

    mu_g = group pass rate, A^ = GRPO (unbiased std); m = training progress (mean accuracy).
    A_diff = 0.5 A^ / (sqrt(mu_g) + eps); A_easy = 0.5 A^ / (1 - sqrt(mu_g) + eps);
    A = (1 - m) A_easy + m A_diff (early, low m: easy groups weigh more; later, hard groups);
    then A <- A min(1, m / alpha) where A > 0 (alpha = 1 math, 0.5 geo3k/med in the scripts).
    Progress m: the current batch's mean of mu_g, as the authors' code (``momentum = 0``); with an
    ``AGRAEState`` and ``momentum > 0``, ``a_grae_update_state(state, rewards).mean_accuracy``, the
    past batches' progress with this batch folded in (so the loop's m never lags a batch behind). Shapes: ``[P, G]`` ->
    ``[P, G]``. Paper: "Unveiling Implicit Advantage Symmetry: Why GRPO Struggles with
    Exploration and Difficulty Adaptation", Yu et al. 2026, arXiv:2602.05548, seed
    ``papers/004_f298e9ec572f7f27.txt:161`` (catalog L161, authors' code). Std convention:
    **unbiased**. mu_g is the pass rate (reward > 0.5), equal to the mean reward on {0, 1}
    rewards as in the code. A group of one gets 0. Nearest neighbour: ``f_grpo`` also rescales
    by group success, but statically and symmetrically.
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    mu_P1 = _correct(rewards).mean(dim=1, keepdim=True)
    m = a_grae_update_state(state, rewards, momentum=momentum).mean_accuracy
    adv_PG = grpo(rewards, std="unbiased", eps=eps)
    root_P1 = mu_P1.sqrt()
    a_diff = 0.5 * adv_PG / (root_P1 + eps)
    a_easy = 0.5 * adv_PG / (1.0 - root_P1 + eps)
    mixed = (1.0 - m) * a_easy + m * a_diff
    return torch.where(mixed > 0, mixed * min(1.0, m / alpha), mixed)


@dataclass(frozen=True)
class HADWState:
    """History for ``ha_dw``: the difficulty anchor C in [0, 1] and the recent batch accuracies it averages."""

    anchor: float = 0.5
    recent: tuple[float, ...] = ()


HADWAnchor = Literal["window", "kalman"]


def ha_dw_update_state(
    state: HADWState | None,
    rewards: Tensor,
    *,
    anchor: HADWAnchor = "window",
    window: int = 10,
    eta: float = 0.1,
    stability: float = 1.0,
) -> HADWState:
    """The anchor after this batch (accuracy y_t).

    ``anchor = "window"`` (the default; the authors' code, yangfengkai/HA-DW @ 8b087945fd8a,
    ``verl/trainer/ppo/ray_trainer.py``): C = the mean of the last ``window`` batch accuracies, this
    one included (``reward_window_k`` = 10 in ``examples/hadw_trainer/gspo_hadw.sh``).
    ``anchor = "kalman"``: C+ = (1 - eta_t) C- + eta_t y_t, eta_t = eta * stability clipped to [0, 1],
    the Kalman-style form the closed TRL PRs #4863/#4872 state; ``eta = 0.1`` is the TRL PR's and
    ``stability`` (the paper's sigma_t) = 1.0 ours, not the paper's.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1; got {window}")
    prior = state if state is not None else HADWState()
    y = float(_correct(rewards.float()).mean())
    if anchor == "window":
        recent = (*prior.recent, y)[-window:]
        return HADWState(anchor=sum(recent) / len(recent), recent=recent)
    if anchor != "kalman":
        raise ValueError(f"anchor must be 'window' or 'kalman'; got {anchor!r}")
    rate = min(max(eta * stability, 0.0), 1.0)
    return HADWState(anchor=(1.0 - rate) * prior.anchor + rate * y)


@register("ha_dw")
def ha_dw(
    rewards: Tensor,
    *,
    state: HADWState | None = None,
    scale: float = 1.5,
    anchor: HADWAnchor = "window",
    window: int = 10,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """HA-DW: reweight GRPO advantages by how far a prompt's accuracy is from a history anchor.

    p^ = group accuracy, diff = p^ - C, M = |diff|, D_i = -sgn(A^_i) sgn(diff),
    Phi_i = scale exp(D_i M), A'_i = Phi_i A^_i. Hard prompts (below the anchor) get their positive
    advantages boosted and negative ones damped; easy prompts the reverse, correcting the
    group-relative estimator's difficulty bias. The anchor C: with ``anchor = "window"`` (the
    authors' code) the mean of the last ``window`` = 10 batch accuracies including this batch's
    (``ha_dw_update_state(state, rewards).anchor``; with no history, this batch's accuracy); with
    ``anchor = "kalman"`` the state's anchor before this batch (0.5 when ``state`` is None), advanced
    after the step by ``ha_dw_update_state`` (its eta and sigma_t are ours). Shapes: ``[P, G]`` ->
    ``[P, G]``. Paper: "Your Group-Relative Advantage Is Biased", arXiv:2601.08521, seed
    ``papers/004_f298e9ec572f7f27.txt:29`` (catalog 3.15, from closed TRL PRs #4863/#4872).
    ``scale`` = 1.5 is the authors' value: lambda_scale is the literal 1.5 in
    ``compute_ha_dw_outcome_advantage`` (yangfengkai/HA-DW @ 8b087945fd8a,
    ``verl/trainer/ppo/core_algos.py``), which computes this same Phi (group mean vs anchor, sign of
    r_i - group mean, exp of |diff|). One departure: a group of one gets 0 here (the authors' verl
    gives it scale * r). Std convention: **unbiased** (GRPO, as the authors' ``torch.std``) for A^.
    Nearest neighbour: ``a_grae`` also reweights by difficulty, against batch accuracy rather than
    a history anchor.
    """
    if anchor == "window":
        c = ha_dw_update_state(state, rewards, anchor="window", window=window).anchor
    else:
        c = (state if state is not None else HADWState()).anchor
    adv_PG = grpo(rewards, std=std, eps=eps)
    diff_P1 = _correct(rewards).mean(dim=1, keepdim=True) - c
    direction_PG = -torch.sign(adv_PG) * torch.sign(diff_P1)
    return scale * torch.exp(direction_PG * diff_P1.abs()) * adv_PG


@dataclass(frozen=True)
class CAPOState:
    """Curriculum position for ``capo``: the number of optimizer steps taken so far."""

    step: int = 0


def capo_update_state(state: CAPOState | None, rewards: Tensor | None = None) -> CAPOState:
    """Advance the CAPO curriculum by one step (``rewards`` is accepted for a uniform signature)."""
    prior = state if state is not None else CAPOState()
    return CAPOState(step=prior.step + 1)


@register("capo")
def capo(
    rewards: Tensor,
    *,
    state: CAPOState | None = None,
    switch_step: int = 100,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """CAPO curriculum: positive advantages only (imitation), then all of them (discrimination).

    A = GRPO; while ``state.step < switch_step``: A <- max(A, 0) (negative-advantage samples are
    masked); afterwards A unchanged. Advance the step with ``capo_update_state``. Shapes:
    ``[P, G]`` -> ``[P, G]``. Paper: CAPO (Curriculum Advantage Policy Optimization),
    arXiv:2512.02580, seed ``papers/004_f298e9ec572f7f27.txt:113`` (catalog 3.35, paper and
    summaries; no authors' code found, and a paper note lists "Code: None"). **``switch_step=100``
    is our value, not the paper's**: the paper uses a hard switch at a fraction of the total
    training steps (10-30%, best 20-30%, per a third-party paper note), so set ``switch_step``
    to about 0.2-0.3 x ``train.steps``; 100 is that fraction of a 400-step run. The paper applies
    the mask to PPO, RLOO and REINFORCE++ advantages too. Std convention: **unbiased** (GRPO). A group of one gets 0.
    Nearest neighbour: ``grpo_n`` keeps the opposite sign (negatives only).
    """
    step = (state if state is not None else CAPOState()).step
    adv_PG = grpo(rewards, std=std, eps=eps)
    return adv_PG.clamp(min=0.0) if step < switch_step else adv_PG
