"""Advantage estimators: rewards ``[P, G]`` (+ named extra inputs) -> advantages.

Contract (``DESIGN.md``): ``compute(name, rewards, **kwargs)``. ``rewards`` is float ``[P, G]``
(P prompts, G completions per prompt). Extra inputs arrive by documented names (``lengths``,
``mask``, ``logprobs``, ``entropies``, ``values``, ``token_rewards``, ``state``); each estimator
accepts the ones it needs and ignores the rest, so the loop can pass what it has without knowing
which estimator it runs. Sequence-level estimators return ``[P, G]``; token-level ones
``[P, G, T]``. Outputs never carry gradient.

Conventions shared by the entries below:

- *Correct* means ``reward > CORRECT_THRESHOLD`` (0.5). This reads binary ``{0, 1}`` and
  ``{-1, 1}`` verifier rewards alike, and a correctness reward plus a small format bonus. Entries
  that count correct responses (pass rate, polarity) say so in their docstring.
- A group of one (``G == 1``) has no group baseline: group-relative entries return 0 for it, unless
  the method brings an outside baseline (``remax``'s greedy reward, ``ngrpo``'s virtual sample)
  or is not group-relative (``nsr``, ``w_reinforce``). verl instead uses mean 0 / std 1 for a
  singleton group; the difference only matters for a group of one.
- Token-level entries return ``[P, G, T]`` already multiplied by ``mask`` (0 on padding).
- Token rewards: the sequence reward ``rewards [P, G]`` is placed on the last response token (the
  last position where ``mask`` is 1); ``token_rewards [P, G, T]``, when given, are *added* per
  token (e.g. a KL penalty ``-beta * k1`` or process rewards). Do not also put the outcome score in
  ``token_rewards``: it would count twice.
- Stateful entries (``a_grae``, ``ha_dw``, ``capo``) take ``state`` (a frozen dataclass; ``None``
  means the initial state), read it, and return only the advantages, so ``compute`` keeps its one
  Tensor result. The caller advances the state after the step with the pure function
  ``<name>_update_state(state, rewards, ...) -> State`` of this module::

      adv = advantages.compute("ha_dw", rewards, state=st)
      st = advantages.ha_dw_update_state(st, rewards)

- Extra inputs beyond the DESIGN list, by name: ``metric [P, G]`` (``canon``),
  ``baseline_rewards [P]`` (``remax``), ``prompt_confidence [P]`` and ``answer_confidence [P, G]``
  (``progrpo``); multi-reward entries (``gdpo``, ``gd2po``) take ``rewards [P, G, K]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry

REGISTRY: Registry = Registry("advantage estimator")
register = REGISTRY.register
names = REGISTRY.names

StdMode = Literal["unbiased", "population", "none"]

REWARD_COMPONENTS = ("gdpo", "gd2po")
"""Estimators that take every reward component, ``rewards [P, G, K]``, rather than their weighted sum."""

CORRECT_THRESHOLD = 0.5
"""A response counts as correct when its reward is above this (binary {0,1} or {-1,1} rewards)."""


def compute(name: str, rewards: Tensor, **kwargs: object) -> Tensor:
    """Look up estimator ``name`` and apply it to ``rewards [P, G]``.

    Keyword arguments the estimator does not declare are ignored, so callers may pass every
    extra input they have (``lengths``, ``mask``, ...). Parameters it does declare are checked.
    """
    fn = REGISTRY.get(name)
    if rewards.dim() < 2:
        raise ValueError(f"rewards must be [P, G] (or [P, G, K]); got shape {tuple(rewards.shape)}")
    with torch.no_grad():
        return fn(rewards.float(), **REGISTRY.declared(name, kwargs))


def _group_std(r_PG: Tensor, std: StdMode) -> Tensor:
    """Per-group std ``[P, 1]``; unbiased is ddof=1 (``torch.std`` default), population ddof=0."""
    if std == "none":
        return torch.ones_like(r_PG[:, :1])
    g = r_PG.shape[1]
    if std == "unbiased":
        if g < 2:
            return torch.ones_like(r_PG[:, :1])
        return r_PG.std(dim=1, keepdim=True, unbiased=True)
    if std == "population":
        return r_PG.std(dim=1, keepdim=True, unbiased=False)
    raise ValueError(f"std must be 'unbiased', 'population' or 'none'; got {std!r}")


def _correct(r_PG: Tensor) -> Tensor:
    """1.0 where a response is correct (reward > ``CORRECT_THRESHOLD``), else 0.0; ``[P, G]``."""
    return (r_PG > CORRECT_THRESHOLD).to(r_PG.dtype)


def _whiten(x: Tensor, weight: Tensor) -> Tensor:
    """Batch whitening (x - mean) / sqrt(var + 1e-8) with weights (verl ``masked_whiten``).

    ``weight`` is a 0/1 token mask or a per-sequence token count; the mean and the *unbiased*
    variance (divide by sum(weight) - 1, as verl's Bessel correction) are taken over the whole
    batch. The result is not re-masked: callers multiply by their mask.
    """
    w = weight.to(x.dtype)
    n = w.sum()
    mean = (x * w).sum() / n.clamp(min=1.0)
    var = ((x - mean) ** 2 * w).sum() / (n - 1.0).clamp(min=1.0)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def _token_rewards(rewards_PG: Tensor, mask_PGT: Tensor, token_rewards_PGT: Tensor | None) -> Tensor:
    """Dense rewards ``[P, G, T]``: the outcome on the last response token, plus ``token_rewards``."""
    m = mask_PGT.to(rewards_PG.dtype)
    pos_T = torch.arange(1, m.shape[-1] + 1, device=m.device, dtype=m.dtype)
    last_PG1 = (m * pos_T).argmax(dim=-1, keepdim=True)  # index of the last 1 in each row
    has_PG1 = (m.sum(dim=-1, keepdim=True) > 0).to(m.dtype)  # an empty row gets no outcome
    out = torch.zeros_like(m).scatter(-1, last_PG1, rewards_PG.unsqueeze(-1) * has_PG1)
    if token_rewards_PGT is not None:
        out = out + token_rewards_PGT.to(m.dtype) * m
    return out


def _to_tokens(adv_PG: Tensor, mask_PGT: Tensor) -> Tensor:
    """Broadcast a sequence advantage ``[P, G]`` to the response tokens ``[P, G, T]``."""
    return adv_PG.unsqueeze(-1) * mask_PGT.to(adv_PG.dtype)


# --------------------------------------------------------------------------------------------
# Group baselines (P0)
# --------------------------------------------------------------------------------------------


@register("grpo")
def grpo(rewards: Tensor, *, std: StdMode = "unbiased", eps: float = 1e-6) -> Tensor:
    """GRPO group-relative advantage: A_i = (r_i - mean_g r) / (std_g r + eps).

    Shapes: rewards ``[P, G]`` -> advantages ``[P, G]`` (broadcast to tokens by the loss).
    Paper: DeepSeekMath, Shao et al. 2024, arXiv:2402.03300 (catalog B1).
    Std convention: ``std="unbiased"`` (ddof=1, verl's default) by default; ``"population"``
    (ddof=0) or ``"none"`` (mean-centering only, which is Dr.GRPO) on request.
    A group of one has no baseline: its advantage is 0.
    Nearest neighbour: ``dr_grpo`` drops the std division; ``rloo`` uses a leave-one-out mean.
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    centered = rewards - rewards.mean(dim=1, keepdim=True)
    return centered / (_group_std(rewards, std) + eps)


@register("dr_grpo")
def dr_grpo(rewards: Tensor) -> Tensor:
    """Dr.GRPO advantage: A_i = r_i - mean_g r (no std division).

    Shapes: rewards ``[P, G]`` -> ``[P, G]``. Paper: "Understanding R1-Zero-Like Training: A
    Critical Perspective", Liu et al. 2025, arXiv:2503.20783 (catalog B2). No std is used.
    Nearest neighbour: ``grpo`` divides by the group std, which up-weights near-uniform groups.
    Pair with ``seq_mean_token_sum_norm`` aggregation to remove the length bias as the paper does.
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    return rewards - rewards.mean(dim=1, keepdim=True)


@register("rloo")
def rloo(rewards: Tensor) -> Tensor:
    """RLOO leave-one-out advantage: A_i = r_i - mean_{j != i} r_j = G/(G-1) (r_i - mean_g r).

    Shapes: rewards ``[P, G]`` -> ``[P, G]``. Paper: "Back to Basics: Revisiting REINFORCE Style
    Optimization for Learning from Human Feedback", Ahmadian et al. 2024, arXiv:2402.14740
    (catalog B3). No std is used. Nearest neighbour: ``dr_grpo`` (same direction, scaled by
    G/(G-1) because the baseline excludes the sample itself). A group of one gets 0.
    """
    g = rewards.shape[1]
    if g < 2:
        return torch.zeros_like(rewards)
    return (rewards - rewards.mean(dim=1, keepdim=True)) * g / (g - 1)


@register("opo")
def opo(rewards: Tensor, *, lengths: Tensor) -> Tensor:
    """OPO length-weighted baseline: A_i = r_i - b, b = sum_j l_j r_j / sum_j l_j.

    The baseline weights each response by its length ``l_j`` (response tokens), which is the
    variance-optimal baseline when the gradient norm grows with length.
    Shapes: rewards ``[P, G]``, lengths ``[P, G]`` -> ``[P, G]``. Paper: "On-Policy RL with
    Optimal Reward Baseline", Hao et al. 2025, arXiv:2505.23585 (baseline, not a seed; pinned
    from verl ``compute_opo_outcome_advantage``). No std is used. A group whose lengths sum to 0
    falls back to the plain mean; a group of one gets 0 (verl uses b = 0 there).
    Nearest neighbour: ``dr_grpo`` (the same with equal weights).
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    l_PG = lengths.to(rewards.dtype)
    total_P1 = l_PG.sum(dim=1, keepdim=True)
    weighted_P1 = (l_PG * rewards).sum(dim=1, keepdim=True) / total_P1.clamp(min=1e-8)
    baseline_P1 = torch.where(total_P1 > 0, weighted_P1, rewards.mean(dim=1, keepdim=True))
    return rewards - baseline_P1


@register("grpo_passk")
def grpo_passk(rewards: Tensor, *, std: StdMode = "none", eps: float = 1e-6) -> Tensor:
    """Pass@k leave-one-out advantage: only the best sample gets r_max - r_second, others 0.

    For k = G, the leave-one-out gain of the max is (max of all) - (max of the others), which is
    nonzero only for the best sample. Shapes: rewards ``[P, G]`` -> ``[P, G]``.
    Paper: "Optimizing Language Models for Inference Time Objectives using Reinforcement
    Learning", Tang et al. 2025, arXiv:2503.19595 (baseline, not a seed; verl
    ``compute_grpo_passk_outcome_advantage``). Std convention: ``std="none"`` by default, the
    formula above; verl divides by the unbiased group std when ``norm_adv_by_std_in_grpo`` (its
    default): pass ``std="unbiased"`` to match. Ties for the best give 0. A group of one gets 0
    (verl raises). Nearest neighbour: ``passk`` (Pass@k Training) gives every sample an analytic
    advantage; this one rewards only the single best sample. Do not conflate them (catalog 3.18).
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    top2_P2 = rewards.topk(2, dim=1).values
    gap_P1 = top2_P2[:, :1] - top2_P2[:, 1:]
    if std != "none":
        gap_P1 = gap_P1 / (_group_std(rewards, std) + eps)
    best_P1 = rewards.argmax(dim=1, keepdim=True)
    return torch.zeros_like(rewards).scatter(1, best_P1, gap_P1)


@register("remax")
def remax(rewards: Tensor, *, baseline_rewards: Tensor) -> Tensor:
    """ReMax advantage: A_i = r_i - b, where b is the reward of the greedy response to the prompt.

    Shapes: rewards ``[P, G]``, baseline_rewards ``[P]`` (or ``[P, G]``) -> ``[P, G]``.
    Paper: "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
    Large Language Models", Li et al. 2023, arXiv:2310.10505 (baseline, not a seed; verl
    ``compute_remax_outcome_advantage``). No std is used. The baseline comes from outside the
    group (one extra greedy decode per prompt), so a group of one still gets r - b.
    Nearest neighbour: ``dr_grpo`` uses the group mean as the baseline instead.
    """
    b = baseline_rewards.to(rewards.dtype)
    if b.dim() == 1:
        b = b.unsqueeze(1)
    return rewards - b


# --------------------------------------------------------------------------------------------
# Token-level estimators (REINFORCE++, GAE)
# --------------------------------------------------------------------------------------------


def discounted_returns(token_rewards_PGT: Tensor, mask_PGT: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Reward-to-go G_t = r_t + gamma * G_{t+1} per response, reset at masked positions.

    Shapes: ``[P, G, T]`` -> ``[P, G, T]`` (not masked). The chain restarts after every position
    with mask 0, as verl's REINFORCE++ does (its "reset after EOS"); in multi-turn data this also
    cuts the return at observation tokens.
    """
    m = mask_PGT.to(token_rewards_PGT.dtype)
    returns = torch.zeros_like(token_rewards_PGT)
    running = torch.zeros_like(token_rewards_PGT[..., 0])
    for t in reversed(range(token_rewards_PGT.shape[-1])):
        # G_t = r_t + gamma * G_{t+1}
        running = token_rewards_PGT[..., t] + gamma * running
        returns[..., t] = running
        # a masked position (padding after EOS) cuts the chain for the tokens before it
        running = running * m[..., t]
    return returns


