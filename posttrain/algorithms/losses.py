"""Policy losses (surrogates): per-token loss ``[N, T]`` to be minimized.

Contract (``DESIGN.md``): ``compute(name, logprobs, old_logprobs, advantages, mask, **params)``.
``logprobs [N, T]`` carry gradient; ``old_logprobs [N, T]`` and ``advantages`` (``[N]``,
``[N, 1]`` or ``[N, T]``) do not. The result is masked (zero where ``mask`` is 0) and not yet
reduced: aggregation is a separate axis (``aggregation.reduce``). A positive advantage gives a
negative loss (regression losses such as ``apa`` and ``a_star_po`` are >= 0 but their gradient
still raises log pi where A > 0). ``weights [N, T]`` (optional, no gradient) multiplies the
per-token loss, e.g. importance weights for off-policy data; an entry that declares the keyword
``behaviour_weights`` (``FOLDED_WEIGHTS``: ``vespo``) receives them by that name instead and folds them
into its own sequence weight.

Extra inputs. An entry declares what else it needs as keyword-only parameters *without* a
default (``ref_logprobs [N, T]``, ``rewards [N]``, ``group_ids [N]``); ``inputs(name)`` lists
them and ``compute`` raises ``TypeError`` naming any that are missing. Tensor inputs are detached, except
``GRAD_INPUTS`` (``logsumexp``: the log-partition of the current policy's logits), which carry gradient like
``logprobs``.
Keyword-only parameters *with* a default are hyper-parameters (the paper's defaults).

Sequence-level entries (``gspo``, ``gmpo``, ``a_star_po``, ``drpo``) write their per-sequence
loss so that its per-sequence *token mean* is the paper's sequence term: pair them with
``seq_mean_token_mean`` aggregation to reproduce the paper (verl forces the same).
"""

from __future__ import annotations

import torch
from torch import Tensor

# the registry and the shared helpers live in losses_common, which the entries of the sibling modules import
from posttrain.algorithms.losses_common import (
    FOLDED_WEIGHTS,
    GRAD_INPUTS,
    REGISTRY,
    inputs,
    names,
    register,
)
from posttrain.algorithms.losses_common import _lengths as _lengths
from posttrain.algorithms.losses_common import _log_ratio as _log_ratio
from posttrain.algorithms.losses_common import _masked_mean as _masked_mean
from posttrain.algorithms.losses_common import _per_token as _per_token
from posttrain.algorithms.losses_common import _seq_mean as _seq_mean

__all__ = ["FOLDED_WEIGHTS", "GRAD_INPUTS", "REGISTRY", "compute", "inputs", "names", "register"]


def compute(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    weights: Tensor | None = None,
    **params: object,
) -> Tensor:
    """Look up loss ``name`` and return its masked per-token loss ``[N, T]``.

    ``params`` holds the entry's hyper-parameters and extra inputs (see ``inputs(name)``).
    Unknown parameters raise ``TypeError`` naming the accepted ones; a missing required input
    raises ``TypeError`` naming it.
    """
    fn = REGISTRY.get(name)
    if weights is not None and FOLDED_WEIGHTS in REGISTRY.params(name):
        params, weights = {**params, FOLDED_WEIGHTS: weights}, None
    REGISTRY.check_params(name, params)
    params = {k: v.detach() if isinstance(v, Tensor) and k not in GRAD_INPUTS else v for k, v in params.items()}
    mask_NT = mask.to(logprobs.dtype)
    adv_NT = _broadcast_advantages(advantages, logprobs).detach()
    loss_NT = fn(logprobs, old_logprobs.detach(), adv_NT, mask_NT, **params)
    if weights is not None:
        loss_NT = loss_NT * weights.detach()
    return loss_NT * mask_NT


def _broadcast_advantages(advantages: Tensor, logprobs: Tensor) -> Tensor:
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    return advantages.to(logprobs.dtype).expand_as(logprobs)


# --- token-level ratio surrogates -------------------------------------------------------------


