"""Preference (DPO-family) losses: per-pair sequence log-probs -> per-pair loss ``[B]``.

Contract: ``compute(name, policy_chosen_logps, policy_rejected_logps, ref_chosen_logps,
ref_rejected_logps, **params) -> [B]``. Each input is ``[B]``: the *summed* token log-probs of
the chosen (y_w) and rejected (y_l) response (length-average them first for the IPO variant
TRL uses). The policy inputs carry gradient, the reference ones are detached. The result is
not reduced (take ``.mean()``). Extra inputs are keyword-only parameters without a default
(``inputs(name)`` lists them; ``compute`` raises ``TypeError`` when one is missing);
hyper-parameters are keyword-only with the paper's defaults.

Notation: m_w = logpi(y_w) - logpi_ref(y_w), m_l likewise; h = m_w - m_l.

TRL's other ``DPOTrainer`` loss types (hinge, robust, exo_pair, nca_pair, bco_pair, sppo_hard,
aot, aot_unpaired, apo_zero, apo_down, discopop) live in :mod:`posttrain.algorithms.preference_trl`,
registered here by the import at the end of this module.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

# the registry and the margin live in preference_common, which preference_trl's entries import
from posttrain.algorithms.preference_common import REGISTRY, inputs, names, register
from posttrain.algorithms.preference_common import _margin as _margin

__all__ = ["REGISTRY", "compute", "inputs", "names", "register"]


def compute(
    name: str,
    policy_chosen_logps: Tensor,
    policy_rejected_logps: Tensor,
    ref_chosen_logps: Tensor,
    ref_rejected_logps: Tensor,
    **params: object,
) -> Tensor:
    """Look up preference loss ``name`` and return the per-pair loss ``[B]``.

    Unknown parameters raise ``TypeError`` naming the accepted ones; a missing required input
    raises ``TypeError`` naming it.
    """
    fn = REGISTRY.get(name)
    REGISTRY.check_params(name, params)
    return fn(
        policy_chosen_logps,
        policy_rejected_logps,
        ref_chosen_logps.detach(),
        ref_rejected_logps.detach(),
        **params,
    )


@register("dpo")
def dpo(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
) -> Tensor:
    """DPO (sigmoid): L = -log sigmoid(beta h).

    Shapes ``[B]`` -> ``[B]``. Paper: "Direct Preference Optimization", Rafailov et al. 2023,
    arXiv:2305.18290; TRL ``loss_type="sigmoid"`` (catalog B12: beta = 0.1, m_w = 1, m_l = -1 ->
    0.598139). Nearest neighbour: ``ipo`` regresses h to a finite target instead of pushing it
    to infinity.
    """
    return -F.logsigmoid(beta * _margin(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B))


@register("ipo")
def ipo(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    beta: float = 0.1,
) -> Tensor:
    """IPO: L = (h - 1/(2 beta))^2.

    Shapes ``[B]`` -> ``[B]``. Paper: "A General Theoretical Paradigm to Understand Learning from
    Human Preferences", Azar et al. 2023, arXiv:2310.12036 (Eq. 17). TRL feeds length-averaged
    log-probs to IPO; pass those if you want TRL's numbers. Nearest neighbour: ``dpo``, whose
    sigmoid loss keeps pushing h up even on deterministic preferences.
    """
    h = _margin(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    return (h - 1.0 / (2.0 * beta)) ** 2


@register("cpl")
def cpl(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    alpha: float = 0.1,
    contrastive_bias: float = 0.5,
) -> Tensor:
    """CPL: reference-free contrastive loss L = -log sigmoid(alpha S_w - lambda alpha S_l).

    S = sum_t logpi (gamma = 1), lambda = ``contrastive_bias`` in (0, 1] (conservative bias).
    The reference log-probs are ignored. Catalog L131: alpha = 0.1, S_w = -10, S_l = -12:
    lambda = 0.5 -> 0.9130, lambda = 1 -> 0.5981. The optional BC term of the authors' code
    (c_bc mean(-logpi) on positives) is left out: it needs per-token log-probs. Shapes ``[B]``.
    Paper: "Contrastive Preference Learning", Hejna et al. 2023, arXiv:2310.13639, seed
    papers/004_f298e9ec572f7f27.txt:131; code jhejna/cpl ``biased_bce_with_logits``. Nearest
    neighbour: ``dpo`` with lambda = 1 and pi_ref = 1 (no reference model).
    """
    return -F.logsigmoid(alpha * chosen_B - contrastive_bias * alpha * rejected_B)


@register("inpo")
def inpo(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    prev_chosen_logps: Tensor,
    prev_rejected_logps: Tensor,
    eta: float = 1.0,
    tau: float = 0.1,
) -> Tensor:
    """INPO: L = (h_t - eta/2)^2 with a mirror-descent target mixing pi_ref and the last iterate.

    h_t = log pi(y_w)/pi(y_l) - eta tau log pi_ref(y_w)/pi_ref(y_l)
          - (1 - eta tau) log pi_t(y_w)/pi_t(y_l),
    pi_t the previous iterate (frozen; ``prev_*_logps [B]``, detached), which also sampled the
    pairs. Why this form: the KL-regularized online-mirror-descent step
    pi_{t+1} ~ pi_t^(1 - eta tau) pi_ref^(eta tau) exp(eta P(y > pi_t)) gives
    h_t(y, y') = eta (P(y > pi_t) - P(y' > pi_t)); regressing h_t on eta (1[y wins] - 1/2) over
    pairs from pi_t has that minimizer (IPO's argument), and an ordered (y_w, y_l) pair has the
    target eta/2. Catalog L203: eta = 1, tau = 0.1, d_theta = 1, d_ref = 0, d_t = 0.6 -> h = 0.46,
    L = 0.0016. UNSURE: the catalog wrote this from memory ("verify the scale and sign", open
    item in part 2 section 5); the derivation above is self-consistent and a public
    re-implementation (a TRL ``DPOTrainer`` subclass) uses the same loss with eta replaced by its
    inverse (anchors tau/eta and 1 - tau/eta, target 1/(2 eta)), but no authors' code was found
    (code search for the arXiv id finds citations only), so the paper's own eta convention is
    unchecked. **eta = 1.0 and tau = 0.1 are our values, not the paper's**: the catalog's worked
    example (L203); at eta = 1 the two eta conventions coincide (eta = 1/eta). With pi_t = pi_ref
    this is ``ipo`` with beta = 1/eta.
    Shapes ``[B]`` -> ``[B]``. Paper: "Iterative Nash Policy Optimization: Aligning LLMs with
    General Preferences via No-Regret Learning", Zhang et al. 2024, arXiv:2407.00617, seed
    papers/004_f298e9ec572f7f27.txt:203. Nearest neighbour: ``ipo`` (target 1/(2 beta), anchor
    pi_ref only) is the pi_t = pi_ref case.
    """
    d_theta = chosen_B - rejected_B
    d_ref = ref_chosen_B - ref_rejected_B
    d_prev = (prev_chosen_logps - prev_rejected_logps).detach()
    h = d_theta - eta * tau * d_ref - (1.0 - eta * tau) * d_prev
    return (h - eta / 2.0) ** 2


@register("ra_dpo")
def ra_dpo(
    chosen_B: Tensor,
    rejected_B: Tensor,
    ref_chosen_B: Tensor,
    ref_rejected_B: Tensor,
    *,
    chosen_risk: Tensor,
    rejected_risk: Tensor,
    beta: float = 0.1,
    alpha: float = 0.5,
    variant: Literal[1, 2] = 1,
) -> Tensor:
    """Ra-DPO: DPO with a token-level CVaR risk ratio in place of the sequential KL.

    logits = h - (R_l - R_w) (``variant=1``, Ra-DPO1, the authors' default) or
    h - alpha (R_l - sg(R_w)) (``variant=2``, Ra-DPO2); L = -log sigmoid(beta logits). R = ``chosen_risk`` /
    ``rejected_risk [B]`` from :func:`token_risk` (per-token, full-vocabulary log-probs of policy
    and reference); they carry the policy's gradient, as in the authors' code. Catalog L205:
    m_w = 2, m_l = -1, R_w = 0.3, R_l = 0.5 -> logits 2.8 -> 0.5629. ``alpha`` is used only by
    Ra-DPO2. Defaults beta = 0.1, alpha = 0.5, Ra-DPO1 (``config/loss/ra-dpo.yaml``).
    Shapes ``[B]`` -> ``[B]``. Paper: "Risk-aware Direct Preference Optimization under Nested
    Risk Measure", Zhang et al. 2025, arXiv:2505.20359, seed papers/004_f298e9ec572f7f27.txt:205;
    code zlj123-max/Ra-DPO @d6a10e3 ``Ra_DPOTrainer.loss``. Nearest neighbour: ``dpo`` (R = 0);
    TDPO uses the full per-token KL where this uses its upper tail.
    """
    h = _margin(chosen_B, rejected_B, ref_chosen_B, ref_rejected_B)
    if variant == 2:
        logits = h - alpha * (rejected_risk - chosen_risk.detach())
    elif variant == 1:
        logits = h - (rejected_risk - chosen_risk)
    else:
        raise ValueError(f"variant must be 1 or 2; got {variant!r}")
    return -F.logsigmoid(beta * logits)


def token_risk(
    policy_logp_NTV: Tensor,
    ref_logp_NTV: Tensor,
    mask_NT: Tensor,
    *,
    confidence: float = 0.95,
) -> Tensor:
    """Ra-DPO's sequence risk R = sum_t R_t, the CVaR-style part of the per-token KL(ref || pi).

    D_t(v) = logp_ref(v) - logpi(v); VaR_t = quantile_{1 - confidence}(D_t) (linear);
    R_t = sum_v p_ref(v) D_t(v) 1[D_t(v) > VaR_t]. ``[N, T, V]`` log-probs (full vocabulary) and
    ``mask [N, T]`` -> ``[N]``. Catalog L205: p_ref = [.5, .3, .15, .05], pi = [.4, .4, .1, .1]
    -> VaR = -0.6323, R_t = 0.0861 (the full KL is 0.0514). The gradient reaches the policy only:
    dR_t/dlogpi(v) = -p_ref(v) 1[D_t(v) > VaR_t] (the reference is detached, the tail mask is a
    constant), as in the authors' ``get_batch_logps``. ``confidence`` 0.95 is the authors'
    default (``config/loss/ra-dpo.yaml``). The authors' default splits the quantile over two
    halves of the *vocabulary* axis (``is_split_risk_ratio``), which looks like a bug; this is
    the unsplit form.
    """
    d_NTV = ref_logp_NTV.detach() - policy_logp_NTV
    var_NT1 = torch.quantile(d_NTV.detach().float(), 1.0 - confidence, dim=-1, keepdim=True)
    tail_NTV = (d_NTV > var_NT1.to(d_NTV.dtype)).to(d_NTV.dtype)
    r_NT = (ref_logp_NTV.detach().exp() * d_NTV * tail_NTV).sum(dim=-1)
    return (r_NT * mask_NT.to(r_NT.dtype)).sum(dim=-1)


# The TRL-family entries register into REGISTRY (through preference_common) after the ones above: REGISTRY's order.
from posttrain.algorithms import preference_trl as _preference_trl  # noqa: E402, F401