@register("reinforce_pp")
def reinforce_pp(
    rewards: Tensor,
    *,
    mask: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
) -> Tensor:
    """REINFORCE++: discounted token returns, whitened over every response token of the batch.

    r_t = outcome on the last response token + token_rewards_t; G_t = sum_{t' >= t} gamma^{t'-t}
    r_{t'} (see ``discounted_returns``); A_t = (G_t - mean) / sqrt(var + 1e-8), with the mean and
    the variance over all masked tokens of the batch. Shapes: rewards ``[P, G]``, mask and
    token_rewards ``[P, G, T]`` -> ``[P, G, T]`` (masked).
    Paper: "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models", Hu
    2025, arXiv:2501.03262 (catalog B4; verl ``compute_reinforce_plus_plus_outcome_advantage``).
    Std convention: **unbiased** batch variance (verl ``masked_whiten``), eps 1e-8 inside the root.
    The KL penalty of the paper goes in ``token_rewards`` (-beta * k1 per token).
    Nearest neighbour: ``reinforce_pp_baseline`` first subtracts the group mean of the score.
    """
    tok_PGT = _token_rewards(rewards, mask, token_rewards)
    returns_PGT = discounted_returns(tok_PGT, mask, gamma=gamma)
    m = mask.to(rewards.dtype)
    return _whiten(returns_PGT, m) * m


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: Tensor, *, mask: Tensor) -> Tensor:
    """REINFORCE++ with a group baseline: A = whiten(r_i - mean_g r) broadcast to tokens.

    Subtract the group mean of the sequence score, broadcast to every response token, then whiten
    over all masked tokens of the batch. Shapes: rewards ``[P, G]``, mask ``[P, G, T]`` ->
    ``[P, G, T]`` (masked). Paper: REINFORCE++, Hu 2025, arXiv:2501.03262 (catalog B4; verl
    ``compute_reinforce_plus_plus_baseline_outcome_advantage``). Std convention: no group std;
    **unbiased** batch variance in the whitening. A group of one centres to 0 (verl: mean 0).
    Nearest neighbour: ``grpo`` normalises per group; this normalises once over the batch, so
    low-variance groups are not up-weighted.
    """
    centered_PG = dr_grpo(rewards)
    m = mask.to(rewards.dtype)
    return _whiten(_to_tokens(centered_PG, m), m) * m