@register("ppo_clip")
def ppo_clip(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    eps_low: float = 0.2,
    eps_high: float = 0.2,
    dual_clip: float | None = None,
) -> Tensor:
    """PPO clipped surrogate with separate low/high clip and optional dual clip.

    rho_t = exp(logpi_t - logpi_old_t);
    l_t = max(-A rho_t, -A clip(rho_t, 1 - eps_low, 1 + eps_high));
    with ``dual_clip = c`` (c > 1) and A < 0: l_t = min(l_t, -A c).
    Shapes: all ``[N, T]`` -> ``[N, T]``. Papers: PPO, Schulman et al. 2017, arXiv:1707.06347;
    clip-higher (eps_high > eps_low) from DAPO, arXiv:2503.14476; dual clip from Ye et al. 2020,
    arXiv:1912.09729 (catalog B5). At rho = 1 the gradient is the policy gradient -A grad logpi.
    Nearest neighbour: ``cispo`` clips only the importance weight and never drops a token.
    """
    ratio = torch.exp(_log_ratio(logp_NT, old_logp_NT))
    unclipped = -adv_NT * ratio
    clipped = -adv_NT * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    if dual_clip is not None:
        if dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be > 1; got {dual_clip}")
        loss = torch.where(adv_NT < 0, torch.minimum(loss, -adv_NT * dual_clip), loss)
    return loss


@register("cispo")
def cispo(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 0.2,
) -> Tensor:
    """CISPO: clipped importance-sampling weight, REINFORCE-style: l_t = -sg(clip(rho_t)) A logpi_t.

    rho_t = exp(logpi_t - logpi_old_t), clipped to [1 - eps_low, 1 + eps_high] and detached, so
    every token keeps a gradient -clip(rho_t) A grad logpi_t (catalog B9: rho = 1.5,
    eps_high = 0.28 -> weight 1.28). Shapes ``[N, T]`` -> ``[N, T]``. Paper: MiniMax-M1,
    arXiv:2506.13585. The paper puts no lower bound on the weight (eps_low large; the default 1.0
    gives a lower bound of 0, the same thing) and tunes eps_high; 0.2 follows verl's example.
    Nearest neighbour: ``ppo_clip`` zeroes the gradient of tokens whose ratio left the band.
    """
    ratio = torch.exp(_log_ratio(logp_NT, old_logp_NT))
    weight = torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high).detach()
    return -weight * adv_NT * logp_NT


