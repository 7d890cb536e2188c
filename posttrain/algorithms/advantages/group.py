"""Group baselines (P0): GRPO, Dr.GRPO, RLOO, OPO, pass@k leave-one-out, ReMax, RL-PLUS's on-policy GRPO; A*-PO and
AAPO's momentum, which read the frozen reference's rewards.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from posttrain.algorithms.advantages._common import StdMode, _group_std, register


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


@register("grpo_onpolicy_stats")
def grpo_onpolicy_stats(
    rewards: Tensor, *, external: Tensor, std: StdMode = "unbiased", eps: float = 1e-6
) -> Tensor:
    """GRPO whose group statistics come from the on-policy samples only, applied to every sample.

    mu_g = mean of r over the group's on-policy samples, sigma_g = their std (sigma_g = 0 -> 1);
    A_i = (r_i - mu_g) / (sigma_g + eps) for every sample i of the group, the external ones included
    (``external [P, G]`` bool marks them: a demonstration the ``external_mix`` driver put in the group).
    A group with a single on-policy sample uses mu = 0, sigma = 1 (A_i = r_i / (1 + eps)), as the
    authors' code does; a group with none raises ``ValueError``.
    Shapes: rewards ``[P, G]``, external ``[P, G]`` -> ``[P, G]``.
    Paper: RL-PLUS, "Countering Capability Boundary Collapse of LLMs in Reinforcement Learning with
    Hybrid-policy Optimization", arXiv:2508.00222 (seed ``papers/004_f298e9ec572f7f27.txt: 7``, catalog
    3.10); pinned from YihongDong/RL-PLUS @ eb4aa4d4e2 ``compute_grpo_outcome_advantage_split``.
    Std convention: unbiased (ddof=1, ``torch.std`` as the authors' code) by default; ``"population"`` or
    ``"none"`` (the code's ``grpo_use_std=False``: centring only) on request.
    Nearest neighbour: ``grpo`` takes mu and sigma over the whole group; here an external sample (usually
    correct) does not move the baseline, so an all-wrong on-policy group gives its external sample A ~ 1
    and its own samples 0.
    """
    on_PG = ~external.to(torch.bool)
    n_P1 = on_PG.sum(dim=1, keepdim=True)
    if bool((n_P1 == 0).any()):
        raise ValueError("grpo_onpolicy_stats: a group has no on-policy sample to take its statistics from")
    w_PG = on_PG.to(rewards.dtype)
    n = n_P1.to(rewards.dtype)
    mean_P1 = (rewards * w_PG).sum(dim=1, keepdim=True) / n
    sq_P1 = ((rewards - mean_P1) ** 2 * w_PG).sum(dim=1, keepdim=True)
    if std == "unbiased":
        sigma_P1 = torch.sqrt(sq_P1 / (n - 1).clamp(min=1.0))
    elif std == "population":
        sigma_P1 = torch.sqrt(sq_P1 / n)
    elif std == "none":
        sigma_P1 = torch.ones_like(mean_P1)
    else:
        raise ValueError(f"std must be 'unbiased', 'population' or 'none'; got {std!r}")
    single = n_P1 == 1  # the authors' code: one on-policy sample -> mu 0, sigma 1
    mean_P1 = torch.where(single, torch.zeros_like(mean_P1), mean_P1)
    sigma_P1 = torch.where(single | (sigma_P1 == 0), torch.ones_like(sigma_P1), sigma_P1)
    return (rewards - mean_P1) / (sigma_P1 + eps)


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


@register("a_star")
def a_star(rewards: Tensor, *, reference_rewards: Tensor, beta1: float = 0.5, samples: int = 8) -> Tensor:
    """A*-PO's optimal advantage: A_i = r_i - V*(x), V*(x) = beta1 log( (1/N) sum_j exp(r_j / beta1) ).

    ``reference_rewards [P, N]`` are the rewards of N responses to the prompt sampled from the frozen
    reference policy (``samples`` = N, read by the loop, which samples them once per prompt:
    ``produce/ref_samples.py``; the paper's offline stage). beta1 = 0 gives the plain mean. A group
    of one (the paper's single online generation) gets r - V*. Pair with the ``a_star_po`` loss,
    which regresses beta2 log(pi/pi_ref) onto A. Shapes: rewards ``[P, G]`` -> ``[P, G]``. Hand
    example (catalog 3.9): references [1, 0, 0, 1], beta1 = 0.5: V* = 0.5 log((2 e^2 + 2) / 4) =
    0.716890, so r = 1 -> 0.283110 and r = 0 -> -0.716890. Paper: "Accelerating RL for LLM Reasoning
    with Optimal Advantage Regression", arXiv:2505.20686, seed ``papers/004_f298e9ec572f7f27.txt:5``
    (authors' ``_process_values``: beta1 = 0.5, N = 8). No std. Nearest neighbour: ``remax``
    subtracts the reward of one greedy response of the current policy instead.
    """
    return rewards - optimal_value(reference_rewards.to(rewards.dtype), beta1=beta1).unsqueeze(-1)


@register("aapo_momentum")
def aapo_momentum(
    rewards: Tensor,
    *,
    reference_rewards: Tensor,
    samples: int = 4,
    low: float = 0.2,
    high: float = 0.28,
    eps: float = 1e-4,
) -> Tensor:
    """AAPO's momentum-augmented advantage: A_i = (r_i - mean_g r) / (std_g r + eps) + clamp(r_i - r_ref,i, -low, high).

    The frozen reference policy answers each prompt too, one response per policy sample slot: ``reference_rewards
    [P, G]`` (``samples`` = G, read by the loop, which samples them from the starting policy:
    ``produce/ref_samples.py``), and the i-th sample's margin over the i-th reference response is added, clipped to
    [-low, high], to GRPO's group advantage (unbiased std). Where the group's rewards are all equal GRPO gives 0,
    and the margin over the reference still says whether the policy has moved beyond where it started: the paper's
    fix for training that stalls as group advantages approach zero. Pair with the ``reinforce`` loss (the paper
    optimizes -sum_t log pi_t A_i / #tokens: no ratio, no clip) and ``token_mean``. Shapes: rewards ``[P, G]`` ->
    ``[P, G]``.

    Hand example (catalog 3.20): r = [1, 0, 0, 1], r_ref = [0, 0, 1, 1]: mean 0.5, std 0.577350, so the group term is
    +-0.5 / 0.577450 = +-0.865875, and the margins [1, 0, -1, 0] clip to [0.28, 0, -0.2, 0]: A = [1.145875, -0.865875,
    -1.065875, 0.865875]. Paper: "AAPO: Enhancing the Reasoning Capabilities of LLMs with Advantage Momentum",
    arXiv:2505.14264, seed ``papers/004_f298e9ec572f7f27.txt:45`` (authors' JianxXiong/AAPO ``AAPOTrainer``: clip
    [-0.2, 0.28], eps 1e-4). Deviation: posttrain draws a prompt's reference responses once, when the run first
    meets the prompt (the reference is frozen, so they are draws from the same distribution the authors sample
    every step). Nearest neighbour: ``a_star`` subtracts a soft maximum of the reference's rewards instead of
    adding a clipped per-slot margin to GRPO's.
    """
    P, G = rewards.shape
    if reference_rewards.shape != (P, G):
        raise ValueError(f"aapo_momentum pairs each of the G = {G} samples of a prompt with one reference response: "
                         f"got reference rewards of shape {tuple(reference_rewards.shape)}; set "
                         f"algorithm.advantage_params.samples = {G} (rollout.group_size)")
    group = grpo(rewards, std="unbiased", eps=eps)
    return group + (rewards - reference_rewards.to(rewards.dtype)).clamp(-low, high)


def optimal_value(reference_rewards: Tensor, *, beta1: float = 0.5) -> Tensor:
    """A*-PO's V*(x) = beta1 log( (1/N) sum_j exp(r_j / beta1) ), ``[..., N]`` -> ``[...]``; beta1 = 0: the
    plain mean (the soft maximum's limit as beta1 -> 0 is the max; the authors' code takes the mean at 0).

    The value ``a_star`` subtracts, and what ``posttrain astar-values`` writes per prompt (the paper's
    offline stage, arXiv:2505.20686; authors' ``_process_values``). Computed as a log-sum-exp, so large
    r / beta1 do not overflow. Hand example: [1, 0, 0, 1], beta1 = 0.5 -> 0.716890 (see ``a_star``).
    """
    if beta1 > 0:
        return beta1 * (torch.logsumexp(reference_rewards / beta1, dim=-1) - math.log(reference_rewards.shape[-1]))
    return reference_rewards.mean(dim=-1)


@register("remax")
def remax(rewards: Tensor, *, baseline_rewards: Tensor) -> Tensor:
    """ReMax advantage: A_i = r_i - b, where b is the reward of the greedy response to the prompt.

    Shapes: rewards ``[P, G]``, baseline_rewards ``[P]`` (or ``[P, G]``) -> ``[P, G]``.
    Paper: "ReMax: A Simple, Effective, and Efficient Reinforcement Learning Method for Aligning
    Large Language Models", Li et al. 2023, arXiv:2310.10505 (baseline, not a seed; verl
    ``compute_remax_outcome_advantage``). No std is used. The baseline comes from outside the
    group (one extra greedy decode per prompt), so a group of one still gets r - b. The paper's
    b = r(x, y_greedy) is the same reward function r as the sample's: with shapers on, the greedy
    response is shaped too, with its own length and inputs (``prepare/providers.py``), as verl's trainer
    scores it with the same ``reward_fn`` (where DAPO's overlong penalty lives); shapers that read
    the group or a history are rejected with it (``shaping.baseline_unshapable``).
    Nearest neighbour: ``dr_grpo`` uses the group mean as the baseline instead.
    """
    b = baseline_rewards.to(rewards.dtype)
    if b.dim() == 1:
        b = b.unsqueeze(1)
    return rewards - b
