"""Group filters (the registry) and the DAPO accumulator: ``none``, ``dynamic_sampling``, ``rest_grpo``,
``all_correct``; ``dynamic_sampling_step``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from posttrain.algorithms.selection._common import _spread_PG, register

StopReason = Literal["continue", "full", "limit"]


@register("none")
def keep_all(rewards: Tensor) -> Tensor:
    """Keep every group: keep_p = True (the default: no filtering).

    Shapes: rewards ``[P, G]`` -> keep ``[P]`` bool. No paper. Nearest neighbour:
    ``dynamic_sampling`` drops the zero-variance groups that this keeps.
    """
    return torch.ones(rewards.shape[0], dtype=torch.bool)


@register("dynamic_sampling")
def dynamic_sampling(rewards: Tensor, *, tol: float = 0.0, keep_singletons: bool = True) -> Tensor:
    """DAPO dynamic sampling filter: keep_p = (max_g r_pg - min_g r_pg > tol).

    Drops zero-variance groups (all rewards equal), whose GRPO advantage is zero everywhere.
    Shapes: rewards ``[P, G]`` (any per-sample metric: verl's ``filter_groups.metric`` is ``acc``,
    ``score`` or ``seq_reward``) -> keep ``[P]`` bool.
    Paper: "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", Yu et al. 2025,
    arXiv:2503.14476 (catalog B7; a baseline, no seed line). Code: verl ``recipe/dapo``.
    Convention: verl keeps a group when ``np.std(metric) > 0`` or it has one member; max - min
    with ``tol=0`` is the same test without float round-off (``np.std`` of [0.1, 0.1, 0.1] is
    1.4e-17, not 0). HINT's ``skip_zero_groups`` is ``tol=1e-4``. A singleton group (G = 1) is
    kept, as verl does (``keep_singletons=False`` drops it); note that this library's ``grpo``
    gives a singleton advantage 0, where verl's gives it r.
    Nearest neighbour: ``all_correct`` (NGRPO) drops only all-max groups and keeps all-wrong ones;
    ``rest_grpo`` drops groups whose spread is small, not only zero.
    Pair with :func:`dynamic_sampling_step` to refill the batch.
    """
    keep_P = _spread_PG(rewards) > tol
    if keep_singletons and rewards.shape[1] == 1:
        keep_P = torch.ones_like(keep_P)
    return keep_P


@register("rest_grpo")
def rest_grpo(rewards: Tensor, *, min_std: float = 0.05) -> Tensor:
    """ReST-GRPO reward-spread filter: keep_p = (sigma_p(r_p) >= min_std), population std.

    Shapes: rewards ``[P, G]`` -> keep ``[P]`` bool. Std convention: population (ddof=0,
    ``np.std``), as in ``experiment/process_gen_data.py`` (``std_accept_threshold_grpo=0.05``).
    Paper: "ReST-RL: Achieving Accurate Code Reasoning of LLMs with Optimized Self-Training and
    Decoding", Zhoubian et al. 2025, arXiv:2508.19576; seed ``papers/000_99b2b1db2eead048.txt:11``
    (catalog 3.4). Code: THUDM/ReST-RL. In the paper this runs offline, on completions sampled
    before a GRPO round; kept prompts with a good best completion also get partial-state prompts
    (:func:`rest_partial_state_mask`, :func:`rest_sample_prefixes`).
    Nearest neighbour: ``dynamic_sampling`` drops only zero-spread groups; this drops low-spread
    ones too (for rewards in {0, 1} with G = 4, sigma_p is 0 or >= 0.433, so they agree).
    """
    if rewards.numel() == 0:
        return torch.zeros(rewards.shape[0], dtype=torch.bool)
    return rewards.std(dim=1, unbiased=False) >= min_std


@register("all_correct")
def all_correct(rewards: Tensor, *, max_reward: float = 1.0) -> Tensor:
    """NGRPO ``all_correct`` filter: keep_p = not all_g (r_pg >= max_reward).

    Drops groups whose rewards are all the maximum and keeps all-wrong groups, because NGRPO's
    virtual max-reward sample gives them a negative advantage (-0.447212 each for [0, 0, 0, 0]).
    Shapes: rewards ``[P, G]`` -> keep ``[P]`` bool. A singleton correct group is dropped.
    Paper: "NGRPO: Negative-enhanced Group Relative Policy Optimization", Nan et al. 2025,
    arXiv:2509.18851; seed ``papers/004_f298e9ec572f7f27.txt:57`` (catalog 3.22). Code:
    nangongrui-ngr/NGRPO ``verl/trainer/ppo/ray_trainer.py`` (``filter_groups.strategy``), where
    "correct" is ``score == 1`` (``score > 0`` with the DAPO reward manager); ``max_reward`` is
    NGRPO's ``algorithm.max_reward``.
    Nearest neighbour: ``dynamic_sampling`` also drops all-wrong groups.
    """
    if rewards.shape[1] == 0:
        return torch.ones(rewards.shape[0], dtype=torch.bool)
    return ~(rewards >= max_reward).all(dim=1)


# --------------------------------------------------------------------------- DAPO accumulator


@dataclass(frozen=True)
class DynamicSamplingState:
    """What DAPO's "keep generating" loop has gathered so far.

    ``kept``: (generation batch index, group index in that batch) of every kept group, in arrival
    order, at most ``train_batch_size`` of them once full. ``num_gen_batches``: batches seen.
    """

    kept: tuple[tuple[int, int], ...] = ()
    num_gen_batches: int = 0

    @property
    def num_kept(self) -> int:
        """Number of kept groups."""
        return len(self.kept)


def dynamic_sampling_step(
    state: DynamicSamplingState,
    keep: Tensor,
    *,
    train_batch_size: int,
    max_num_gen_batches: int = 10,
) -> tuple[DynamicSamplingState, StopReason]:
    """Add one generation batch's keep mask ``[P]`` to the DAPO accumulator; say whether to stop.

    Returns ``(new_state, reason)``: ``"full"`` once ``train_batch_size`` groups are kept (the
    surplus of the last batch is dropped, like verl's ``batch[:train_batch_size * n]``),
    ``"limit"`` when ``max_num_gen_batches`` batches have been generated without filling it, else
    ``"continue"``. ``max_num_gen_batches <= 0`` means no limit. Full is checked first, as in verl.
    verl raises at the limit; here the caller decides (train on the partial batch or fail).
    Paper: DAPO, arXiv:2503.14476 (catalog B7); default 10 is the DAPO recipe's
    ``max_num_gen_batches``. Nearest neighbour: none; the filter is :func:`dynamic_sampling`.
    """
    if train_batch_size <= 0:
        raise ValueError(f"train_batch_size must be positive; got {train_batch_size}")
    if keep.dim() != 1 or keep.dtype != torch.bool:
        raise ValueError(f"keep must be a [P] bool mask; got {keep.dtype} {tuple(keep.shape)}")
    batch = state.num_gen_batches
    new = tuple((batch, int(p)) for p in keep.nonzero().flatten().tolist())
    kept = state.kept + new
    new_state = DynamicSamplingState(kept=kept[:train_batch_size], num_gen_batches=batch + 1)
    if len(kept) >= train_batch_size:
        return new_state, "full"
    if 0 < max_num_gen_batches <= new_state.num_gen_batches:
        return new_state, "limit"
    return new_state, "continue"
