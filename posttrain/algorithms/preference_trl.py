"""The DPO-family losses of TRL's ``DPOTrainer`` (``loss_type``) that posttrain's other entries lack.

Registered in :mod:`posttrain.algorithms.preference` (through ``preference_common``; same contract:
four ``[B]`` sequence log-prob sums -> per-pair loss ``[B]``, hyper-parameters keyword-only). Formulas follow the
papers; they were checked against TRL 1.16's ``DPOTrainer._compute_loss`` on random inputs
(``tests/algorithms/test_preference_trl.py``), with TRL's ``f_divergence_type = "reverse_kl"``
(the default; the other f-divergences are not offered here). TRL's shared ``beta`` (0.1) is the
default ``beta`` of every entry. Where TRL names a parameter ``label_smoothing`` for different
things, the entries use the paper's meaning: ``flip_rate`` (robust), ``epsilon`` (exo_pair),
``label_smoothing`` (aot, aot_unpaired: conservative-DPO smoothing).

Notation: m_w = logpi(y_w) - logpi_ref(y_w), m_l likewise; h = m_w - m_l; s(x) = sigmoid(x).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from posttrain.algorithms.preference_common import _margin, register


def _logratios(
    chosen_B: Tensor, rejected_B: Tensor, ref_chosen_B: Tensor, ref_rejected_B: Tensor
) -> tuple[Tensor, Tensor]:
    """(m_w, m_l): the chosen and rejected log-ratios against the reference."""
    return chosen_B - ref_chosen_B, rejected_B - ref_rejected_B


def _smoothed_logistic(z_B: Tensor, label_smoothing: float) -> Tensor:
    """Conservative (label-smoothed) logistic loss -(1 - ls) log s(z) - ls log s(-z)."""
    return -(1.0 - label_smoothing) * F.logsigmoid(z_B) - label_smoothing * F.logsigmoid(-z_B)


@register("hinge")
def hinge(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
) -> Tensor:
    """SLiC hinge: L = max(0, 1 - beta h).

    Shapes ``[B]`` -> ``[B]``. Paper: "SLiC-HF: Sequence Likelihood Calibration with Human
    Feedback", Zhao et al. 2023, arXiv:2305.10425 (rank-calibration hinge with margin delta on
    log pi(y_w) - log pi(y_l)); TRL ``loss_type="hinge"`` applies it to the reference-normalized
    margin h, so 1/beta is the margin in units of h (= beta * max(0, 1/beta - h)). Default
    beta = 0.1 (TRL's). beta = 0.1, h = 2 -> 0.8. Nearest neighbour: ``dpo`` (a smooth logistic
    in beta h that never reaches zero); the hinge stops pushing once h >= 1/beta.
    """
    h = _margin(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    return torch.relu(1.0 - beta * h)


@register("robust")
def robust(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
    flip_rate: float = 0.1,
) -> Tensor:
    """rDPO: unbiased DPO under labels flipped with probability eps.

    L = [(1 - eps) l(beta h) - eps l(-beta h)] / (1 - 2 eps), l(z) = -log s(z), eps = ``flip_rate``
    in [0, 0.5) (a ``ValueError`` otherwise; TRL only warns). Its expectation over random flips of
    the label equals the clean DPO loss. Shapes ``[B]`` -> ``[B]``. Paper: "Provably Robust DPO:
    Aligning Language Models with Noisy Feedback", Chowdhury et al. 2024, arXiv:2403.00409; TRL
    ``loss_type="robust"`` with ``label_smoothing = eps``. Default eps = 0.1: the value TRL's
    docstring gives as the paper's typical one (TRL's own default 0.0 makes this ``dpo``);
    beta = 0.1 (TRL's). beta = 0.1, eps = 0.1, h = 2 -> (0.9 * 0.598139 - 0.1 * 0.798139) / 0.8
    = 0.573139. Nearest neighbour: ``dpo`` (eps = 0); conservative DPO (``aot``'s smoothing, TRL's
    ``sigmoid`` with label_smoothing) *adds* the flipped term, this subtracts it and rescales.
    """
    if not 0.0 <= flip_rate < 0.5:
        raise ValueError(f"flip_rate must lie in [0, 0.5); got {flip_rate!r}")
    z = beta * _margin(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    clean, flipped = -F.logsigmoid(z), -F.logsigmoid(-z)
    return ((1.0 - flip_rate) * clean - flip_rate * flipped) / (1.0 - 2.0 * flip_rate)


@register("exo_pair")
def exo_pair(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
    epsilon: float = 1e-3,
) -> Tensor:
    """EXO (pairwise): reverse KL from the policy's pair distribution to the smoothed label.

    q = (s(beta h), s(-beta h)), the softmax of beta (m_w, m_l) over the pair; p = (1 - eps, eps);
    L = KL(q || p) = q_w (log q_w - log(1 - eps)) + q_l (log q_l - log eps). Minimized at
    beta h = log((1 - eps)/eps), not at infinity. eps = ``epsilon`` in (0, 1) (``ValueError``
    otherwise). Shapes ``[B]`` -> ``[B]``. Paper: "Towards Efficient Exact Optimization of
    Language Model Alignment", Ji et al. 2024, arXiv:2402.00856 (EXO-pref, Eq. 16, K = 2); TRL
    ``loss_type="exo_pair"`` with ``label_smoothing = eps``. Defaults: eps = 1e-3, the value TRL's
    docstring gives as the paper's recommendation (TRL rejects its own default 0.0 here);
    beta = 0.1 (TRL's, beta_pi of the paper). Nearest neighbour: ``dpo``, which is the *forward*
    KL(p || q) with eps = 0 (cross-entropy on the label); the reverse KL is mode-seeking.
    """
    if not 0.0 < epsilon < 1.0:
        raise ValueError(f"epsilon must lie in (0, 1); got {epsilon!r}")
    z = beta * _margin(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    log_qw, log_ql = F.logsigmoid(z), F.logsigmoid(-z)
    return log_qw.exp() * (log_qw - math.log1p(-epsilon)) + log_ql.exp() * (log_ql - math.log(epsilon))


@register("nca_pair")
def nca_pair(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
) -> Tensor:
    """NCA (pairwise): L = -log s(beta m_w) - 1/2 log s(-beta m_w) - 1/2 log s(-beta m_l).

    Each response is scored on its own (absolute) log-ratio, not on the margin h, so the chosen
    likelihood is pushed up rather than only above the rejected one. Shapes ``[B]`` -> ``[B]``.
    Paper: "Noise Contrastive Alignment of Language Models with Explicit Rewards", Chen et al.
    2024, arXiv:2402.05369 (NCA with K = 2 and the winner's reward); TRL ``loss_type="nca_pair"``.
    Default beta = 0.1 (TRL's). beta = 0.1, m_w = 1, m_l = -1 -> 0.644397 + 0.5 * 0.744397
    + 0.5 * 0.644397 = 1.338794. Nearest neighbour: ``bco_pair`` (full weight on -log s(-beta m_l),
    no term pushing the chosen down); ``dpo`` uses only h.
    """
    m_w, m_l = _logratios(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    r_w, r_l = beta * m_w, beta * m_l
    return -F.logsigmoid(r_w) - 0.5 * F.logsigmoid(-r_w) - 0.5 * F.logsigmoid(-r_l)


@register("bco_pair")
def bco_pair(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
    delta: float = 0.0,
) -> Tensor:
    """BCO (pairwise): a binary classifier on rewards, L = -log s(beta m_w - delta) - log s(-(beta m_l - delta)).

    Chosen responses are the positives, rejected the negatives, with the implicit reward
    r = beta m as the logit shifted by delta. Shapes ``[B]`` -> ``[B]``. Paper: "Binary Classifier
    Optimization for Large Language Model Alignment", Jung et al. 2024, arXiv:2404.04656. State:
    the paper's delta is a running mean of the rewards over past batches (a moving average kept
    by the trainer); the registry stays a pure function of the batch, so delta is a constant
    parameter here. Default delta = 0.0: TRL 1.16's ``loss_type="bco_pair"`` uses no shift
    (earlier TRL versions kept a running mean of the batch-mean reward); beta = 0.1 (TRL's).
    beta = 0.1, m_w = 1, m_l = -1, delta = 0 -> 2 * 0.644397 = 1.288794. Nearest neighbour:
    ``nca_pair`` (half-weighted negative terms on both responses); ``dpo`` scores the margin h.
    """
    m_w, m_l = _logratios(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    return -F.logsigmoid(beta * m_w - delta) - F.logsigmoid(-(beta * m_l - delta))


@register("sppo_hard")
def sppo_hard(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
) -> Tensor:
    """SPPO with hard win probabilities: L = (m_w - 1/(2 beta))^2 + (m_l + 1/(2 beta))^2.

    SPPO regresses log pi(y)/pi_t(y) on eta (P(y > pi_t) - 1/2); with P = 1 for the winner and
    0 for the loser and eta = 1/beta the targets are +-1/(2 beta). The anchor is the reference
    here (TRL's choice); the paper's is the previous iterate pi_t, which it equals when the
    reference is reset to the policy at each iteration. Shapes ``[B]`` -> ``[B]``. Paper:
    "Self-Play Preference Optimization for Language Model Alignment", Wu et al. 2024,
    arXiv:2405.00675 (Eq. 4.7; the paper estimates P with PairRM, this is the hard version); TRL
    ``loss_type="sppo_hard"``. Default beta = 0.1 (TRL's). beta = 0.1, m_w = 1, m_l = -1 ->
    (1 - 5)^2 + (-1 + 5)^2 = 32. Nearest neighbour: ``ipo`` (one squared target on the margin h;
    here each response's own log-ratio has its target).
    """
    m_w, m_l = _logratios(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    target = 0.5 / beta
    return (m_w - target) ** 2 + (m_l + target) ** 2


@register("aot")
def aot(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> Tensor:
    """AOT (paired): DPO between the *sorted* policy and reference log-ratios of the batch.

    d = sort_B(logpi(y_w) - logpi(y_l)), d_ref = sort_B(logpi_ref(y_w) - logpi_ref(y_l)) (each
    ascending over the batch); Delta_i = d_i - d_ref_i; L_i = -(1 - ls) log s(beta Delta_i)
    - ls log s(-beta Delta_i). Sorting solves the 1-D optimal transport between the two
    empirical distributions, so the policy's margin distribution is pushed to dominate the
    reference's (first-order stochastic dominance) rather than pair by pair. Batch-dependent:
    entry i of the ``[B]`` result is the i-th quantile, not pair i (only the mean is meaningful;
    the gradient flows through the sort). Shapes ``[B]`` -> ``[B]``. Paper: "Distributional
    Preference Alignment of LLMs via Optimal Transport", Melnyk et al. 2024, arXiv:2406.05882;
    TRL ``loss_type="aot"``. Defaults beta = 0.1, ls = 0.0 (TRL's). Nearest neighbour: ``dpo``,
    which pairs d_i with d_ref_i of the same pair (identical when both orders agree, e.g. B = 1);
    ``aot_unpaired`` sorts m_w and m_l instead.
    """
    d, _ = torch.sort(chosen_B - rejected_B, dim=0)
    d_ref, _ = torch.sort(ref_chosen_B - ref_rejected_B, dim=0)
    return _smoothed_logistic(beta * (d - d_ref), label_smoothing)


@register("aot_unpaired")
def aot_unpaired(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> Tensor:
    """AOT (unpaired): DPO between the sorted chosen and sorted rejected log-ratios of the batch.

    Delta_i = sort_B(m_w)_i - sort_B(m_l)_i; L_i = -(1 - ls) log s(beta Delta_i)
    - ls log s(-beta Delta_i): the distribution of chosen rewards is pushed to dominate that of
    rejected rewards, so chosen and rejected need not come from the same prompt. Batch-dependent
    like ``aot`` (entry i is the i-th quantile). Shapes ``[B]`` -> ``[B]``. Paper: "Distributional
    Preference Alignment of LLMs via Optimal Transport", Melnyk et al. 2024, arXiv:2406.05882
    (AOT unpaired); TRL ``loss_type="aot_unpaired"`` (named ``aot_pair`` in TRL before 1.0).
    Defaults beta = 0.1, ls = 0.0 (TRL's). Nearest neighbour: ``aot`` (sorts the pairs' margins
    under policy and reference); ``dpo`` without the sort.
    """
    m_w, _ = torch.sort(chosen_B - ref_chosen_B, dim=0)
    m_l, _ = torch.sort(rejected_B - ref_rejected_B, dim=0)
    return _smoothed_logistic(beta * (m_w - m_l), label_smoothing)


@register("apo_zero")
def apo_zero(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
) -> Tensor:
    """APO-zero: L = (1 - s(beta m_w)) + s(beta m_l).

    Anchored: raises the chosen likelihood and lowers the rejected one, each against the
    reference (zero), for when the chosen outputs are better than the model's own. Shapes ``[B]``
    -> ``[B]``. Paper: "Anchored Preference Optimization and Contrastive Revisions: Addressing
    Underspecification in Alignment", D'Oosterlinck et al. 2024, arXiv:2408.06266 (Eq. 7); TRL
    ``loss_type="apo_zero"``. Default beta = 0.1 (TRL's). beta = 0.1, m_w = 1, m_l = -1 ->
    2 s(-0.1) = 0.950042. Nearest neighbour: ``apo_down`` (lowers both, the rejected more);
    ``dpo`` only fixes the margin h, so both likelihoods may fall.
    """
    m_w, m_l = _logratios(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    return (1.0 - torch.sigmoid(beta * m_w)) + torch.sigmoid(beta * m_l)


@register("apo_down")
def apo_down(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
) -> Tensor:
    """APO-down: L = s(beta m_w) + (1 - s(beta h)).

    Anchored: lowers the chosen likelihood against the reference and the rejected one more (the
    margin term), for when the chosen outputs are worse than the model's own. Shapes ``[B]`` ->
    ``[B]``. Paper: "Anchored Preference Optimization and Contrastive Revisions: Addressing
    Underspecification in Alignment", D'Oosterlinck et al. 2024, arXiv:2408.06266 (Eq. 8); TRL
    ``loss_type="apo_down"``. Default beta = 0.1 (TRL's). beta = 0.1, m_w = 1, m_l = -1 ->
    s(0.1) + 1 - s(0.2) = 0.975145. Nearest neighbour: ``apo_zero`` (raises the chosen).
    """
    m_w, m_l = _logratios(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    return torch.sigmoid(beta * m_w) + (1.0 - torch.sigmoid(beta * (m_w - m_l)))


@register("discopop")
def discopop(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
    tau: float = 0.05,
) -> Tensor:
    """DiscoPOP (log-ratio modulated loss): L = (1 - w) (-log s(z)) + w exp(-z), w = s(z / tau), z = beta h.

    Blends the logistic (DPO) loss, where z < 0, with the exponential loss, where z > 0; the
    blend is non-convex around z = 0. Shapes ``[B]`` -> ``[B]``. Paper: "Discovering Preference
    Optimization Algorithms with and for Large Language Models", Lu et al. 2024, arXiv:2406.08414
    (Eq. 5, the LLM-discovered LRML); TRL ``loss_type="discopop"`` with ``discopop_tau``.
    Defaults tau = 0.05 (the paper's recommendation, TRL's default), beta = 0.1 (TRL's). beta = 0.1,
    tau = 0.05, h = 2: z = 0.2, w = s(4) = 0.982014 -> 0.017986 * 0.598139 + 0.982014 * 0.818731
    = 0.814763. Nearest neighbour: ``dpo``, which it equals where z << -tau (w -> 0); as
    tau -> 0 it switches to the exponential loss at z = 0, as tau -> infinity it averages the two.
    """
    z = beta * _margin(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    w = torch.sigmoid(z / tau)
    return (1.0 - w) * -F.logsigmoid(z) + w * torch.exp(-z)
