"""Turn-level estimators that read a critic's values: Turn-PPO (one value per turn) and HiPER (a low
and a high value head over subgoal segments), and where a turn's value is read and fit on the tokens.

Same layout and conventions as :mod:`posttrain.algorithms.advantages.turns` (``[P, G, K]`` turn-level
inputs, ``turn_ids [P, G, T]``, ``broadcast_turns`` to the tokens); ``turn_values`` are ``[P, G, K + 1]``:
V at each turn's start state and, at index n of an n-turn episode, the value after its last turn. No
group baseline is involved: the critic is the baseline.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.advantages._common import register
from posttrain.algorithms.advantages.turns import broadcast_turns

# --------------------------------------------------------------------------- reading a turn's value


def turn_starts(turn_ids_PGT: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The first sampled token of every turn: (positions long ``[P, G, K]``, present bool ``[P, G, K]``).

    A turn's first token is read where the critic saw the whole context before the turn: its value
    V(s_k) is the value at that token (``learn/critic.py`` reads V(s_t) at the position that predicts
    token t, the turn's last context token). An absent turn (or one with no sampled token) has
    position 0 and present False. Hand example: turn_ids [-1, 0, 0, -1, -1, 1, 1] with K = 3 ->
    positions [1, 5, 0], present [True, True, False].
    """
    tid = turn_ids_PGT.long()
    is_k = tid[..., None, :] == torch.arange(k, device=tid.device)[:, None]  # [P, G, K, T]
    present = is_k.any(-1)
    return is_k.int().argmax(-1) * present, present


def turn_start_values(values_PGT: Tensor, turn_ids_PGT: Tensor, k: int) -> Tensor:
    """``turn_values [P, G, K + 1]`` from token values: V(s_k) = values at turn k's first token, 0 on
    absent turns and at index n after an episode's last turn (the end of an episode is terminal, as
    the token-level ``gae`` treats the end of a response: a cut episode bootstraps nothing).
    """
    pos, present = turn_starts(turn_ids_PGT, k)
    v = values_PGT.float().gather(-1, pos) * present
    return torch.cat([v, torch.zeros_like(v[..., :1])], dim=-1)


def turn_start_targets(targets_PGK: Tensor, turn_ids_PGT: Tensor, turn_mask_PGK: Tensor) -> tuple[Tensor, Tensor]:
    """Per-turn targets placed on each reached turn's first token: (targets ``[P, G, T]``, where to fit
    them, float ``[P, G, T]``), 0 elsewhere: the critic of ``turn_ppo`` is fit only where it is read.
    Hand example: turn_ids [-1, 0, 0, -1, 1], targets [0.5, 0.9], both reached ->
    targets [0, 0.5, 0, 0, 0.9], fit [0, 1, 0, 0, 1].
    """
    pos, present = turn_starts(turn_ids_PGT, targets_PGK.shape[-1])
    on = present & turn_mask_PGK.bool()
    t = torch.arange(turn_ids_PGT.shape[-1], device=turn_ids_PGT.device)
    first_PGKT = (t == pos[..., None]) & on[..., None]  # one-hot: turn k's first token
    out = (first_PGKT.to(targets_PGK.dtype) * targets_PGK[..., None]).sum(-2)
    return out, first_PGKT.any(-2).to(targets_PGK.dtype)


# --------------------------------------------------------------------------- Turn-PPO


def _values_after(turn_values: Tensor, turn_mask: Tensor, name: str) -> Tensor:
    k = turn_mask.shape[-1]
    if turn_values.shape[-1] != k + 1:
        raise ValueError(f"{name} must be [P, G, K + 1] = [..., {k + 1}]; got {tuple(turn_values.shape)}")
    return turn_values if turn_values.is_floating_point() else turn_values.float()


def turn_gae(
    turn_rewards: Tensor, turn_values: Tensor, turn_mask: Tensor, *, gamma: float = 0.99, lam: float = 0.9
) -> tuple[Tensor, Tensor]:
    """Turn-level GAE: (advantages ``[P, G, K]``, value targets ``[P, G, K]``), 0 on absent turns.

    ``turn_values [P, G, K + 1]``: V(s_k) at each turn's start state; for an episode of n turns the
    entry n is the value after its last turn (0 when the episode ended, the critic's value when it
    was cut), later entries are ignored.
    """
    v = _values_after(turn_values, turn_mask, "turn_values")
    m = turn_mask.to(v.dtype)
    r = turn_rewards.to(v.dtype) * m
    adv = torch.zeros_like(r)
    next_adv = torch.zeros_like(r[..., 0])  # A_{k+1}; 0 after the last turn
    for k in reversed(range(r.shape[-1])):
        # TD error:   delta_k = r_k + gamma * V(s_{k+1}) - V(s_k)
        delta = r[..., k] + gamma * v[..., k + 1] - v[..., k]
        # recursion:  A_k = delta_k + gamma * lam * A_{k+1}
        next_adv = (delta + gamma * lam * next_adv) * m[..., k]
        adv[..., k] = next_adv
    return adv, (adv + v[..., :-1]) * m


