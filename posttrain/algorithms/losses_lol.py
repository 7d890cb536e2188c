"""A-LoL: advantage-weighted likelihood with a clamped sequence ratio to the reference, positive advantages only.

The entry registers in the policy-loss registry of :mod:`posttrain.algorithms.losses` (kept in ``losses_common``;
``losses`` imports this module), under its contract:
``(logp_NT, old_logp_NT, adv_NT, mask_NT, **params) -> loss [N, T]``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.losses_common import register

_SEQ_SUM = ("the authors' loss is the batch mean of each sequence's summed NLL x w x A+ (reduce_sum over the "
            "response, torch.mean over the batch); another aggregation would weigh the sequences by their lengths")


RATIOS = ("sequence", "token")


@torch.no_grad()
def importance_weight(logp_NT: Tensor, ref_logprobs: Tensor, mask_NT: Tensor, clip: float, ratio: str) -> Tensor:
    """A-LoL's importance weight, without gradient, as a ``[N, 1]`` (``"sequence"``) or ``[N, T]`` (``"token"``)
    factor of the per-token NLL.

    ``"sequence"`` (``a_lol``): w_i = clamp(pi_theta(y_i|x) / pi_ref(y_i|x), 1 - clip, 1 + clip), the ratio of the
    whole response (the masked sum of log pi_theta - log pi_ref, clamped to [-20, 20] before exp so that a long
    response cannot overflow), the authors' ``importance_sampling_ratio``. ``"token"`` (their ``a_lol_seq``):
    w_t = clamp(pi_theta(y_t) / pi_ref(y_t), 1 - clip, 1 + clip) for each token.
    """
    if ratio == "token":
        return torch.clamp(torch.exp((logp_NT - ref_logprobs).clamp(-20.0, 20.0)), 1.0 - clip, 1.0 + clip)
    log_ratio_N = ((logp_NT - ref_logprobs) * mask_NT).sum(dim=-1).clamp(-20.0, 20.0)
    return torch.clamp(torch.exp(log_ratio_N), 1.0 - clip, 1.0 + clip)[:, None]


@register("a_lol", aggregation="seq_mean_token_sum", note=_SEQ_SUM)
def a_lol(
    logp_NT: Tensor,
    old_logp_NT: Tensor,
    adv_NT: Tensor,
    mask_NT: Tensor,
    *,
    ref_logprobs: Tensor,
    clip: float = 0.9,
    ratio: str = "sequence",
) -> Tensor:
    """A-LoL: l_t = -log pi_theta(y_t) * w_i * max(A_i, 0), w_i the clamped sequence ratio to pi_ref (no gradient).

    Per sequence the tokens sum to NLL_theta(y_i) * w_i * A+_i, the authors' per-response loss; with the declared
    ``seq_mean_token_sum`` aggregation the batch loss is their mean over responses. A+ = max(A, 0): a response
    whose advantage is <= 0 contributes nothing (no loss, no gradient), so the policy only imitates the responses
    that beat the baseline. w_i = clamp(exp(sum_t (log pi_theta_t - log pi_ref_t)), 1 - clip, 1 + clip), clip =
    0.9 the authors' ``ppo_clip``; pi_ref is the frozen starting policy (their ``baseline_model``, the policy that
    produced the offline data), loaded because this entry reads ``ref_logprobs``. ``old_logprobs`` are unused.
    ``ratio = "token"`` is the authors' ``a_lol_seq`` variant: each token's NLL is weighted by its own clamped
    ratio w_t = clamp(pi_theta(y_t) / pi_ref(y_t), 1 - clip, 1 + clip) instead of the response's w_i.
    The paper's A = R - V_ref(x) comes from a value head trained on the reference; pass whichever advantage the
    recipe chooses (``recipes/a_lol.toml``: r - group mean, a Monte Carlo V(x)). The authors' data sampling in
    proportion to A+ (``sampling_strategy``) is not part of the loss.
    Shapes: ``logp_NT``, ``ref_logprobs``, ``mask_NT`` ``[N, T]``; ``adv_NT`` ``[N, T]`` (a row's value repeated)
    -> ``[N, T]``. Catalog 3.16: R = 0.8, V = 0.5, log pi_theta - log pi_ref = -1 over the response -> w =
    0.367879, A+ = 0.3, and for NLL = 2.0 the response's loss is 2.0 * 0.367879 * 0.3 = 0.220728.
    Paper: "Leftover Lunch: Advantage-based Offline Reinforcement Learning for Language Models" (Baheti et al.,
    ICLR 2024), arXiv:2305.14718, seed papers/004_f298e9ec572f7f27.txt:31; code abaheti95/LoL-RL @ 9f8d81660b,
    ``lolrl_qlora_llama_hh.py`` (algorithm ``a_lol``). Nearest neighbour: ``reinforce`` (l_t = -A log pi_t) also
    lowers the likelihood of negative-advantage responses and has no ratio; here those get no gradient and the
    positive ones are weighted by how likely pi_theta finds them relative to pi_ref.
    """
    if not 0.0 <= clip < 1.0:
        raise ValueError(f"clip (A-LoL's ppo_clip) must be in [0, 1) so that 1 - clip > 0; got {clip!r}")
    if ratio not in RATIOS:
        raise ValueError(f"ratio (A-LoL's importance ratio) must be one of {RATIOS}; got {ratio!r}")
    w = importance_weight(logp_NT, ref_logprobs, mask_NT, clip, ratio)
    return -logp_NT * w * adv_NT.clamp(min=0.0)
