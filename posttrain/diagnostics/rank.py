"""Effective rank of hidden states and VERL's rank velocity (ERV) and acceleration (ERA).

Paper: "VERL: Velocity-Exploiting Rank-Learning" (seed papers/004_f298e9ec572f7f27.txt:3; catalog
3.8), code hf618/VERL ``verl/trainer/metrics_utils.py`` (``compute_single_effective_rank``,
``calculate_diffs_for_single_sample_*``) and ``verl/trainer/metrics_calculator.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import Tensor


def _effective_rank_2d(h_LD: Tensor, center: bool) -> Tensor:
    h = h_LD.float()
    if center:
        h = h - h.mean(dim=0, keepdim=True)
    s = torch.linalg.svdvals(h)
    total = s.sum()
    if h.shape[0] == 0 or total <= 0:
        return torch.zeros((), device=h.device)
    p = s / total
    entropy = -torch.where(p > 0, p * torch.log(p), torch.zeros_like(p)).sum()  # 0 log 0 = 0
    return torch.exp(entropy)


@torch.no_grad()
def effective_rank(hidden: Tensor, mask_NT: Tensor | None = None, *, center: bool = True) -> Tensor:
    """Effective rank (Roy & Vetterli 2007): ER(H) = exp(-sum_j p_j log p_j), p_j = s_j / sum_k s_k.

    s_j are the singular values of H (rows centred first when ``center``, as VERL does), so ER is
    the exponential of the Shannon entropy of the L1-normalized spectrum: it lies in
    [1, rank(H)] and equals r for r equal nonzero singular values. ER = 0 when H has no spread
    (all rows equal, or fewer than 2 rows with centring); VERL's code returns 0 for fewer than 2
    rows and exp(0) = 1 for equal rows.

    - ``hidden [N, D]``: one ER of the N x D matrix, a 0-dim tensor (VERL's "global" metric uses
      the mean hidden state of each response as the rows).
    - ``hidden [N, T, D]`` with ``mask [N, T]``: one ER per sequence over its masked tokens,
      ``[N]`` (VERL's per-response "Effective Rank", averaged over the batch for logging).

    VERL takes s from ``eigvalsh`` of the Gram matrix and adds 1e-8 inside the log; svdvals is
    used here (same values, better conditioned).
    """
    if hidden.dim() == 2:
        return _effective_rank_2d(hidden, center)
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be [N, D] or [N, T, D]; got shape {tuple(hidden.shape)}")
    if mask_NT is None:
        mask_NT = torch.ones(hidden.shape[:2], dtype=torch.bool, device=hidden.device)
    m = mask_NT.to(torch.bool)
    return torch.stack([_effective_rank_2d(hidden[i][m[i]], center) for i in range(hidden.shape[0])])


@dataclass(frozen=True)
class RankDynamicsState:
    """Running state for ERV / ERA over a sequence of effective-rank values x_1, x_2, ...

    ``count`` values seen with sum ``history_sum``; ``last_diff`` / ``last_diff2`` the latest
    d_j / dd_j (None before they exist); ``diff_sum``, ``diff_count``, ``diff2_sum``,
    ``diff2_count`` accumulate them for the means :attr:`erv` and :attr:`era`.
    """

    count: int = 0
    history_sum: float = 0.0
    last_value: float | None = None
    last_diff: float | None = None
    last_diff2: float | None = None
    diff_sum: float = 0.0
    diff_count: int = 0
    diff2_sum: float = 0.0
    diff2_count: int = 0

    @property
    def erv(self) -> float:
        """Effective Rank Velocity: mean of the d_j so far (NaN before the second value)."""
        return self.diff_sum / self.diff_count if self.diff_count else math.nan

    @property
    def era(self) -> float:
        """Effective Rank Acceleration: mean of the dd_j so far (NaN before the third value)."""
        return self.diff2_sum / self.diff2_count if self.diff2_count else math.nan


def rank_dynamics_update(state: RankDynamicsState, value: float) -> RankDynamicsState:
    """Feed one effective-rank value x_j; returns the new state (pure).

    VERL's rule (``calculate_diffs_for_single_sample_original``), which is *not* a plain finite
    difference: the first difference is taken against the mean of all earlier values,
      d_j = x_j - (1 / (j - 1)) sum_{i<j} x_i          (j >= 2)
      dd_j = d_j - d_{j-1}                             (j >= 3)
    and ERV = mean_j d_j, ERA = mean_j dd_j. VERL feeds the ER of growing token prefixes of one
    response (see :func:`effective_rank_dynamics`); the same update can follow a per-step metric
    across training steps. Example: x = 1, 2, 4, 7 -> d = 1, 2.5, 4.6667 and dd = 1.5, 2.1667,
    so ERV = 2.7222 and ERA = 1.8333 (plain differences would give 2 and 1).
    """
    new = replace(state, count=state.count + 1, history_sum=state.history_sum + value, last_value=value)
    if state.count == 0:
        return new
    diff = value - state.history_sum / state.count
    new = replace(new, last_diff=diff, diff_sum=state.diff_sum + diff, diff_count=state.diff_count + 1)
    if state.last_diff is None:
        return new
    diff2 = diff - state.last_diff
    return replace(new, last_diff2=diff2, diff2_sum=state.diff2_sum + diff2, diff2_count=state.diff2_count + 1)


@torch.no_grad()
def effective_rank_dynamics(hidden_TD: Tensor, *, stride: int = 1, center: bool = True) -> tuple[float, float, float]:
    """ER, ERV and ERA of one response's hidden states ``[T, D]`` (its valid tokens only).

    ER is :func:`effective_rank` of the whole response. ERV / ERA come from
    :func:`rank_dynamics_update` fed with ER(H[: t + 1]) for t = stride, 2 stride, ... < T, the
    prefixes VERL uses (``for t in range(stride, valid_len, stride)``); NaN when the response is
    too short (T < 2 stride + 1 for ERV). Cost: T / stride SVDs, a diagnostic, not a per-token
    metric for long responses (VERL updates Gram matrices incrementally; not done here).
    """
    if stride < 1:
        raise ValueError(f"stride must be >= 1; got {stride}")
    state = RankDynamicsState()
    for t in range(stride, hidden_TD.shape[0], stride):
        state = rank_dynamics_update(state, float(_effective_rank_2d(hidden_TD[: t + 1], center)))
    return float(_effective_rank_2d(hidden_TD, center)), state.erv, state.era
