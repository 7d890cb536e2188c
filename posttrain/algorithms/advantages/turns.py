"""Turn-level estimators for multi-turn episodes: TRLOO, GiGPO, MARS, UI-S1 (the critic-based Turn-PPO and
HiPER are in ``turns_critic``).

Layout (``posttrain/rollout/multiturn.py``): an episode has up to K turns (K = ``max_turns``).
Turn-level inputs are ``[P, G, K]``: ``turn_rewards`` r_{i,k} (0 on absent turns), ``turn_mask``
(episode i reached turn k; the reached turns are a prefix), ``state_ids`` (GiGPO anchor hash, -1 =
none), ``agent_ids`` (player, 0 for one agent), ``expert_match`` (UI-S1); ``turn_values`` is
``[P, G, K + 1]``. ``turn_ids [P, G, T]`` names, on every token of the completion row, the turn whose
sampled action the token is (-1 on context tokens and padding).

Each estimator has a pure ``<name>_turns`` function giving one advantage per turn ``[P, G, K]`` (0 on
absent turns) and a registered entry that maps it to the tokens with ``broadcast_turns``, so the loop
receives a token-level ``[P, G, T]`` advantage. The shared pieces are ``turn_returns`` (the discounted
turn return), ``group_center`` (centre within (prompt, key) groups over the valid turns) and
``broadcast_turns``; ``turns_critic`` adds where a turn's value is read (``turn_starts``,
``turn_start_values``, ``turn_start_targets``).

Absent turns never enter a baseline: every group statistic is taken over the turns an episode
reached. A per-turn-index baseline over variable turn counts is still action-dependent when the
policy decides when to stop (verl RFC #7244): each entry says how its keys see absent turns.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

from posttrain.algorithms.advantages._common import StdMode, _whiten, register

NormMode = Literal["mean_norm", "mean_std_norm"]


# --------------------------------------------------------------------------- shared helpers


def turn_returns(turn_rewards: Tensor, turn_mask: Tensor, gamma: float = 1.0, reset: Tensor | None = None) -> Tensor:
    """Discounted turn returns G_{i,k} = sum_{k' >= k} gamma^{k'-k} r_{i,k'} over the valid turns.

    Shapes: ``[P, G, K]`` -> ``[P, G, K]``, 0 on absent turns (whose rewards are ignored). ``reset``
    (bool ``[P, G, K]``) cuts the chain as UI-S1 does for a turn whose action missed the expert's:
    there G_k = r_k, and the turn before it sees a return of 0 (neither r_k nor anything later
    flows back; ``compute_step_discounted_returns`` in ``UI-S1/uis1/core_uis1.py``).
    """
    m = turn_mask.bool()
    r = torch.where(m, turn_rewards, torch.zeros_like(turn_rewards))
    keep = torch.ones_like(m) if reset is None else ~reset.bool()
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[..., 0])  # G_{k+1}
    for k in reversed(range(r.shape[-1])):
        # G_k = r_k + gamma * G_{k+1}; a reset turn keeps only its own reward
        g = r[..., k] + gamma * running * keep[..., k]
        out[..., k] = g
        # what the turn before sees: 0 after a reset turn (UI-S1) and after an absent turn
        running = g * (keep[..., k] & m[..., k])
    return out * m


def group_center(
    values: Tensor,
    keys: Tensor,
    mask: Tensor,
    *,
    leave_one_out: bool = False,
    std: StdMode = "none",
    eps: float = 1e-6,
) -> Tensor:
    """Centre ``values`` within (prompt, key) groups, counting only the entries where ``mask`` is set.

    Shapes: values, keys (integer), mask (bool) ``[P, ...]`` -> ``[P, ...]``, 0 where mask is 0; the
    group of an entry is (its prompt index p, its key), so equal keys of different prompts never mix
    (reshape to ``[1, ...]`` to group over the whole batch). With N entries in a group:

    - ``leave_one_out=False``: A = (v - mean) / F, F = 1 (``std="none"``) or std + eps (``"unbiased"``:
      ddof 1, ``"population"``: ddof 0). A group of one gets 0 (its mean is itself).
    - ``leave_one_out=True``: A = v - mean of the other N - 1 = N/(N-1) (v - mean); a group of one
      keeps A = v (no other sample, so baseline 0: KernelGYM's rule). Only with ``std="none"``.
    """
    m = mask.bool()
    out = torch.zeros_like(values)
    if not m.any():
        return out
    if leave_one_out and std != "none":
        raise ValueError("group_center: leave_one_out takes no std division (std must be 'none')")
    shape = (values.shape[0],) + (1,) * (values.dim() - 1)
    prompt = torch.arange(values.shape[0], device=values.device).view(shape).expand_as(values)
    pairs = torch.stack([prompt[m], keys.expand_as(values)[m].long()], dim=-1)
    _, group = torch.unique(pairs, dim=0, return_inverse=True)  # group index of each valid entry
    v = values[m]
    n_groups = int(group.max()) + 1
    count = torch.zeros(n_groups, dtype=v.dtype, device=v.device).index_add_(0, group, torch.ones_like(v))
    mean = torch.zeros_like(count).index_add_(0, group, v) / count
    n, centred = count[group], v - mean[group]
    if leave_one_out:
        # v - (sum - v)/(N-1) = N/(N-1) (v - mean); N = 1 keeps v
        adv = torch.where(n > 1, centred * n / (n - 1).clamp(min=1), v)
    elif std == "none":
        adv = centred
    else:
        if std not in ("unbiased", "population"):
            raise ValueError(f"std must be 'unbiased', 'population' or 'none'; got {std!r}")
        ddof = 1.0 if std == "unbiased" else 0.0
        var = torch.zeros_like(count).index_add_(0, group, centred**2) / (count - ddof).clamp(min=1)
        adv = centred / (var.sqrt()[group] + eps)  # a group of one, or of equal values: 0 / eps = 0
    out[m] = adv
    return out


def broadcast_turns(adv_PGK: Tensor, turn_ids_PGT: Tensor, mask_PGT: Tensor) -> Tensor:
    """Token advantages ``[P, G, T]``: adv[p, g, turn_ids] where turn_ids >= 0, times mask, 0 elsewhere.

    Context tokens (environment replies, tool output, template glue) and padding carry turn id -1
    and get 0; so does any token the loss mask excludes.
    """
    k = adv_PGK.shape[-1]
    tid = turn_ids_PGT.long()
    if tid.numel() and int(tid.max()) >= k:
        raise ValueError(f"turn_ids name turn {int(tid.max())}, but the turn-level arrays hold K = {k} turns")
    on = (tid >= 0).to(adv_PGK.dtype) * mask_PGT.to(adv_PGK.dtype)
    return adv_PGK.gather(-1, tid.clamp(min=0)) * on


def _turn_index(turn_mask: Tensor) -> Tensor:
    """The turn index k on every entry of ``[P, G, K]`` (the key of per-turn-index groups)."""
    return torch.arange(turn_mask.shape[-1], device=turn_mask.device).expand(turn_mask.shape)


def _norm_std(mode: NormMode) -> StdMode:
    if mode not in ("mean_norm", "mean_std_norm"):
        raise ValueError(f"mode must be 'mean_norm' or 'mean_std_norm'; got {mode!r}")
    return "none" if mode == "mean_norm" else "unbiased"


# --------------------------------------------------------------------------- TRLOO


def trloo_turns(turn_rewards: Tensor, turn_mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """TRLOO per turn ``[P, G, K]``: the turn return minus the mean return of the other episodes at turn k."""
    returns = turn_returns(turn_rewards, turn_mask, gamma)
    return group_center(returns, _turn_index(turn_mask), turn_mask, leave_one_out=True)


@register("trloo")
def trloo(
    rewards: Tensor,
    *,
    turn_rewards: Tensor,
    turn_mask: Tensor,
    turn_ids: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
) -> Tensor:
    """TRLOO (turn-level REINFORCE leave-one-out): A_{i,k} = G_{i,k} - mean_{j != i, j reached k} G_{j,k}.

    G_{i,k} = sum_{k' >= k} gamma^{k'-k} r_{i,k'} (``turn_returns``); the baseline is the mean return
    at turn k of the *other* episodes of the prompt that reached turn k (N of them, the episode
    included): A = N/(N-1) (G - mean); N = 1 gives A = G. Every sampled token of turn k gets A_{i,k}.
    Shapes: turn_rewards, turn_mask ``[P, G, K]``; turn_ids, mask ``[P, G, T]`` -> ``[P, G, T]``
    (``rewards [P, G]`` unused: the turn rewards carry the outcome). Paper: "Dr. Kernel: Reinforcement
    Learning Done Right for Triton Kernel Generations", Liu et al. 2026, arXiv:2602.05885, seed
    ``papers/004_f298e9ec572f7f27.txt:33`` (catalog 3.17). Code: hkust-nlp/KernelGYM
    ``drkernel/verl_patch/trainer/code/ppo/core_algos.py`` (``compute_multi_turn_returns``,
    ``compute_multi_turn_rloo_outcome_advantage``). No std. Absent turns: an episode that stopped
    before turn k is not in turn k's baseline (KernelGYM skips rows with turn index -1 or loss mask
    0), so N shrinks with k; the baseline of turn k still depends on who stopped (RFC #7244).
    Nearest neighbour: ``rloo`` (the same with K = 1: one return per episode); ``grpo`` gives one
    advantage to the whole episode, this one a separate advantage to each turn.
    """
    return broadcast_turns(trloo_turns(turn_rewards, turn_mask, gamma=gamma), turn_ids, mask)


# --------------------------------------------------------------------------- GiGPO


def gigpo_turns(
    rewards: Tensor,
    turn_rewards: Tensor,
    turn_mask: Tensor,
    state_ids: Tensor,
    *,
    gamma: float = 0.95,
    omega: float = 1.0,
    mode: NormMode = "mean_norm",
    episode_weighting: Literal["trajectory", "steps"] = "trajectory",
    eps: float = 1e-6,
) -> Tensor:
    """GiGPO per turn ``[P, G, K]``: the episode term plus omega times the anchor-state step term."""
    std, m = _norm_std(mode), turn_mask.bool()
    zeros = torch.zeros_like(state_ids, dtype=torch.long)
    if episode_weighting == "trajectory":  # the paper's Eq. 3: one entry per episode
        reached = m.any(dim=-1, keepdim=True)
        a_ep = group_center(rewards.unsqueeze(-1), zeros[..., :1], reached, std=std, eps=eps)
    elif episode_weighting == "steps":  # the code: R_i on every step row, so long episodes weigh more
        a_ep = group_center(rewards.unsqueeze(-1).expand_as(turn_rewards), zeros, m, std=std, eps=eps)
    else:
        raise ValueError(f"episode_weighting must be 'trajectory' or 'steps'; got {episode_weighting!r}")
    returns = turn_returns(turn_rewards, turn_mask, gamma)
    anchored = m & (state_ids >= 0)  # -1: no state key, never grouped
    a_step = group_center(returns, state_ids, anchored, std=std, eps=eps)
    return (a_ep + omega * a_step) * m


@register("gigpo")
def gigpo(
    rewards: Tensor,
    *,
    turn_rewards: Tensor,
    turn_mask: Tensor,
    state_ids: Tensor,
    turn_ids: Tensor,
    mask: Tensor,
    gamma: float = 0.95,
    omega: float = 1.0,
    mode: NormMode = "mean_norm",
    episode_weighting: Literal["trajectory", "steps"] = "trajectory",
    eps: float = 1e-6,
) -> Tensor:
    """GiGPO: A_{i,k} = (R_i - mean_group R) / F + omega (G_{i,k} - mean_anchor G) / F.

    Episode term: the episode reward ``rewards`` R_i centred in its prompt group. Step term: the turn
    return G_{i,k} (gamma 0.95) centred in its *anchor group*, the turns of the prompt group (at any
    turn index) taken from the same state (equal ``state_ids``, the hash of the observation before
    the action); a singleton anchor or ``state_ids`` -1 gets a step term of 0. ``mode="mean_norm"``
    (F = 1, default) or ``"mean_std_norm"`` (F = unbiased std + eps, per group).
    ``episode_weighting="trajectory"`` takes the episode mean (and std) over the episodes as the
    paper's Eq. 3; ``"steps"`` over step rows, each episode counted once per turn it reached, as
    verl-agent (``compute_mean_std_cross_steps=True``) and ROLL (``episode_scores`` on every step
    row) do. Shapes: rewards ``[P, G]``; turn_rewards, turn_mask, state_ids ``[P, G, K]``; turn_ids,
    mask ``[P, G, T]`` -> ``[P, G, T]``. Paper: "Group-in-Group Policy Optimization for LLM Agent
    Training", Feng et al. 2025, arXiv:2505.10978 (an anchor estimator, not a seed; worked test in
    ``research-agents.md`` section 2). Code: verl-agent ``gigpo/core_gigpo.py``
    (``compute_gigpo_outcome_advantage``, ``episode_norm_reward``, ``build_step_group``,
    ``step_norm_reward``) and alibaba/ROLL ``roll/pipeline/agentic/utils.py``
    (``compute_response_level_rewards``). Std convention: **unbiased** in ``mean_std_norm``. A
    prompt group with one episode gets episode term 0 (verl-agent uses mean 0, std 1 there, giving
    R_i). Absent turns: an episode's missing turns join no anchor group and are not counted in the
    ``"steps"`` mean; anchors match states, not turn indices, so a stop does not shift the step
    baseline of the others. verl-agent's text-similarity anchors (``enable_similarity``) are not
    offered: hash similar states to one id. Nearest neighbour: ``uis1`` keys the step term by turn
    index instead of state; ``trloo`` has no episode term.
    """
    adv = gigpo_turns(
        rewards, turn_rewards, turn_mask, state_ids, gamma=gamma, omega=omega, mode=mode,
        episode_weighting=episode_weighting, eps=eps,
    )
    return broadcast_turns(adv, turn_ids, mask)


# --------------------------------------------------------------------------- MARS


def _agent_returns(turn_rewards: Tensor, turn_mask: Tensor, agent_ids: Tensor, gamma: float) -> Tensor:
    """Per-agent turn returns: G_{i,k} sums the rewards of the later turns *of the same agent*.

    gamma counts the agent's own turns (MARS keeps one row per player, so a player's return never
    sees the other player's turns).
    """
    m = turn_mask.bool()
    r = torch.where(m, turn_rewards, torch.zeros_like(turn_rewards))
    out = torch.zeros_like(r)
    for a in torch.unique(agent_ids[m]).tolist():
        running = torch.zeros_like(r[..., 0])
        for k in reversed(range(r.shape[-1])):
            own = m[..., k] & (agent_ids[..., k] == a)
            g = r[..., k] + gamma * running  # G_k = r_k + gamma G_{next own turn}
            out[..., k] = torch.where(own, g, out[..., k])
            running = torch.where(own, g, running)
    return out


def mars_turns(
    turn_rewards: Tensor,
    turn_mask: Tensor,
    agent_ids: Tensor,
    *,
    gamma: float = 1.0,
    norm: Literal["mean", "mean_std"] = "mean",
    scope: Literal["batch", "group"] = "batch",
    center_rewards: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """MARS per turn ``[P, G, K]``: per-agent turn returns, centred (and scaled) per agent."""
    if norm not in ("mean", "mean_std"):
        raise ValueError(f"norm must be 'mean' or 'mean_std'; got {norm!r}")
    if scope not in ("batch", "group"):
        raise ValueError(f"scope must be 'batch' or 'group'; got {scope!r}")
    k = turn_mask.shape[-1]

    def per_agent(x: Tensor, std: StdMode) -> Tensor:
        if scope == "group":
            return group_center(x, agent_ids, turn_mask, std=std, eps=eps)
        flat = (x.reshape(1, -1, k), agent_ids.reshape(1, -1, k), turn_mask.reshape(1, -1, k))
        return group_center(*flat, std=std, eps=eps).view_as(x)

    r = per_agent(turn_rewards, "none") if center_rewards else turn_rewards
    returns = _agent_returns(r, turn_mask, agent_ids, gamma)
    return per_agent(returns, "none" if norm == "mean" else "unbiased")


@register("mars_turn")
def mars_turn(
    rewards: Tensor,
    *,
    turn_rewards: Tensor,
    turn_mask: Tensor,
    agent_ids: Tensor,
    turn_ids: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    norm: Literal["mean", "mean_std"] = "mean",
    scope: Literal["batch", "group"] = "batch",
    center_rewards: bool = False,
    whiten: bool = False,
    eps: float = 1e-6,
) -> Tensor:
    """MARS turn-level advantage: A_{i,k} = (G_{i,k} - mean_agent G) / F, G over the agent's own turns.

    G_{i,k} = sum of gamma^j r over turn k and the later turns of the same agent (``agent_ids``; the
    j-th later own turn is discounted gamma^j). Then per-agent normalisation (``norm="mean"``: F = 1,
    the self-play script's ``advantage_norm: mean``; ``"mean_std"``: F = unbiased std + eps) over
    the valid turns of that agent in the whole batch (``scope="batch"``, MARS) or in the prompt group
    (``"group"``). ``center_rewards`` first centres the turn rewards per agent (the script's
    ``reward_normalization: {method: mean, separate_norm_for_selfplay: true}``); ``whiten`` then
    whitens the token advantages over the batch (``whiten_advantages: true``; unbiased variance). Both
    are off by default (the config defaults; the catalog spec). Shapes: turn_rewards, turn_mask,
    agent_ids ``[P, G, K]``; turn_ids, mask ``[P, G, T]`` -> ``[P, G, T]`` (``rewards`` unused).
    Paper: "MARS: Reinforcing Multi-Agent Reasoning of LLMs through Self-Play in Strategic Games",
    Yuan et al. 2025, arXiv:2510.15414, seed ``papers/004_f298e9ec572f7f27.txt:137`` (catalog L137).
    Code: thu-nics/MARS ``roll/utils/functionals.py`` (``compute_reinforce_return``,
    ``normalize_unique_values_by_player``, ``reward_postprocess_agentic``). Departures from the code:
    the code normalises over the *unique* advantage values of a player (a quirk: repeated values count
    once), this one over samples (turns), as the catalog asks; the code discounts per token, this one
    per turn (the same at the default gamma = 1); the code groups players by the ``_p0``/``_p1``
    suffix of two players, this one any number of ``agent_ids``. Absent turns: not in the agent
    statistics. Nearest neighbour: with one agent, a turn-level REINFORCE with a batch baseline (GEM's
    ReBN); ``trloo`` keys the baseline by turn index within the prompt instead of by agent.
    """
    adv = mars_turns(
        turn_rewards, turn_mask, agent_ids, gamma=gamma, norm=norm, scope=scope, center_rewards=center_rewards,
        eps=eps,
    )
    out = broadcast_turns(adv, turn_ids, mask)
    if whiten:
        m = mask.to(out.dtype)
        out = _whiten(out, m) * m
    return out


# --------------------------------------------------------------------------- UI-S1


def uis1_turns(
    turn_rewards: Tensor,
    turn_mask: Tensor,
    expert_match: Tensor,
    *,
    gamma: float = 0.5,
    step_advantage_w: float = 1.0,
    episode_advantage_w: float = 1.0,
    mode: NormMode = "mean_norm",
    eps: float = 1e-6,
) -> Tensor:
    """UI-S1 per turn ``[P, G, K]``: w_ep A_ep + w_step A_step (see the ``uis1`` entry)."""
    std, m = _norm_std(mode), turn_mask.bool()
    returns = turn_returns(turn_rewards, turn_mask, gamma, reset=~expert_match.bool())
    a_step = group_center(returns, _turn_index(turn_mask), m, std=std, eps=eps)
    a_ep = group_center(turn_rewards, torch.zeros_like(_turn_index(turn_mask)), m, std=std, eps=eps)
    return episode_advantage_w * a_ep + step_advantage_w * a_step


@register("uis1")
def uis1(
    rewards: Tensor,
    *,
    turn_rewards: Tensor,
    turn_mask: Tensor,
    expert_match: Tensor,
    turn_ids: Tensor,
    mask: Tensor,
    gamma: float = 0.5,
    step_advantage_w: float = 1.0,
    episode_advantage_w: float = 1.0,
    mode: NormMode = "mean_norm",
    eps: float = 1e-6,
) -> Tensor:
    """UI-S1 (semi-online RL): A_{i,k} = w_ep (r_{i,k} - mean_task r) + w_step (R_{i,k} - mean_{task,k} R).

    Step return with a reset: R_k = r_k + gamma R_{k+1} if turn k's action matched the expert's
    (``expert_match``), else R_k = r_k and the turn before sees 0 (``turn_returns(reset=...)``).
    Step term: R centred over the episodes of the prompt at the same turn index. "Episode" term, as the
    code computes it: each turn's *own* score (its reward r_{i,k}, the row's summed
    ``token_level_rewards``) centred over every reached turn of every episode of the prompt
    (``compute_mean_std_cross_all_data=True``); the episode reward ``rewards`` is not read.
    ``mode="mean_norm"`` (F = 1, the function default) or ``"mean_std_norm"`` (unbiased std + eps, the
    example script's choice); gamma 0.5 (the example script; verl's default is 1). Shapes:
    turn_rewards, turn_mask, expert_match ``[P, G, K]``; turn_ids, mask ``[P, G, T]`` -> ``[P, G, T]``.
    Paper: "UI-S1: Advancing GUI Automation via Semi-online Reinforcement Learning", Lu et al. 2025,
    arXiv:2509.11543, seed ``papers/004_f298e9ec572f7f27.txt:207`` (catalog L207). Code:
    X-PLUG/MobileAgent ``UI-S1/uis1/core_uis1.py`` (``compute_step_discounted_returns``,
    ``compute_uis1_outcome_advantage``, ``episode_norm_reward``, ``step_norm_reward``). A prompt with
    one reached turn gets episode term 0 (the code: mean 0, so r itself); a singleton (prompt, turn)
    group gets step term 0 (as the code). Absent turns: not in either mean; the step baseline at turn
    k covers only the episodes that reached k (RFC #7244). Training needs expert trajectories and a
    patch module in the rollout, which posttrain has not. Nearest neighbour: ``gigpo`` (same
    structure, step groups keyed by anchor state instead of turn index; episode term on R_i).
    """
    adv = uis1_turns(
        turn_rewards, turn_mask, expert_match, gamma=gamma, step_advantage_w=step_advantage_w,
        episode_advantage_w=episode_advantage_w, mode=mode, eps=eps,
    )
    return broadcast_turns(adv, turn_ids, mask)