@register("reinforce")
def reinforce(logp_NT: Tensor, old_logp_NT: Tensor, adv_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """REINFORCE with group-relative advantage (RGRA): l_t = -A logpi_t; no ratio, no clip.

    Shapes ``[N, T]`` -> ``[N, T]``; ``old_logprobs`` is ignored. Meant for one on-policy update
    per batch with GRPO advantages and ``seq_mean_token_mean`` (the paper's 1/G sum_i 1/|o_i|);
    with one token per response and A = [.866, -.866, -.866, .866] the gradient is -A/4.
    Paper: RGRA, seed papers/004_f298e9ec572f7f27.txt:197 (catalog L197). Nearest neighbour:
    ``cispo`` with a weight of 1 everywhere; ``ppo_clip`` at ratio 1 has the same gradient.
    """
    return -adv_NT * logp_NT


@register("sapo")
def sapo(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    tau_pos: float = 1.0,
    tau_neg: float = 1.05,
) -> Tensor:
    """SAPO soft gate in place of the hard clip: l_t = -A f(rho_t), f(r) = sigmoid(tau (r - 1)) 4/tau.

    tau = tau_pos where A > 0, else tau_neg. f'(1) = 1, so at rho = 1 the gradient is the policy
    gradient -A grad logpi (the value there is -2A/tau); far from 1 the gradient decays smoothly
    instead of dropping to zero. Shapes ``[N, T]`` -> ``[N, T]``. Paper: "Soft Adaptive Policy
    Optimization", arXiv:2511.20347; defaults and form read in verl ``compute_policy_loss_sapo``,
    which aggregates with ``seq_mean_token_mean``. Nearest neighbour: ``ppo_clip`` (hard clip).
    """
    ratio = torch.exp(_log_ratio(logp_NT, old_logp_NT))
    tau = torch.where(adv_NT > 0, torch.full_like(adv_NT, tau_pos), torch.full_like(adv_NT, tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -gate * adv_NT


# --- sequence-level ratio surrogates ----------------------------------------------------------


@register("gspo")
def gspo(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    eps_low: float = 3e-4,
    eps_high: float = 4e-4,
) -> Tensor:
    """GSPO: PPO clip on the sequence ratio s_i = exp(mean_t (logpi_t - logpi_old_t)).

    Token form s_it = sg(s_i) pi_t / sg(pi_t): value s_i, gradient s_i grad logpi_t (log clamped
    at max 10 as in verl); l_it = max(-A s_it, -A clip(s_it, 1 - eps_low, 1 + eps_high)).
    Pair with ``seq_mean_token_mean``: then the gradient is grad of the sequence surrogate.
    Catalog B8: token log-ratios [0.1, -0.1, 0.3] -> s = 1.105171. Shapes ``[N, T]`` -> ``[N, T]``.
    Paper: "Group Sequence Policy Optimization", arXiv:2507.18071; defaults 3e-4 / 4e-4 from
    verl's GSPO example. Nearest neighbour: ``ppo_clip`` clips each token ratio separately;
    ``gmpo`` clips token log-ratios before the geometric mean.
    """
    seq_log_ratio_N = _seq_mean(logp_NT - old_logp_NT, mask_NT)
    log_s_NT = logp_NT - logp_NT.detach() + seq_log_ratio_N.detach()[:, None]
    s_NT = torch.exp(torch.clamp(log_s_NT, max=10.0))
    return torch.maximum(-adv_NT * s_NT, -adv_NT * torch.clamp(s_NT, 1.0 - eps_low, 1.0 + eps_high))


@register("gmpo")
def gmpo(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    eps_low: float = 0.4,
    eps_high: float = 0.4,
) -> Tensor:
    """GMPO: geometric-mean ratio with token-level clipping in log space.

    lr_t = logpi_t - logpi_old_t, clipped pessimistically per token:
    lc_t = sgn(A) min(sgn(A) lr_t, sgn(A) clip(lr_t, -eps_low, eps_high));
    rho_i = exp(mean_t lc_t); L_i = -A_i rho_i, A_i the token-mean advantage of sequence i.
    Token form (same sg trick as ``gspo``): value -A_i rho_i, gradient -A_i rho_i grad lc_t, so
    ``seq_mean_token_mean`` gives grad L_i exactly. Shapes ``[N, T]`` -> ``[N, T]``.
    Paper: "Geometric-Mean Policy Optimization", arXiv:2507.20673; eps 0.4 (clip range
    (e^-0.4, e^0.4)) from verl's ``geo_mean`` example. Nearest neighbour: ``gspo`` clips the
    sequence ratio itself (a ratio of ~1 +- 4e-4) instead of each token's log-ratio.
    """
    lr_NT = _log_ratio(logp_NT, old_logp_NT)
    adv_N = _seq_mean(adv_NT, mask_NT)
    sgn_N1 = torch.sign(adv_N)[:, None]
    lc_NT = sgn_N1 * torch.minimum(sgn_N1 * lr_NT, sgn_N1 * torch.clamp(lr_NT, -eps_low, eps_high))
    log_rho_N = _seq_mean(lc_NT, mask_NT)
    log_s_NT = lc_NT - lc_NT.detach() + log_rho_N.detach()[:, None]
    return -adv_N[:, None] * torch.exp(log_s_NT)


# --- covariance-selected tokens (The Entropy Mechanism of RL for Reasoning LMs) -----------------


# clip_cov and kl_cov (row_coupled): why a micro-batch cannot hold part of their minibatch
_BY_COVARIANCE = "it picks the tokens to {what} by a covariance over all of the minibatch's tokens"


def _centered_cov(adv_NT: Tensor, logp_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """Per-token covariance term (A - mean A)(logpi - mean logpi), means over valid tokens."""
    logp_NT = logp_NT.detach()
    return (adv_NT - _masked_mean(adv_NT, mask_NT)) * (logp_NT - _masked_mean(logp_NT, mask_NT))


@register("clip_cov", row_coupled=True, note=_BY_COVARIANCE.format(what="clip"))
def clip_cov(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    eps_low: float = 1.0,
    eps_high: float = 1.0,
    clip_cov_ratio: float = 2e-4,
    clip_cov_lb: float = 1.0,
    clip_cov_ub: float = 5.0,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Clip-Cov: PPO clip, plus a few high-covariance tokens whose loss (and gradient) is dropped.

    cov_t = (A_t - mean A)(logpi_t - mean logpi) over valid tokens (no gradient). Candidates are
    valid tokens not already clipped by PPO with clip_cov_lb < cov_t < clip_cov_ub; of those,
    max(1, int(clip_cov_ratio * #valid)) are drawn uniformly at random (``generator``) and get
    l_t = 0; the rest get the ``ppo_clip`` loss. Shapes ``[N, T]`` -> ``[N, T]``.
    Paper: "The Entropy Mechanism of Reinforcement Learning for Reasoning Language Models",
    arXiv:2505.22617; read in PRIME-RL/Entropy-Mechanism-of-RL and verl ``clip_cov``. Defaults
    from the authors' 7B/32B recipes (they set clip ratios 1/1, i.e. PPO clip nearly off).
    Nearest neighbour: ``kl_cov`` penalizes the top-covariance tokens instead of dropping them.
    """
    ratio = torch.exp(_log_ratio(logp_NT, old_logp_NT))
    unclipped = -adv_NT * ratio
    clipped = -adv_NT * torch.clamp(ratio, 1.0 - eps_low, 1.0 + eps_high)
    valid = mask_NT > 0
    cov_NT = _centered_cov(adv_NT, logp_NT, mask_NT)
    candidate = valid & ~(clipped > unclipped) & (cov_NT > clip_cov_lb) & (cov_NT < clip_cov_ub)
    idx = torch.nonzero(candidate.flatten()).squeeze(-1)
    n_clip = max(int(clip_cov_ratio * int(valid.sum().item())), 1)
    keep = torch.ones(candidate.numel(), dtype=logp_NT.dtype, device=logp_NT.device)
    if idx.numel() > 0:
        perm = torch.randperm(idx.numel(), generator=generator, device="cpu").to(idx.device)
        keep[idx[perm[:n_clip]]] = 0.0
    return torch.maximum(unclipped, clipped) * keep.view_as(logp_NT)


@register("kl_cov", row_coupled=True, note=_BY_COVARIANCE.format(what="penalize"))
def kl_cov(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    kl_cov_ratio: float = 2e-3,
    ppo_kl_coef: float = 1.0,
) -> Tensor:
    """KL-Cov: unclipped surrogate, plus an |log ratio| penalty on the top-covariance tokens.

    l_t = -A rho_t, and for the k = max(1, int(kl_cov_ratio * #valid)) valid tokens with the
    largest cov_t = (A_t - mean A)(logpi_t - mean logpi): l_t = -A rho_t + ppo_kl_coef |lr_t|,
    lr_t = logpi_t - logpi_old_t. There is no ratio clip. Shapes ``[N, T]`` -> ``[N, T]``.
    Paper: arXiv:2505.22617 (as ``clip_cov``); authors' recipes: k = 0.2 % of tokens (7B; 0.02 %
    for 32B), coefficient 1 (verl's config defaults are 2e-4 and 0.1). Nearest neighbour:
    ``clip_cov`` drops sampled tokens in a covariance band; this penalizes the top-k.
    """
    lr_NT = _log_ratio(logp_NT, old_logp_NT)
    loss = -adv_NT * torch.exp(lr_NT)
    valid = (mask_NT > 0).flatten()
    n_valid = int(valid.sum().item())
    if n_valid == 0:
        return loss
    cov = _centered_cov(adv_NT, logp_NT, mask_NT).flatten()
    k = min(max(1, int(n_valid * kl_cov_ratio)), n_valid)
    top = torch.topk(cov.masked_fill(~valid, float("-inf")), k).indices
    selected = torch.zeros_like(valid)
    selected[top] = True
    penalty = ppo_kl_coef * lr_NT.abs() * selected.view_as(lr_NT).to(lr_NT.dtype)
    return loss + penalty


# --- regression and discriminative losses -----------------------------------------------------


@register("apa")
def apa(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    coef: float = 10.0,
) -> Tensor:
    """APA as the authors' code runs it: squared error between the log-ratio to pi_old and the scaled advantage.

    l_t = (logpi_t - logpi_old_t - coef A_t)^2, no clip. coef = 10 is the code's ``adv_coeff_sq``
    (the paper's 1/lambda); A from GAE. Catalog L217: d = 0.05, A = 0.02 -> (0.05 - 0.2)^2 =
    0.0225. At ratio 1 the gradient is -2 coef A (not -A). Shapes ``[N, T]``. Paper: "Fine-Tuning
    Language Models with Advantage-Induced Policy Alignment", arXiv:2306.02231, seed
    papers/004_f298e9ec572f7f27.txt:217. Nearest neighbours: ``apa_init`` anchors at the initial
    policy (the paper's); ``a_star_po`` regresses a sequence log-ratio to the optimal advantage.
    """
    return (logp_NT - old_logp_NT - coef * adv_NT) ** 2


@register("apa_init")
def apa_init(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    ref_logprobs: Tensor,
    coef: float = 10.0,
) -> Tensor:
    """APA with the paper's anchor: l_t = (logpi_t - logpi_init_t - coef A_t)^2, pi_init the frozen start.

    The paper (arXiv:2306.02231, Eq. 4) regresses log(pi_theta / pi_init) onto A / lambda; the
    authors' code anchors at pi_old instead (``apa``). The reference model is the starting policy
    and is loaded for this loss whatever ``algorithm.kl_coef`` is (with kl_coef 0 there is no KL
    term). Shapes ``[N, T]``; ``old_logprobs`` is unused. Hand example: d_init = 0.1, A = 0.02 ->
    (0.1 - 0.2)^2 = 0.01. Nearest neighbour: ``apa`` (the same regression, anchored at pi_old).
    """
    return (logp_NT - ref_logprobs - coef * adv_NT) ** 2


@register("a_star_po")
def a_star_po(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    ref_logprobs: Tensor,
    beta: float = 1e-3,
) -> Tensor:
    """A*-PO: regress beta * log(pi/pi_ref)(y) onto the optimal advantage r - V*(x).

    L_i = (beta sum_t (logpi_t - logpi_ref_t) - A_i)^2 with A_i = r_i - V*(x) (pass it as
    ``advantages``; V* = beta1 log mean_j exp(r_j / beta1) over reference samples is computed
    offline). The value is written to every token: pair with ``seq_mean_token_mean`` (= the
    authors' batch mean). Catalog 3.9: V* = 0.716890, r = 1 -> 0.080151; r = 0 -> 0.513932.
    ``old_logprobs`` is unused. Shapes ``[N, T]`` -> ``[N, T]``. Paper: "Accelerating RL for
    LLM Reasoning with Optimal Advantage Regression", arXiv:2505.20686, seed
    papers/004_f298e9ec572f7f27.txt:5. Nearest neighbour: ``apa`` (per-token, anchor pi_old).
    """
    log_ratio_N = ((logp_NT - ref_logprobs) * mask_NT).sum(dim=-1)
    seq_loss_N = (beta * log_ratio_N - _seq_mean(adv_NT, mask_NT)) ** 2
    return _per_token(seq_loss_N, logp_NT)


@register("drpo", row_coupled=True, aggregation="seq_mean_token_mean",
          note="each token carries its group's term over the group's rows; the paper's objective is the mean of "
          "the sequences' token means, where token_mean would weigh the groups by their token counts")
def drpo(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    rewards: Tensor,
    group_ids: Tensor,
    tau: float = 10.0,
    lam: float = 0.1,
    beta: float = 1e3,
    delta: float = 1e-4,
    max_len: int | None = None,
) -> Tensor:
    """DRPO: discriminative objective, length-weighted positives, KL trust-region penalty.

    s_i = mean_t logpi_t. Per group q with both correct (``rewards`` > 0.5) and wrong answers:
    J_q = sum_{i in pos} w_i s_i / sum w - tau log mean_{j in neg} exp(s_j / tau),
    w_i = exp((1 - |y_i|/L_max) / lam). Loss = -sum_q J_q / #groups (groups
    without both kinds count in #groups, contribute 0) + c * KL, KL = token-mean k3 to pi_old,
    c = sg(max(beta (KL - delta), 0)). ``advantages`` are unused (the objective is
    discriminative); ``group_ids [N]`` need not be contiguous. The group term is written to
    every token of the group (scaled by N / (#groups G_q)) plus c k3_t per token: with
    ``seq_mean_token_mean`` the group part is exact and the KL part is a sequence-mean KL; any
    other aggregation weighs the groups by their tokens, so the config requires that one.
    L_max = ``max_len`` is the configured maximum response length: the authors divide by the
    padded response width, which verl pads to the configured ``response_length``. The loop fills
    it with ``rollout.max_new_tokens`` (``LearnParts.from_config``, unless ``loss_params`` sets it);
    None (direct calls only) falls back to the padded width T of ``logp_NT``, which in this loop
    is the longest response in the batch, not the paper's L_max. Example: lengths 1, 3 with
    L_max = 10 -> w = softmax([9, 7]) = [0.880797, 0.119203] (with T = 3: [0.998728, 0.001272]).
    The authors' code gives the log-mean-exp the value 1 (sum / sg(sum)); the gradient is the
    same. Paper: "DRPO: Efficient Reasoning via Decoupled Reward Policy Optimization",
    arXiv:2510.04474, seed papers/004_f298e9ec572f7f27.txt:111; code
    Optimization-AI/DRPO ``compute_policy_loss_drpo`` (catalog 3.34). Nearest neighbour:
    ``reinforce`` weights every sample by its own advantage; here negatives share a soft-max.
    """
    if max_len is not None and max_len < 1:
        raise ValueError(f"max_len (DRPO's L_max) must be >= 1; got {max_len}")
    n = logp_NT.shape[0]
    s_N = _seq_mean(logp_NT, mask_NT)
    len_ratio_N = mask_NT.sum(dim=-1) / (max_len if max_len is not None else mask_NT.shape[1])
    _, inv_N = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inv_N.max().item()) + 1 if n > 0 else 1
    member_QN = inv_N[None, :] == torch.arange(n_groups, device=inv_N.device)[:, None]
    pos_QN = member_QN & (rewards > 0.5)[None, :]
    neg_QN = member_QN & (rewards <= 0.5)[None, :]
    valid_Q = pos_QN.any(dim=1) & neg_QN.any(dim=1)
    # finite fill instead of -inf, then where(): every gradient stays finite in dropped groups
    fill = torch.finfo(logp_NT.dtype).min
    w_QN = torch.softmax(torch.where(pos_QN, ((1.0 - len_ratio_N) / lam)[None, :], fill), dim=1).detach()
    pos_term_Q = (w_QN * s_N[None, :]).sum(dim=1)
    n_neg_Q = neg_QN.sum(dim=1).clamp(min=1).to(logp_NT.dtype)
    lse_Q = torch.logsumexp(torch.where(neg_QN, (s_N / tau)[None, :], fill), dim=1)
    lme_Q = torch.where(valid_Q, lse_Q - torch.log(n_neg_Q), torch.zeros_like(lse_Q))
    j_Q = torch.where(valid_Q, pos_term_Q - tau * lme_Q, torch.zeros_like(lse_Q))
    group_size_N = member_QN.sum(dim=1).to(logp_NT.dtype)[inv_N]
    seq_loss_N = -j_Q[inv_N] * n / (n_groups * group_size_N)
    lr_NT = _log_ratio(logp_NT, old_logp_NT)
    k3_NT = torch.exp(lr_NT) - lr_NT - 1.0  # the code's low-var KL: rho - 1 - log rho
    kl = _masked_mean(k3_NT, mask_NT)
    coef = torch.clamp(beta * (kl - delta), min=0.0).detach()
    return _per_token(seq_loss_N, logp_NT) + coef * k3_NT


# entries kept in their own modules register into REGISTRY on import (after the ones above: REGISTRY's order);
# they import losses_common, never this module
from posttrain.algorithms import (  # noqa: E402, F401
    losses_fdiv,
    losses_hybrid,
    losses_lol,
    losses_rover,
    losses_shiq,
    losses_soft,
)
