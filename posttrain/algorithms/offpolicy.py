"""Behaviour corrections: importance weights for tokens sampled by a policy other than the learner's.

Contract: ``weights(name, old_NT, behaviour_NT, mask_NT, **params) -> w [N, T]`` (no gradient),
multiplied into the policy loss through its ``weights=`` argument. ``old_NT`` is log pi_old, the
learner's log-probs of the sampled tokens before the update (recomputed by the trainer);
``behaviour_NT`` is log mu, what the rollout engine reported when it sampled them (the sampler's
log-probs after temperature, ``Rollout.behaviour_logprobs``). With r_t = pi_old(y_t) / mu(y_t):

- ``none``:     w_t = 1
- ``tis``:      w_t = min(r_t, cap)                                       (truncated IS, per token)
- ``icepop``:   w_t = r_t if low <= r_t <= high else 0                   (token masking outside a band)
- ``seq_mask``: a sequence whose geometric-mean ratio exp(mean_t log r_t) leaves [low, high] gets
                w = 0 on every token; the others token TIS, min(r_t, cap)
- ``mis``:      R = exp(sum_t log r_t) per sequence; w_t = R if R <= cap else 0   (sequence masked IS)

Why: the sampler and the learner disagree even at the same weights (bf16 kernels, another engine,
temperature or top-p semantics), and asynchronous training samples with older weights; the policy
gradient is then biased unless the tokens are re-weighted by pi_old / mu (Yao et al., "Your
efficient RL framework secretly brings you off-policy RL training", 2025, a blog). The forms are
those of the RL frameworks that ship them: token TIS with cap 2 (verl's ``rollout_is_threshold``),
token masking and sequence masking with a geometric-mean band (OpenRLHF), sequence masked IS with
cap 3 (TRL's ``vllm_importance_sampling_mode = "sequence_mask"``); the bands of ``icepop``
([0.5, 2]) and ``seq_mask`` ([0.9, 1.1]) are posttrain's defaults, not taken from a paper. Masked
(padding) positions get w = 0 and never enter a sequence's ratio.

Off-policy sequence masking (``off_policy_sequence_mask``, the loss weight ``opsm`` of ``loss_weights.py``) is
not a weight from the two log-probs alone: it also reads the advantage's sign and the *current* policy, so it
is one of the loss weights the update multiplies into the loss's output, and it composes with any of these.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.algorithms.registry import F, Registry

REGISTRY: Registry = Registry("behaviour correction")
names = REGISTRY.names


def register(name: str, **traits: object) -> Callable[[F], F]:
    """Register a correction; it reads the sampler's log-probs (``reads_behaviour``) unless it says otherwise:
    the update multiplies in the weights of a correction that reads them, and skips one that does not (``none``,
    whose weights are all 1), so a new correction is never left out by a forgotten trait.
    """
    return REGISTRY.register(name, **{"reads_behaviour": True, **traits})


@torch.no_grad()
def weights(name: str, old_NT: Tensor, behaviour_NT: Tensor, mask_NT: Tensor, **params: float) -> Tensor:
    """Look up correction ``name``: the per-token weights ``[N, T]`` (float32, 0 where ``mask_NT`` is 0)."""
    fn = REGISTRY.get(name)
    log_r = (old_NT.float() - behaviour_NT.float()) * mask_NT
    return fn(log_r, mask_NT.float(), **params) * mask_NT


@register("none", reads_behaviour=False)
def none(log_r_NT: Tensor, mask_NT: Tensor) -> Tensor:
    """No correction: w_t = 1 (the sampler's tokens are treated as the learner's own)."""
    return torch.ones_like(log_r_NT)


@register("tis", note="its weights are pi_old / mu, mu the sampler's log-probs")
def tis(log_r_NT: Tensor, mask_NT: Tensor, *, cap: float = 2.0) -> Tensor:
    """Truncated importance sampling: w_t = min(pi_old / mu, cap).

    Paper: Yao et al., "Your efficient RL framework secretly brings you off-policy RL training"
    (2025 blog; verl, OpenRLHF and TRL ship it); one of the corrections arXiv:2510.26788 (Qi et al.,
    "Defeating the Training-Inference Mismatch via FP16") compares.

    Hand example: log r = [log 0.5, log 1.5, log 4] -> w = [0.5, 1.5, 2.0] with cap 2.
    Nearest neighbour: ``icepop`` (drops tokens out of band instead of capping them).
    """
    return log_r_NT.exp().clamp(max=cap)


@register("icepop", note="its weights are pi_old / mu, mu the sampler's log-probs")
def icepop(log_r_NT: Tensor, mask_NT: Tensor, *, low: float = 0.5, high: float = 2.0) -> Tensor:
    """Token masking: w_t = pi_old / mu inside [low, high], 0 outside (the token leaves the gradient).

    Paper: IcePop, in Ring-1T (arXiv:2510.18855): M(k) = k for k in [alpha, beta], else 0, on the
    training/inference probability ratio; the band here is posttrain's default.

    Hand example: r = [0.4, 1.0, 1.9, 2.5], band [0.5, 2] -> w = [0, 1.0, 1.9, 0].
    Nearest neighbour: ``tis`` (keeps and caps every token).
    """
    r = log_r_NT.exp()
    return torch.where((r >= low) & (r <= high), r, torch.zeros_like(r))


@register("seq_mask", note="its weights are pi_old / mu, mu the sampler's log-probs")
def seq_mask(
    log_r_NT: Tensor, mask_NT: Tensor, *, low: float = 0.9, high: float = 1.1, cap: float = 2.0
) -> Tensor:
    """Sequence mask, then token TIS: a row whose geometric-mean ratio exp(mean_t log r_t) is outside
    [low, high] gets w = 0; the rest w_t = min(r_t, cap).

    Hand example: rows log r = [[0.0, 0.1], [0.3, 0.3]] -> means 0.05 (exp 1.051, kept) and 0.3
    (exp 1.350, dropped) -> w = [[1.0, 1.105], [0, 0]].
    Nearest neighbour: ``mis`` (the product of the ratios, not their mean, and kept as the weight).
    """
    n_tok = mask_NT.sum(-1).clamp(min=1)
    geo = (log_r_NT.sum(-1) / n_tok).exp()
    keep = ((geo >= low) & (geo <= high)).float()[:, None]
    return log_r_NT.exp().clamp(max=cap) * keep


@register("mis", note="its weights are pi_old / mu, mu the sampler's log-probs")
def mis(log_r_NT: Tensor, mask_NT: Tensor, *, cap: float = 3.0) -> Tensor:
    """Sequence masked importance sampling: R = prod_t pi_old / mu over the row's tokens; every token
    of the row gets w = R when R <= cap, else 0.

    Paper: the sequence-level masked form (Seq-MIS) that arXiv:2510.26788 (Qi et al., sections
    4.1-4.2) finds the most stable of the IS corrections under BF16; cap 3 as in TRL.

    Hand example: rows log r = [[0.2, 0.3], [0.8, 0.5]] -> R = exp(0.5) = 1.649 (kept) and
    exp(1.3) = 3.669 (> 3: dropped) -> w = [[1.649, 1.649], [0, 0]].
    Nearest neighbour: ``seq_mask`` (a band on the mean log-ratio, token weights inside).
    """
    big_r = log_r_NT.sum(-1).clamp(max=80.0).exp()
    w = torch.where(big_r <= cap, big_r, torch.zeros_like(big_r))
    return w[:, None].expand_as(log_r_NT).clone()


# Corrections whose per-token weight is a whole sequence's ratio, repeated on each of its tokens: a loss that
# folds the weights into its own sequence ratio (losses.FOLDED_WEIGHTS: vespo) would count it once per token.
SEQUENCE_WEIGHTS = ("mis",)


@torch.no_grad()
def off_policy_sequence_mask(
    logp_NT: Tensor, behaviour_NT: Tensor, adv: Tensor, mask_NT: Tensor, *, threshold: float
) -> Tensor:
    """Off-Policy Sequence Masking (OPSM): 0 for a negative-advantage sequence whose policy has drifted from
    the sampler's by more than ``threshold``, else 1; ``[N, 1]`` (``[N, T]`` for token advantages), no gradient.

    KL_i = sum_t m_t (log mu_t - log pi_theta_t) / max(1, sum_t m_t), the sequence mean of the sampler's
    log-probs ``behaviour_NT`` (log mu) minus the current policy's ``logp_NT`` (detached; NaN differences, tokens
    a sampler could not score, count 0); keep = (A >= 0) or (KL_i <= threshold). A positive- or zero-advantage
    sequence is never masked: negative samples the policy has drifted far from are the ones whose update
    destabilizes training (the paper's argument), while the positive ones stay.
    Paper: DeepSeek-V3.2 (arXiv:2512.02556), Eq. 9, its delta = ``threshold``; as TRL 1.16's
    ``off_policy_mask_threshold`` (``GRPOTrainer.get_off_policy_mask``). TRL compares the current log-probs
    with vLLM's sampling log-probs, or, without vLLM, with its recomputed pi_old (and, when it skips computing
    pi_old on-policy, with the current ones: KL 0, nothing masked); every posttrain engine reports the sampler's
    log-probs, so mu here is always the sampler's (``Rollout.behaviour_logprobs``), TRL's vLLM path.
    Hand example: threshold 0.1; rows with A = [-1, -1, +1] and mean log mu - log pi = [0.05, 0.3, 0.3]
    -> keep = [1, 0, 1] (row 2 drifted but its advantage is positive).
    Nearest neighbour: ``seq_mask`` drops a sequence on pi_old / mu alone, whatever its advantage.
    """
    adv_N1 = adv[:, None] if adv.dim() == 1 else adv
    kl_NT = torch.nan_to_num(behaviour_NT.float() - logp_NT.detach().float(), nan=0.0)
    m = mask_NT.float()
    seq_kl_N1 = (kl_NT * m).sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv_N1 >= 0) | (seq_kl_N1 <= threshold)).to(logp_NT.dtype)


@torch.no_grad()
def mismatch_stats(
    old_NT: Tensor, behaviour_NT: Tensor, mask_NT: Tensor, w_NT: Tensor | None
) -> dict[str, float]:
    """Statistics of r_t = pi_old / mu over the masked tokens: ``ratio_mean``, ``ratio_max``,
    ``clipped_frac`` (tokens whose weight ``w_NT`` is not their ratio: capped or dropped; 0 without
    a correction, ``w_NT = None``) and ``mismatch_k3`` (mean of r - 1 - log r, Schulman's k3 of
    KL(mu || pi_old) on the sampler's tokens). Hand example: r = [1, 2] -> mean 1.5, max 2,
    k3 = (0 + (1 - log 2)) / 2 = 0.153426.
    """
    m = mask_NT.float()
    n = float(m.sum())
    if n == 0:
        return {"ratio_mean": 1.0, "ratio_max": 1.0, "clipped_frac": 0.0, "mismatch_k3": 0.0}
    log_r = (old_NT.float() - behaviour_NT.float()) * m
    r = log_r.exp()
    on = m.bool()
    changed = on & ~torch.isclose(w_NT.float(), r, rtol=1e-6, atol=1e-7) if w_NT is not None else on & False
    return {
        "ratio_mean": float((r * m).sum() / n),
        "ratio_max": float(r[on].max()),
        "clipped_frac": float(changed.sum() / n),
        "mismatch_k3": float(((r - 1 - log_r) * m).sum() / n),
    }