@register("turn_ppo", needs_critic=True, note="it reads a value model's V at each turn's first token")
def turn_ppo(
    rewards: Tensor,
    *,
    turn_rewards: Tensor,
    turn_mask: Tensor,
    turn_values: Tensor,
    turn_ids: Tensor,
    mask: Tensor,
    gamma: float = 0.99,
    lam: float = 0.9,
) -> Tensor:
    """Turn-PPO: GAE on the turn-level MDP, A_k = sum_l (gamma lam)^l delta_{k+l}, one value per turn.

    delta_k = r_k + gamma V(s_{k+1}) - V(s_k), where s_k is the history before turn k and the action
    is the whole turn (``turn_gae``, which also gives the critic's targets A + V). Every sampled token
    of turn k gets A_k. ``turn_values [P, G, K + 1]``: V at each turn's start state, and at index n
    (an episode of n turns) the value after its last turn, 0 when terminal. Defaults gamma 0.99,
    lam 0.9 (the paper's recommendation). Shapes: turn_rewards, turn_mask ``[P, G, K]``; turn_ids,
    mask ``[P, G, T]`` -> ``[P, G, T]`` (``rewards`` unused). Paper: "Turn-PPO: Turn-Level Advantage
    Estimation with PPO for Improved Multi-Turn RL in Agentic LLMs", Li et al. 2025, arXiv:2512.17008,
    seed ``papers/004_f298e9ec572f7f27.txt:159`` (catalog L159; no code published). No std, no
    whitening. In the loop, ``turn_values`` come from PPO's critic read at each turn's last context
    token (``turn_start_values``) and the critic is fit on the targets A_k + V(s_k) at those tokens
    only (``turn_start_targets``); the end of an episode is terminal (V = 0 after the last turn, a cut
    episode included, as ``gae`` ends a response). Not done here: the paper clips the ratio per turn
    (a loss matter; the loop's losses clip per token). Absent turns: 0, and no group baseline is
    involved (the critic is the baseline). Nearest neighbour: ``gae`` runs the same recursion per
    token, with a value per token.
    """
    adv, _ = turn_gae(turn_rewards, turn_values, turn_mask, gamma=gamma, lam=lam)
    return broadcast_turns(adv, turn_ids, mask)


# --------------------------------------------------------------------------- HiPER


def _standardize(x: Tensor, sel: Tensor) -> Tensor:
    """(x - mean) / (population std + 1e-8) over the selected entries; others 0 (HiPER ``norm_adv``)."""
    if not sel.any():
        return torch.zeros_like(x)
    mean, std = x[sel].mean(), x[sel].std(unbiased=False)
    return torch.where(sel, (x - mean) / (std + 1e-8), torch.zeros_like(x))


def hiper_turns(
    turn_rewards: Tensor,
    turn_mask: Tensor,
    turn_values_low: Tensor,
    turn_values_high: Tensor,
    switch: Tensor,
    *,
    gamma: float = 1.0,
    lam_turn: float = 1.0,
    lam_seg: float = 0.95,
    norm_adv: bool = False,
) -> tuple[Tensor, Tensor]:
    """HiPER hierarchical advantages: (A_low ``[P, G, K]`` per turn, A_high ``[P, G, K]`` on segment starts).

    Segments are the runs of turns from one subgoal switch to the next (turn 0 always starts one).
    ``turn_values_low [P, G, K]`` (or ``K + 1``; the extra entry is unused): V_low at each turn.
    ``turn_values_high [P, G, K + 1]``: V_high at each turn's state, read at segment starts, and at
    index n (an episode of n turns) the value after its last turn (0 when terminal).
    """
    k_max = turn_mask.shape[-1]
    vh = _values_after(turn_values_high, turn_mask, "turn_values_high")
    vl = turn_values_low[..., :k_max].to(vh.dtype)
    vl = torch.cat([vl, torch.zeros_like(vl[..., :1])], dim=-1)  # never read past a segment end
    m = turn_mask.bool()
    r = torch.where(m, turn_rewards.to(vh.dtype), torch.zeros_like(vh[..., :-1]))
    start = m & switch.bool()
    start[..., 0] = m[..., 0]
    after = torch.zeros_like(m[..., :1])
    # a turn ends its segment when it is the episode's last or the next turn starts a new one
    end = m & (~torch.cat([m[..., 1:], after], -1) | torch.cat([start[..., 1:], after], -1))
    low, high = torch.zeros_like(r), torch.zeros_like(r)
    zero = torch.zeros_like(r[..., 0])
    next_low, seg_return, seg_disc, next_seg = zero, zero, zero, zero
    for k in reversed(range(k_max)):
        e, mk = end[..., k].to(r.dtype), m[..., k].to(r.dtype)
        # low level, inside a segment: delta_k = r_k + gamma V_low(k+1) - V_low(k),
        # at a segment end it bootstraps on V_high of the next state instead
        v_next = e * vh[..., k + 1] + (1 - e) * vl[..., k + 1]
        delta = r[..., k] + gamma * v_next - vl[..., k]
        next_low = (delta + gamma * lam_turn * (1 - e) * next_low) * mk  # A_k = delta_k + gamma lam A_{k+1}
        low[..., k] = next_low
        # high level (SMDP): target = sum_j gamma^j r over the segment + gamma^d V_high(after it)
        seg_return = r[..., k] + gamma * (e * vh[..., k + 1] + (1 - e) * seg_return)
        seg_disc = gamma * (e + (1 - e) * seg_disc)  # gamma^d at the segment start, d = its turns
        s = start[..., k]
        # A_seg = target - V_high(start) + gamma^d lam_seg A_{next segment}
        a_seg = seg_return - vh[..., k] + seg_disc * lam_seg * next_seg
        high[..., k] = torch.where(s, a_seg, zero)
        next_seg = torch.where(s, a_seg, next_seg)
    if norm_adv:
        low, high = _standardize(low, m), _standardize(high, start)
    return low, high


