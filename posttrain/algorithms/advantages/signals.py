"""Seed methods that weigh responses or tokens by a signal beyond the reward: confidence (LENS,
ProGRPO), length (DDCA), a sorting metric (CANON), token entropy (entropy_adv), token probability (A3PO).
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.advantages._common import StdMode, _correct, register
from posttrain.algorithms.advantages.group import grpo

LOW_FRACTION = 0.2
"""ProGRPO's "T_low": the share of least likely tokens a confidence is taken over. Our value, not the
paper's: the "~20%" of a third-party review (catalog 3.36); no authors' code was found."""


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
    A group of one gets 0. Nearest neighbour: ``dr_grpo`` (mu = 0.5). In the RL loop
    ``algorithm.advantage_metric`` chooses ``metric``: ``"entropy"`` (each response's mean token
    entropy under the policy that sampled it, one no-grad forward) or ``"length"``.
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


def low_prob_confidence(logprobs_PGT: Tensor, mask_PGT: Tensor, *, fraction: float = LOW_FRACTION) -> Tensor:
    """Confidence on the least likely tokens: exp(mean of the lowest ``fraction`` of log-probs).

    Takes the ceil(fraction * n) lowest masked log-probs of each sequence (at least one) and
    returns their geometric-mean probability ``[P, G]`` (an empty row gives 1), i.e. the inverse
    perplexity of those tokens. This is this library's reading of ProGRPO's "T_low" confidence
    (provisional). Applied to the prompt's tokens it gives ``prompt_confidence`` for ``progrpo``.
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
    low_fraction: float = LOW_FRACTION,
    std: StdMode = "unbiased",
    eps: float = 1e-6,
) -> Tensor:
    """ProGRPO (ARM) reweighting: A~_i = A_i + alpha (c(q) - c(o_i|q)) unless the group is all wrong.

    A is GRPO; c(q) = ``prompt_confidence [P]``; c(o|q) = ``answer_confidence [P, G]``, or, when
    absent, ``low_prob_confidence(logprobs, mask, fraction=low_fraction)``. Over-confident answers
    are damped and unsure correct ones boosted, against entropy collapse. Groups with no correct
    answer keep A. Shapes: rewards ``[P, G]`` -> ``[P, G]``. Paper: "Back to Basics: Revisiting
    Exploration in Reinforcement Learning for LLM Reasoning via Generative Probabilities", Li et
    al. 2026, arXiv:2602.05281, seed ``papers/004_f298e9ec572f7f27.txt:115`` (catalog 3.36, from
    a third-party review). In the RL loop c(q) is ``low_prob_confidence`` of the prompt's own
    tokens, log pi(x_j | x_<j) for every prompt token after the first (chat template included),
    under the policy that samples, at the rollout temperature, with this ``low_fraction`` (one
    no-grad forward over the P prompts), i.e. the inverse "T_low" perplexity of the prompt;
    c(o|q) comes from the sampler's log-probs. **Our values, not the paper's** (no authors' code
    was found): ``alpha = 1.0`` is the catalog's worked example (3.36) and ``low_fraction = 0.2``
    the review's "~20%"; the confidence definitions (perplexity on the lowest tokens; whether
    T_low also applies to the prompt, and which prompt tokens count) are this library's reading;
    the catalog's "sum of rewards = 0" test is read here as "no correct answer". Std convention:
    **unbiased** (GRPO). Nearest neighbour:
    ``entropy_adv`` also adds a bounded exploration term, per token and from entropy rather than
    confidence.
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
    only); the multiplier form and beta_pos = beta_neg = 0.5 are **our values, not the paper's**
    (a midpoint, not from any source), and the schedule is left to the caller (lower the betas
    over training). Std convention:
    **unbiased** (GRPO) for A. Nearest neighbour: ``entropy_adv`` adds an entropy bonus to every
    token regardless of polarity.
    """
    adv_PG1 = grpo(rewards, std=std, eps=eps).unsqueeze(-1)
    p_PGT = torch.exp(logprobs.to(rewards.dtype)).clamp(0.0, 1.0)
    gain_PGT = torch.where(adv_PG1 > 0, 1.0 + beta_pos * (1.0 - p_PGT), 1.0 + beta_neg * p_PGT)
    return adv_PG1 * gain_PGT * mask.to(rewards.dtype)