def gae_advantages_and_returns(
    token_rewards_PGT: Tensor,
    values_PGT: Tensor,
    mask_PGT: Tensor,
    *,
    gamma: float = 1.0,
    lam: float = 1.0,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation, un-whitened; returns (advantages, value targets).

    Shapes: all ``[P, G, T]``; both outputs ``[P, G, T]`` (not masked). The returns
    (advantages + values) are the critic's regression targets. Positions with mask 0 are
    skipped: they pass the next response token's value and advantage through unchanged (verl's
    handling of observation tokens).
    """
    m = mask_PGT.to(token_rewards_PGT.dtype)
    v = values_PGT.to(token_rewards_PGT.dtype)
    adv = torch.zeros_like(token_rewards_PGT)
    next_value = torch.zeros_like(token_rewards_PGT[..., 0])  # V(s_{t+1}); 0 after the last token
    next_adv = torch.zeros_like(next_value)  # A_{t+1}
    for t in reversed(range(token_rewards_PGT.shape[-1])):
        # TD error:   delta_t = r_t + gamma * V(s_{t+1}) - V(s_t)
        delta = token_rewards_PGT[..., t] + gamma * next_value - v[..., t]
        # recursion:  A_t = delta_t + gamma * lam * A_{t+1}
        adv_t = delta + gamma * lam * next_adv
        # a masked position keeps the carried V(s_{t+1}) and A_{t+1} for the token before it
        next_value = m[..., t] * v[..., t] + (1.0 - m[..., t]) * next_value
        next_adv = m[..., t] * adv_t + (1.0 - m[..., t]) * next_adv
        adv[..., t] = next_adv
    # value target:   R_t = A_t + V(s_t)
    return adv, adv + v


@register("gae")
def gae(
    rewards: Tensor,
    *,
    values: Tensor,
    mask: Tensor,
    token_rewards: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> Tensor:
    """PPO's GAE: A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t.

    r_t = outcome on the last response token + token_rewards_t (put the -beta * k1 KL penalty
    there). The recursion is written out in ``gae_advantages_and_returns``, which also gives the
    critic's targets. Shapes: rewards ``[P, G]``; values, mask, token_rewards ``[P, G, T]`` ->
    ``[P, G, T]`` (masked). Paper: "High-Dimensional Continuous Control Using Generalized
    Advantage Estimation", Schulman et al. 2015, arXiv:1506.02438 (catalog B10; verl
    ``compute_gae_advantage_return``). Defaults gamma = lam = 1.0 are verl's; the catalog's worked
    example uses lam = 0.95. Std convention: with ``whiten=True`` (verl) the advantages are
    whitened over all masked tokens with the **unbiased** variance. Nearest neighbour:
    ``reinforce_pp`` is the critic-free case (V = 0, lam = 1).
    """
    tok_PGT = _token_rewards(rewards, mask, token_rewards)
    adv_PGT, _ = gae_advantages_and_returns(tok_PGT, values, mask, gamma=gamma, lam=lam)
    m = mask.to(rewards.dtype)
    if whiten:
        adv_PGT = _whiten(adv_PGT, m)
    return adv_PGT * m


# --------------------------------------------------------------------------------------------
# Seed methods: group baselines and rescalings
# --------------------------------------------------------------------------------------------


@register("qae")
def qae(rewards: Tensor, *, quantile: float = 0.4, std: StdMode = "unbiased", eps: float = 1e-6) -> Tensor:
    """QAE: A_i = (r_i - Q_K(r)) / (std_g r + eps), the group mean replaced by the K-quantile.

    Q_K is ``torch.quantile`` with linear interpolation, so small groups interpolate between
    rewards ([1,0,0,1], K=0.4 gives Q=0.2) and the clean two-regime gate of the paper only holds
    when the quantile lands inside a block of equal rewards. Shapes: ``[P, G]`` -> ``[P, G]``.
    Paper: "Quantile Advantage Estimation for Entropy-Safe Reasoning", Wu et al. 2025,
    arXiv:2509.22611, seed ``papers/004_f298e9ec572f7f27.txt:67`` (catalog 3.24; formula from a
    third-party copy of the authors' README line, provisional). Std convention: **unbiased**
    (GRPO/DAPO's). The authors' code falls back to the mean outside 0 < K < 1; here K must lie in
    [0, 1] (0 = min, 1 = max). A group of one gets 0. Nearest neighbour: ``grpo`` (K = median-ish
    mean baseline); QAE's baseline makes ~80% of advantages zero on binary rewards.
    """
    if not 0.0 <= quantile <= 1.0:
        raise ValueError(f"quantile must be in [0, 1]; got {quantile}")
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    q_P1 = torch.quantile(rewards, quantile, dim=1, keepdim=True)
    return (rewards - q_P1) / (_group_std(rewards, std) + eps)


@register("ngrpo")
def ngrpo(
    rewards: Tensor,
    *,
    num_virtual: int = 1,
    virtual_reward: float = 1.0,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """NGRPO advantage calibration: GRPO statistics over the group plus virtual max-reward samples.

    A_i = (r_i - mean(r U {r_max}^K)) / (std(r U {r_max}^K) + eps), K = ``num_virtual``, r_max =
    ``virtual_reward``; the virtual samples enter the statistics only. An all-wrong group then
    gets negative advantages instead of 0. Shapes: ``[P, G]`` -> ``[P, G]``. Paper: "NGRPO:
    Negative-enhanced Group Relative Policy Optimization", Nan et al. 2025, arXiv:2509.18851, seed
    ``papers/004_f298e9ec572f7f27.txt:57`` (catalog 3.22; authors' ``add_max_reward_num=1``).
    Std convention: **unbiased** over the augmented group. The paper pairs it with asymmetric
    clipping (eps_low 0.16, eps_high 0.24: a loss setting) and drops all-correct groups (a
    selection setting). A group of one still gets a signal (the virtual sample is its baseline).
    Nearest neighbour: ``grpo`` (K = 0).
    """
    if num_virtual < 0:
        raise ValueError(f"num_virtual must be >= 0; got {num_virtual}")
    virtual_PK = rewards.new_full((rewards.shape[0], num_virtual), virtual_reward)
    aug_PGK = torch.cat([rewards, virtual_PK], dim=1)
    if aug_PGK.shape[1] < 2:
        return torch.zeros_like(rewards)
    mean_P1 = aug_PGK.mean(dim=1, keepdim=True)
    return (rewards - mean_P1) / (_group_std(aug_PGK, std) + eps)


@register("mapo")
def mapo(rewards: Tensor, *, eps: float = 1e-6) -> Tensor:
    """MAPO: mix the GRPO advantage and the "advantage percent deviation" by trajectory certainty.

    p = fraction correct, lambda = 1 - 4 p (1 - p) (0 for a 50/50 group, 1 for a uniform one);
    A_i = (1 - lambda) (r_i - mu) / (sigma_u + eps) + lambda (r_i - mu) / (mu + eps).
    Shapes: ``[P, G]`` -> ``[P, G]``. Paper: "MAPO: Mixed Advantage Policy Optimization", Huang et
    al. 2025, arXiv:2509.18849, seed ``papers/004_f298e9ec572f7f27.txt:25`` (catalog 3.13, from
    the authors' code). Std convention: **unbiased**. The percent deviation divides by the group
    mean, so it assumes {0, 1} rewards (mu = pass rate >= 0); the authors count ``r == 1`` where
    this counts reward > 0.5 (the same on binary rewards). Computed per group, so it does not
    share the authors' code's assumption of contiguous, ordered groups. A group of one gets 0.
    Nearest neighbour: ``grpo`` (lambda = 0).
    """
    if rewards.shape[1] < 2:
        return torch.zeros_like(rewards)
    p_P1 = _correct(rewards).mean(dim=1, keepdim=True)
    lam_P1 = 1.0 - 4.0 * p_P1 * (1.0 - p_P1)
    mean_P1 = rewards.mean(dim=1, keepdim=True)
    percent_PG = (rewards - mean_P1) / (mean_P1 + eps)
    return (1.0 - lam_P1) * grpo(rewards, std="unbiased", eps=eps) + lam_P1 * percent_PG


@register("f_grpo")
def f_grpo(rewards: Tensor, *, gamma: float = 1.0, std: StdMode = "unbiased", eps: float = 1e-6) -> Tensor:
    """F-GRPO focal scaling: A'_i = (1 - p)^gamma * A_i, p = fraction correct in the group.

    Down-weights easy (high-success) prompts so that rare correct modes are not forgotten.
    Shapes: ``[P, G]`` -> ``[P, G]``. Paper: "F-GRPO: Don't Let Your Policy Learn the Obvious and
    Forget the Rare", Plyusov et al. 2026, arXiv:2602.06717, seed
    ``papers/004_f298e9ec572f7f27.txt:165`` (catalog L165, from summaries). The paper's default
    gamma was not recovered (the catalog leaves it open): gamma = 1.0 here is a placeholder to
    tune. Base advantage: GRPO with ``std`` (**unbiased** by default); the paper also applies the
    factor to DAPO and CISPO. A group of one gets 0. Nearest neighbour: ``grpo`` (gamma = 0).
    """
    focal_P1 = (1.0 - _correct(rewards).mean(dim=1, keepdim=True)) ** gamma
    return focal_P1 * grpo(rewards, std=std, eps=eps)


def _comb_ratio(a: Tensor, b: int, n: int, k: int) -> Tensor:
    """C(a, b) / C(n, k) elementwise over ``a`` in float64; 0 where a < b."""
    a64 = a.double()
    valid = a64 >= b
    a_safe = torch.where(valid, a64, torch.full_like(a64, float(b)))
    log_num = torch.lgamma(a_safe + 1) - math.lgamma(b + 1) - torch.lgamma(a_safe - b + 1)
    log_den = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    return torch.where(valid, torch.exp(log_num - log_den), torch.zeros_like(a64))


@register("passk")
def passk(rewards: Tensor, *, k: int = 4, eps: float = 1e-6) -> Tensor:
    """Pass@k Training analytic advantage (rewards are pass/fail).

    n = G, c = #correct; rho = 1 - C(n-c, k) / C(n, k) (the group's pass@k), sigma =
    sqrt(rho (1 - rho)); correct: A_pos = (1 - rho) / (sigma + eps); wrong: A_neg = (1 - rho -
    C(n-c-1, k-1) / C(n-1, k-1)) / (sigma + eps). Shapes: ``[P, G]`` -> ``[P, G]``.
    Paper: "Pass@k Training for Adaptively Balancing Exploration and Exploitation of Large
    Reasoning Models", Chen et al. 2025, arXiv:2508.10751, seed
    ``papers/004_f298e9ec572f7f27.txt:35`` (catalog 3.18, from the authors' ``calc_adv``).
    Std convention: sigma is the Bernoulli std of the group pass@k; k = 1 gives GRPO with the
    **population** std. The default k = 4 is not pinned in the catalog. A uniform group
    (rho in {0, 1}) gets 0. Nearest neighbour: ``grpo_passk`` (verl) credits only the best
    sample; this credits every sample analytically.
    """
    n = rewards.shape[1]
    if not 1 <= k <= n:
        raise ValueError(f"k must be in [1, G={n}]; got {k}")
    c_PG = _correct(rewards)
    c_P1 = c_PG.sum(dim=1, keepdim=True)
    rho = 1.0 - _comb_ratio(n - c_P1, k, n, k)
    sigma = torch.sqrt((rho * (1.0 - rho)).clamp(min=0.0))
    a_pos = (1.0 - rho) / (sigma + eps)
    a_neg = (1.0 - rho - _comb_ratio(n - c_P1 - 1, k - 1, n - 1, k - 1)) / (sigma + eps)
    adv = torch.where(c_PG > 0, a_pos, a_neg)
    adv = torch.where(sigma > 1e-12, adv, torch.zeros_like(adv))
    return adv.to(rewards.dtype)


@register("lens")
def lens(
    rewards: Tensor,
    *,
    logprobs: Tensor,
    mask: Tensor,
    alpha: float = 0.25,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """LENS: confidence-weighted penalty on wrong answers, so all-wrong groups still teach.

    pbar_i = exp(mean_t logprobs) (old-policy geometric-mean token probability). Mixed groups:
    D = max(D_imp, 2 max_j pbar_j), D_imp = ((1/G) sum_i c_i / pbar_i)^-1; all-wrong groups:
    D = 2 max_j pbar_j. Shaped reward r~_i = r_i - (1 - c_i) (1/G) pbar_i / (D - pbar_i), c = correct.
    Groups with a correct answer: GRPO on r~; all-wrong groups: alpha (r~_i - mean r~) (J = J_mixed
    + alpha J_negative, written as a weight on the advantages). Shapes: rewards ``[P, G]``;
    logprobs, mask ``[P, G, T]`` -> ``[P, G]``. Paper: LENS, arXiv:2510.08696, seed
    ``papers/004_f298e9ec572f7f27.txt:75`` (catalog 3.25, read from the paper; no code).
    Std convention: **unbiased** (GRPO) for groups with a correct answer; none for negative
    groups. Confident wrong answers are penalised most. Nearest neighbour: ``ngrpo`` also rescues
    all-wrong groups, with a virtual correct sample instead of a confidence-weighted penalty.
    """
    g = rewards.shape[1]
    m = mask.to(rewards.dtype)
    n_tok = m.sum(dim=-1).clamp(min=1.0)
    pbar_PG = torch.exp((logprobs.to(rewards.dtype) * m).sum(dim=-1) / n_tok)
    c_PG = _correct(rewards)
    has_correct_P1 = c_PG.sum(dim=1, keepdim=True) > 0
    floor_P1 = 2.0 * pbar_PG.max(dim=1, keepdim=True).values
    inv_P1 = (c_PG / pbar_PG).mean(dim=1, keepdim=True)
    d_imp_P1 = 1.0 / inv_P1.clamp(min=1e-12)
    d_P1 = torch.where(has_correct_P1, torch.maximum(d_imp_P1, floor_P1), floor_P1)
    shaped_PG = rewards - (1.0 - c_PG) * pbar_PG / (g * (d_P1 - pbar_PG))
    negative_PG = alpha * (shaped_PG - shaped_PG.mean(dim=1, keepdim=True))
    return torch.where(has_correct_P1, grpo(shaped_PG, std=std, eps=eps), negative_PG)


@register("ddca")
def ddca(
    rewards: Tensor,
    *,
    lengths: Tensor,
    beta: float = 0.2,
    dynamic: bool = True,
    eps: float = 1e-8,
) -> Tensor:
    """DDCA: accuracy advantage plus a length advantage computed among correct responses only.

    c = correct; A_acc = (c - mean c) / (sigma_p(c) + eps) over the group. Over the correct set
    S only: z_i = (l_i - mean_S l) / (sigma_p,S(l) + eps), s_i = sigmoid(z_i), A_len,i = -(s_i -
    mean_S s) (0 for wrong responses). DDCA (``dynamic=True``) scales A_len by the pass rate
    n_correct / G (easy prompts get a stronger length penalty); DCA does not. A = A_acc + beta A_len.
    Shapes: rewards, lengths ``[P, G]`` -> ``[P, G]``. Paper: "Think Dense, Not Long: Dynamic
    Decoupled Conditional Advantage for Efficient Reasoning", Peng et al. 2026, arXiv:2602.02099,
    seed ``papers/004_f298e9ec572f7f27.txt:95`` (catalog 3.30, authors' ``advantage_dca_grpo``).
    Std convention: **population** (ddof=0) for both terms, eps 1e-8, as the authors' code. The
    authors' RLOO variant is not included. A group of one gets 0. Nearest neighbour: ``grpo``
    plus a length penalty, but the length baseline excludes wrong responses (no dilution).
    """
    g = rewards.shape[1]
    if g < 2:
        return torch.zeros_like(rewards)
    c_PG = _correct(rewards)
    a_acc = (c_PG - c_PG.mean(dim=1, keepdim=True)) / (c_PG.std(dim=1, keepdim=True, unbiased=False) + eps)
    n_P1 = c_PG.sum(dim=1, keepdim=True)
    l_PG = lengths.to(rewards.dtype)
    mean_l = (l_PG * c_PG).sum(dim=1, keepdim=True) / n_P1.clamp(min=1.0)
    var_l = ((l_PG - mean_l) ** 2 * c_PG).sum(dim=1, keepdim=True) / n_P1.clamp(min=1.0)
    s_PG = torch.sigmoid((l_PG - mean_l) / (var_l.sqrt() + eps))
    mean_s = (s_PG * c_PG).sum(dim=1, keepdim=True) / n_P1.clamp(min=1.0)
    a_len = -(s_PG - mean_s) * c_PG
    if dynamic:
        a_len = a_len * n_P1 / g
    return a_acc + beta * a_len


@register("canon")
def canon(
    rewards: Tensor,
    *,
    metric: Tensor,
    inter_weight: float = 1.0,
    alpha: float = 1.0,
    beta: float = 0.0,
    length_norm: float = 1.0,
) -> Tensor:
    """CANON: regroup each group into low/high halves by a metric and compare across and within.

    Sort the group by ``metric`` (mean token entropy, or length; ascending, ties by index): the
    low half C- is the first floor(G/2), the high half C+ the rest; m-, m+ their mean rewards.
    mu = ``inter_weight`` (the authors' ``_lambda``):
    C+: A = [mu (r - alpha m- + beta) + (1 - mu)(r - m+)] / L;
    C-: A = [mu (alpha r - m+ - beta) + (1 - mu)(r - m-)] / L, with L = ``length_norm``.
    mu = 1 is pure inter-group comparison (which metric trend pays), mu = 0 pure intra-group,
    mu = 0.5 recovers Dr.GRPO. Shapes: rewards, metric ``[P, G]`` -> ``[P, G]``. Paper:
    "Conditional Advantage Estimation for Reinforcement Learning in Large Reasoning Models", Chen
    et al. 2025, arXiv:2509.23962, seed ``papers/004_f298e9ec572f7f27.txt:39`` (catalog 3.19,
    authors' code). No std is used. The authors divide by the max response length (Dr.GRPO
    style); here that constant is ``length_norm`` = 1 because the aggregation axis
    (``seq_mean_token_sum_norm``) owns it. Their scheduled mu variants are left to the caller.
    A group of one gets 0. Nearest neighbour: ``dr_grpo`` (mu = 0.5).
    """
    g = rewards.shape[1]
    if g < 2:
        return torch.zeros_like(rewards)
    n_low = g // 2
    order_PG = torch.sort(metric.to(rewards.dtype), dim=1, stable=True).indices
    low_PG = torch.zeros_like(rewards, dtype=torch.bool).scatter(1, order_PG[:, :n_low], True)
    lowf = low_PG.to(rewards.dtype)
    m_low = (rewards * lowf).sum(dim=1, keepdim=True) / n_low
    m_high = (rewards * (1.0 - lowf)).sum(dim=1, keepdim=True) / (g - n_low)
    mu = inter_weight
    a_high = mu * (rewards - alpha * m_low + beta) + (1.0 - mu) * (rewards - m_high)
    a_low = mu * (alpha * rewards - m_high - beta) + (1.0 - mu) * (rewards - m_low)
    return torch.where(low_PG, a_low, a_high) / length_norm


def low_prob_confidence(logprobs_PGT: Tensor, mask_PGT: Tensor, *, fraction: float = 0.2) -> Tensor:
    """Confidence on the least likely tokens: exp(mean of the lowest ``fraction`` of log-probs).

    Takes the ceil(fraction * n) lowest masked log-probs of each sequence (at least one) and
    returns their geometric-mean probability ``[P, G]`` (an empty row gives 1). This is this
    library's reading of ProGRPO's "T_low" confidence (provisional). Apply it to the prompt's
    tokens to get ``prompt_confidence`` for ``progrpo``.
    """
    m_bool = mask_PGT > 0
    lp = logprobs_PGT.float().masked_fill(~m_bool, float("inf"))
    sorted_PGT = lp.sort(dim=-1).values
    n_PG1 = m_bool.sum(dim=-1, keepdim=True)
    k_PG1 = torch.ceil(fraction * n_PG1.float()).clamp(min=1.0)
    rank_T = torch.arange(lp.shape[-1], device=lp.device)
    sel = (rank_T < k_PG1) & (rank_T < n_PG1)
    total = torch.where(sel, sorted_PGT, torch.zeros_like(sorted_PGT)).sum(dim=-1)
    return torch.exp(total / sel.sum(dim=-1).clamp(min=1))


@register("progrpo")
def progrpo(
    rewards: Tensor,
    *,
    prompt_confidence: Tensor,
    answer_confidence: Tensor | None = None,
    logprobs: Tensor | None = None,
    mask: Tensor | None = None,
    alpha: float = 1.0,
    low_fraction: float = 0.2,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """ProGRPO (ARM) reweighting: A~_i = A_i + alpha (c(q) - c(o_i|q)) unless the group is all wrong.

    A is GRPO; c(q) = ``prompt_confidence [P]``; c(o|q) = ``answer_confidence [P, G]``, or, when
    absent, ``low_prob_confidence(logprobs, mask, fraction=low_fraction)``. Over-confident answers
    are damped and unsure correct ones boosted, against entropy collapse. Groups with no correct
    answer keep A. Shapes: rewards ``[P, G]`` -> ``[P, G]``. Paper: ProGRPO, arXiv:2602.05281,
    seed ``papers/004_f298e9ec572f7f27.txt:115`` (catalog 3.36, from a third-party review).
    **Provisional**: the exact confidence definitions (perplexity on the lowest ~20% tokens) and
    alpha need the paper; the catalog's "sum of rewards = 0" test is read here as "no correct
    answer". Std convention: **unbiased** (GRPO). Nearest neighbour: ``entropy_adv`` also adds a
    bounded exploration term, per token and from entropy rather than confidence.
    """
    if answer_confidence is None:
        if logprobs is None or mask is None:
            raise ValueError("progrpo needs answer_confidence, or logprobs and mask to compute it")
        answer_confidence = low_prob_confidence(logprobs, mask, fraction=low_fraction)
    adv_PG = grpo(rewards, std=std, eps=eps)
    c_q_P1 = prompt_confidence.to(rewards.dtype).reshape(-1, 1)
    shaped_PG = adv_PG + alpha * (c_q_P1 - answer_confidence.to(rewards.dtype))
    any_correct_P1 = _correct(rewards).sum(dim=1, keepdim=True) > 0
    return torch.where(any_correct_P1, shaped_PG, adv_PG)


@register("entropy_adv")
def entropy_adv(
    rewards: Tensor,
    *,
    entropies: Tensor,
    mask: Tensor,
    alpha: float = 0.4,
    kappa: float = 2.0,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """Entropy-based advantage: A'_t = A + min(alpha H_t, |A| / kappa), per token.

    A is GRPO broadcast to tokens, H_t the (detached) token entropy. The clip keeps the bonus below
    |A| / kappa, so it can never flip the sign and vanishes where A = 0. Shapes: rewards
    ``[P, G]``; entropies, mask ``[P, G, T]`` -> ``[P, G, T]`` (masked). Paper: "Reasoning with
    Exploration: An Entropy Perspective", Cheng et al. 2025, arXiv:2506.14758, seed
    ``papers/004_f298e9ec572f7f27.txt:13`` (catalog 3.12; the same clip is in hf618/VERL). alpha =
    0.4 is the catalog's reading of the paper and is marked "check". Std convention: **unbiased**
    (GRPO). Nearest neighbour: an entropy *loss* bonus raises entropy everywhere; this raises the
    advantage of high-entropy tokens, bounded by the outcome signal.
    """
    adv_PG1 = grpo(rewards, std=std, eps=eps).unsqueeze(-1)
    bonus_PGT = torch.minimum(alpha * entropies.to(rewards.dtype), adv_PG1.abs() / kappa)
    return (adv_PG1 + bonus_PGT) * mask.to(rewards.dtype)


@register("a3po")
def a3po(
    rewards: Tensor,
    *,
    logprobs: Tensor,
    mask: Tensor,
    beta_pos: float = 0.5,
    beta_neg: float = 0.5,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """A3PO-style polarity shaping: amplify low-prob tokens of positives, high-prob of negatives.

    A'_{i,t} = A_i g_{i,t}, p_t = exp(logprobs_t): g = 1 + beta_pos (1 - p_t) when A_i > 0,
    g = 1 + beta_neg p_t when A_i < 0. Shapes: rewards ``[P, G]``; logprobs, mask ``[P, G, T]`` ->
    ``[P, G, T]`` (masked). Paper: "Rethinking Sample Polarity in Reinforcement Learning with
    Verifiable Rewards", Tang et al. 2025, arXiv:2512.21625, seed
    ``papers/004_f298e9ec572f7f27.txt:99`` (catalog 3.31). **Provisional**: the paper's formula,
    coefficients and its adaptive training-time schedule are not pinned (third-party summaries
    only); the multiplier form and beta_pos = beta_neg = 0.5 are this library's placeholder, and
    the schedule is left to the caller (lower the betas over training). Std convention:
    **unbiased** (GRPO) for A. Nearest neighbour: ``entropy_adv`` adds an entropy bonus to every
    token regardless of polarity.
    """
    adv_PG1 = grpo(rewards, std=std, eps=eps).unsqueeze(-1)
    p_PGT = torch.exp(logprobs.to(rewards.dtype)).clamp(0.0, 1.0)
    gain_PGT = torch.where(adv_PG1 > 0, 1.0 + beta_pos * (1.0 - p_PGT), 1.0 + beta_neg * p_PGT)
    return adv_PG1 * gain_PGT * mask.to(rewards.dtype)


# --------------------------------------------------------------------------------------------
# Stateful seed methods: state in, advantages out; ``<name>_update_state`` advances the state
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AGRAEState:
    """Training progress for ``a_grae``: a running batch accuracy m-bar in [0, 1]."""

    mean_accuracy: float


def a_grae_update_state(state: AGRAEState | None, rewards: Tensor, *, momentum: float = 0.9) -> AGRAEState:
    """Fold this batch's accuracy into the EMA: m <- momentum m + (1 - momentum) acc (acc if None)."""
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
    eps: float = 1e-6,
) -> Tensor:
    """A-GRAE: difficulty curriculum over the batch plus attenuation of correct trajectories.

    mu_g = group pass rate, A^ = GRPO (unbiased std); m = training progress (mean accuracy).
    A_diff = 0.5 A^ / (sqrt(mu_g) + eps); A_easy = 0.5 A^ / (1 - sqrt(mu_g) + eps);
    A = (1 - m) A_easy + m A_diff (early, low m: easy groups weigh more; later, hard groups);
    then A <- A min(1, m / alpha) where A > 0 (alpha = 1 math, 0.5 geo3k/med in the scripts).
    Progress m: with ``state=None`` it is the current batch's mean of mu_g, as the authors' code;
    with an ``AGRAEState`` it is ``state.mean_accuracy`` (advance it with
    ``a_grae_update_state``; a smoothed signal for small batches). Shapes: ``[P, G]`` ->
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
    m = float(mu_P1.mean()) if state is None else state.mean_accuracy
    adv_PG = grpo(rewards, std="unbiased", eps=eps)
    root_P1 = mu_P1.sqrt()
    a_diff = 0.5 * adv_PG / (root_P1 + eps)
    a_easy = 0.5 * adv_PG / (1.0 - root_P1 + eps)
    mixed = (1.0 - m) * a_easy + m * a_diff
    return torch.where(mixed > 0, mixed * min(1.0, m / alpha), mixed)


@dataclass(frozen=True)
class HADWState:
    """History for ``ha_dw``: the evolving difficulty anchor C (running solve rate), in [0, 1]."""

    anchor: float = 0.5


def ha_dw_update_state(
    state: HADWState | None, rewards: Tensor, *, eta: float = 0.1, stability: float = 1.0
) -> HADWState:
    """Kalman-style anchor update C+ = (1 - eta_t) C- + eta_t y_t, eta_t = eta * stability.

    y_t is the batch accuracy. ``stability`` is the paper's sigma_t, which the catalog does not
    pin (a training-stability term); 1.0 gives a plain EMA with rate eta. eta_t is clipped to
    [0, 1].
    """
    prior = state if state is not None else HADWState()
    y = float(_correct(rewards.float()).mean())
    rate = min(max(eta * stability, 0.0), 1.0)
    return HADWState(anchor=(1.0 - rate) * prior.anchor + rate * y)


@register("ha_dw")
def ha_dw(
    rewards: Tensor,
    *,
    state: HADWState | None = None,
    scale: float = 1.0,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """HA-DW: reweight GRPO advantages by how far a prompt's accuracy is from a history anchor.

    p^ = group accuracy, diff = p^ - C (C = ``state.anchor``, 0.5 when ``state`` is None),
    M = |diff|, D_i = -sgn(A^_i) sgn(diff), Phi_i = scale exp(D_i M), A'_i = Phi_i A^_i. Hard
    prompts (below the anchor) get their positive advantages boosted and negative ones damped;
    easy prompts the reverse, correcting the group-relative estimator's difficulty bias.
    Advance the anchor with ``ha_dw_update_state`` after each step. Shapes: ``[P, G]`` ->
    ``[P, G]``. Paper: "Your Group-Relative Advantage Is Biased", arXiv:2601.08521, seed
    ``papers/004_f298e9ec572f7f27.txt:29`` (catalog 3.15, from closed TRL PRs #4863/#4872:
    provisional; sigma_t not pinned). Std convention: **unbiased** (GRPO) for A^. A group of one
    gets 0. Nearest neighbour: ``a_grae`` also reweights by difficulty, against batch accuracy
    rather than a history anchor.
    """
    anchor = (state if state is not None else HADWState()).anchor
    adv_PG = grpo(rewards, std=std, eps=eps)
    diff_P1 = _correct(rewards).mean(dim=1, keepdim=True) - anchor
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
    summaries; no code). **The switch point is not pinned** (a step or an adaptive criterion):
    ``switch_step=100`` is a placeholder to set per run. The paper applies the mask to PPO, RLOO
    and REINFORCE++ advantages too. Std convention: **unbiased** (GRPO). A group of one gets 0.
    Nearest neighbour: ``grpo_n`` keeps the opposite sign (negatives only).
    """
    step = (state if state is not None else CAPOState()).step
    adv_PG = grpo(rewards, std=std, eps=eps)
    return adv_PG.clamp(min=0.0) if step < switch_step else adv_PG


# --------------------------------------------------------------------------------------------
# Negative-sample variants
# --------------------------------------------------------------------------------------------


@register("grpo_n")
def grpo_n(rewards: Tensor, *, std: StdMode = "unbiased", eps: float = 1e-6) -> Tensor:
    """GRPO-N: keep only the relative-negative samples, A^N_i = min(A_i, 0).

    Shapes: ``[P, G]`` -> ``[P, G]``. Paper: arXiv:2510.04028 ("GRPO-N / GSPO-N"), seed
    ``papers/004_f298e9ec572f7f27.txt:169`` (catalog L169). Std convention: **unbiased** (GRPO).
    Nearest neighbour: ``nsr`` gives every wrong answer -1 regardless of the group.
    """
    return grpo(rewards, std=std, eps=eps).clamp(max=0.0)


@register("nsr")
def nsr(rewards: Tensor) -> Tensor:
    """NSR (negative sample reinforcement): A = 0 for correct, -1 for wrong responses.

    Not group-relative, so a group of one is handled like any other. Shapes: ``[P, G]`` ->
    ``[P, G]``. Paper: "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning",
    Zhu et al. 2025, arXiv:2506.01347; the seed is ``papers/004_f298e9ec572f7f27.txt:169``
    (catalog L169; A-GRAE's ``compute_psr_nsr_outcome_advantage``). No std. Correct means reward
    > 0.5. Nearest neighbour: ``w_reinforce`` adds a small positive weight on correct answers.
    """
    return _correct(rewards) - 1.0


@register("w_reinforce")
def w_reinforce(rewards: Tensor, *, lam: float = 0.1) -> Tensor:
    """W-REINFORCE: A = lam for correct, -1 for wrong responses (lam = 0.1 up-weights negatives).

    Shapes: ``[P, G]`` -> ``[P, G]``. Paper: Zhu et al. 2025, arXiv:2506.01347; seed
    ``papers/004_f298e9ec572f7f27.txt:169`` (catalog L169). No std; not group-relative. Correct
    means reward > 0.5. Nearest neighbour: ``nsr`` (lam = 0).
    """
    c_PG = _correct(rewards)
    return lam * c_PG - (1.0 - c_PG)


# --------------------------------------------------------------------------------------------
# Multi-reward estimators: rewards [P, G, K]
# --------------------------------------------------------------------------------------------


def _per_reward_grpo(rewards: Tensor, std: StdMode, eps: float) -> Tensor:
    """GRPO-normalise every reward component separately: ``[P, G(, K)]`` -> ``[P, G, K]``."""
    r_PGK = rewards if rewards.dim() == 3 else rewards.unsqueeze(-1)
    return torch.stack([grpo(r_PGK[..., k], std=std, eps=eps) for k in range(r_PGK.shape[-1])], dim=-1)


def _sequence_weights(rewards: Tensor, mask: Tensor | None) -> Tensor:
    """Per-sequence whitening weight ``[P, G]``: its token count (verl whitens over tokens), or 1."""
    if mask is None:
        return torch.ones_like(rewards[:, :, 0] if rewards.dim() == 3 else rewards)
    return mask.to(rewards.dtype).sum(dim=-1)


@register("gdpo")
def gdpo(
    rewards: Tensor,
    *,
    mask: Tensor | None = None,
    whiten: bool = True,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """GDPO: normalise each reward component within the group, sum them, whiten over the batch.

    A^k = (r^k - mean_g r^k) / (std_g r^k + eps); A = sum_k A^k; then batch whitening
    (mean, unbiased var + 1e-8) with each sequence weighted by its token count from ``mask``
    (which equals verl's token-level ``masked_whiten`` of a broadcast advantage), or equally when
    no mask is given. Shapes: rewards ``[P, G, K]`` (``[P, G]`` is K = 1), mask ``[P, G, T]`` ->
    ``[P, G]``. Paper: GDPO as the baseline of "GD2PO: Mitigating Multi-Reward Conflicts via
    Group-Dynamic reward-Decoupled Policy Optimization", Liu et al. 2026, arXiv:2606.16771, seed
    ``papers/004_f298e9ec572f7f27.txt:117`` (catalog 3.37, authors' code). Std convention:
    **unbiased** per component; unbiased batch variance. Nearest neighbour: ``grpo`` on the summed
    reward, where a large-scale component would drown the others.
    """
    adv_PG = _per_reward_grpo(rewards, std, eps).sum(dim=-1)
    if not whiten:
        return adv_PG
    w_PG = _sequence_weights(rewards, mask)
    return _whiten(adv_PG, w_PG) * (w_PG > 0).to(adv_PG.dtype)


@register("gd2po")
def gd2po(
    rewards: Tensor,
    *,
    mask: Tensor | None = None,
    mode: Literal["hard", "snr"] = "hard",
    tau: float = 0.2,
    whiten: bool = True,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """GD2PO: GDPO with conflicting rollouts masked out and groups reweighted by consensus.

    A^k as in ``gdpo``. A rollout *conflicts* when its per-reward advantages have mixed signs
    (|A^k| > 1e-8); with ``mode="snr"`` only when also |sum_k A^k| / (sum_k |A^k| + 1e-6) < tau.
    keep = not conflict; kappa_g = #kept / G; A = (sum_k A^k) kappa_g keep, then whitened over kept
    rollouts only (token-count weights from ``mask``, as ``gdpo``); dropped rollouts get 0.
    Shapes: rewards ``[P, G, K]``, mask ``[P, G, T]`` -> ``[P, G]``. Paper: "GD2PO: Mitigating
    Multi-Reward Conflicts via Group-Dynamic reward-Decoupled Policy Optimization", Liu et al.
    2026, arXiv:2606.16771, seed ``papers/004_f298e9ec572f7f27.txt:117`` (catalog 3.37, authors'
    ``gdpo_filter_*`` branches). Std convention: **unbiased** per component and in the whitening.
    Nearest neighbour: ``gdpo`` (no filter, kappa = 1).
    """
    adv_PGK = _per_reward_grpo(rewards, std, eps)
    significant = adv_PGK.abs() > 1e-8
    conflict_PG = ((adv_PGK > 0) & significant).any(dim=-1) & ((adv_PGK < 0) & significant).any(dim=-1)
    if mode == "snr":
        snr_PG = adv_PGK.sum(dim=-1).abs() / (adv_PGK.abs().sum(dim=-1) + 1e-6)
        conflict_PG = conflict_PG & (snr_PG < tau)
    elif mode != "hard":
        raise ValueError(f"mode must be 'hard' or 'snr'; got {mode!r}")
    keep_PG = (~conflict_PG).to(adv_PGK.dtype)
    kappa_P1 = keep_PG.mean(dim=1, keepdim=True)
    adv_PG = adv_PGK.sum(dim=-1) * kappa_P1 * keep_PG
    if not whiten:
        return adv_PG
    w_PG = _sequence_weights(rewards, mask) * keep_PG
    return _whiten(adv_PG, w_PG) * (w_PG > 0).to(adv_PG.dtype)