@register("hiper")
def hiper(
    rewards: Tensor,
    *,
    turn_rewards: Tensor,
    turn_mask: Tensor,
    turn_values_low: Tensor,
    turn_values_high: Tensor,
    switch: Tensor,
    turn_ids: Tensor,
    mask: Tensor,
    subgoal_mask: Tensor | None = None,
    gamma: float = 1.0,
    lam_turn: float = 1.0,
    lam_seg: float = 0.95,
    norm_adv: bool = False,
) -> Tensor:
    """HiPER hierarchical advantage estimation (HAE): turn GAE inside subgoal segments, SMDP GAE across them.

    Segments: the runs of turns between subgoal switches (``switch`` bool ``[P, G, K]``: turn k starts
    a new subgoal; turn 0 always does). Low level, per turn: delta_k = r_k + gamma V_low(k+1) - V_low(k)
    inside a segment and r_k + gamma V_high(next state) - V_low(k) at its last turn; A_low,k = delta_k
    + gamma lam_turn A_low,k+1 within the segment. High level, per segment starting at s with d turns:
    target = sum_{j<d} gamma^j r_{s+j} + gamma^d V_high(s+d); A_high = target - V_high(s) + gamma^d
    lam_seg A_high(next segment). Inputs: ``turn_values_low`` ``[P, G, K]`` (V_low per turn),
    ``turn_values_high`` ``[P, G, K + 1]`` (V_high per turn state; entry n of an n-turn episode is the
    value after its last turn, 0 when terminal), ``subgoal_mask`` ``[P, G, T]`` (optional: the tokens
    of the subgoal block). Tokens: subgoal tokens of a segment's first turn get A_high, subgoal tokens
    of the other turns 0, every other sampled token A_low; without ``subgoal_mask`` all sampled tokens
    get A_low. ``norm_adv`` standardises each level over the batch (population std + 1e-8; over turns
    for A_low, segment starts for A_high). Defaults: gamma 1, lam_turn 1 (verl's ``algorithm.gamma``,
    ``lam``), lam_seg 0.95 (``algorithm.hae.lam_seg``). Shapes: -> ``[P, G, T]`` (``rewards`` unused).
    Paper: "HiPER: Hierarchical Reinforcement Learning with Explicit Credit Assignment for Large
    Language Model Agents", Peng et al. 2026, arXiv:2602.16165, seed
    ``papers/004_f298e9ec572f7f27.txt:221`` (catalog L221). Code: JonP07/HiPER-agent
    ``hiper_hae/core_hae.py`` (``compute_hae_advantage``), ``hiper_hae/hier_mask.py``. Not done here:
    the termination advantage on switch tokens (a third value head), the keep / consistency /
    invalid-action penalties (reward shaping), and ``bootstrap_truncated`` (the code bootstraps a cut
    episode on the *current* state's value; here the caller puts the value after the last turn at
    index n). The code gives A_low only to the action block; here every non-subgoal token of the turn.
    Absent turns: 0; no group baseline (the critics are the baseline). Nearest neighbour:
    ``turn_ppo`` (one value head, no segments): it equals HiPER's A_high when every turn starts a
    segment, with V_high = V and lam_seg = lam (A_low is then the one-step TD error).
    """
    low, high = hiper_turns(
        turn_rewards, turn_mask, turn_values_low, turn_values_high, switch, gamma=gamma, lam_turn=lam_turn,
        lam_seg=lam_seg, norm_adv=norm_adv,
    )
    a_low = broadcast_turns(low, turn_ids, mask)
    if subgoal_mask is None:
        return a_low
    sub = subgoal_mask.to(a_low.dtype)
    return a_low * (1 - sub) + broadcast_turns(high, turn_ids, mask) * sub
