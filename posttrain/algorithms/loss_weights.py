"""Per-token loss weights: one stream of ``[N, T]`` factors multiplied into the per-token policy loss.

Contract: ``compute(name, **inputs, **params) -> w [N, T]`` (no gradient). The update multiplies the
policy loss of every token by the product of the chosen weights (``algorithm.loss_weights``, in their
order), before the aggregation: loss_t <- loss_t * prod_k w_k,t. The KL and entropy terms are not
weighted, and a token weighted 0 stays in the aggregation's normalizer (as TRL and the papers do).

An entry reads the inputs it declares as keyword-only parameters without a default (:data:`INPUTS`
lists the names the update offers) and takes its parameters as keyword-only parameters with the
paper's defaults. The behaviour correction (``offpolicy.py``) is not one of these: it is the loss's
own ``weights=`` input, which a loss may fold into its ratio (VESPO), where these multiply the
loss's output.

When each is computed is read off its inputs: an entry that reads the policy being trained
(:data:`CURRENT_POLICY`) is computed in every micro-batch's forward pass (a statistic over rows then
needs the ``row_coupled`` trait); the others once per update, over all of the update's rows, before
any forward pass, so a statistic over rows (``top_entropy``'s quantile) does not change with
``train.micro_batch_tokens``, ``train.minibatches`` or the ranks.

Each entry may add named metrics (:func:`statistic`) to the one every entry logs,
``loss_weight/<name>_mean`` (the weight's mean over a minibatch's trained tokens).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.algorithms.offpolicy import off_policy_sequence_mask
from posttrain.algorithms.registry import Registry
from posttrain.algorithms.selection.entropy_tokens import high_entropy_mask
from posttrain.diagnostics.affinity import group_affinity

REGISTRY: Registry = Registry("loss weight")
register = REGISTRY.register
names = REGISTRY.names

# The inputs the update offers, by name (N rows of the update, T response positions).
INPUTS: dict[str, str] = {
    "mask": "[N, T] the loss mask (1 on trained response tokens)",
    "advantages": "[N] or [N, T] the estimator's advantages (no gradient)",
    "logprobs": "[N, T] log pi_theta of the sampled tokens under the policy being trained (detached)",
    "old_logprobs": "[N, T] log pi_old: the learner's before the update (on-policy: the current ones, detached)",
    "behaviour_logprobs": "[N, T] log mu: the sampler's log-probs of its tokens (Rollout.behaviour_logprobs)",
    "entropies": "[N, T] entropy of the policy's next-token distribution before the update (the `entropies` "
    "provider; 0 on padding)",
    "group_ids": "[N] the group (prompt) of each row",
    "rewards": "[N] each row's reward",
    "hint_rerolled": "[N] bool: the row's group was re-rolled with a hint (the hint_reroll driver)",
    "eps_low": "float: the policy loss's lower clip bound (its parameter, else its default, else 0.2)",
    "eps_high": "float: the policy loss's upper clip bound",
}
# Inputs that exist only in a forward pass of the policy being trained (on-policy, pi_old is that policy).
CURRENT_POLICY = ("logprobs", "old_logprobs")


@torch.no_grad()
def compute(name: str, **kwargs: Tensor | float) -> Tensor:
    """Look up loss weight ``name``: its weights ``[N, T]`` from the inputs and parameters in ``kwargs``."""
    return REGISTRY.get(name)(**kwargs).detach()


def inputs(name: str) -> list[str]:
    """The inputs entry ``name`` reads (its keyword-only parameters without a default)."""
    return REGISTRY.required(name)


def params(name: str) -> list[str]:
    """The parameters entry ``name`` takes (its keyword-only parameters with a default)."""
    need = set(REGISTRY.required(name))
    return [k for k in REGISTRY.params(name) if k not in need]


def check(name: str, given: dict[str, object]) -> None:
    """Raise ``TypeError`` for parameters ``name`` does not take (or inputs given as parameters), and the
    entry's own ``ValueError`` for a bad value, by running it on a two-row probe.
    """
    bad = sorted(set(given) - set(params(name)))
    if bad:
        raise TypeError(f"loss weight {name!r} has no parameter(s) {bad}; accepted: {params(name)}")
    probe: dict[str, Tensor | float] = {
        "mask": torch.ones(2, 2), "advantages": torch.tensor([1.0, -1.0]), "logprobs": torch.full((2, 2), -1.0),
        "old_logprobs": torch.full((2, 2), -1.0), "behaviour_logprobs": torch.full((2, 2), -1.0),
        "entropies": torch.tensor([[0.1, 0.2], [0.3, 0.4]]), "group_ids": torch.tensor([0, 0]),
        "rewards": torch.tensor([1.0, 0.0]), "hint_rerolled": torch.tensor([True, True]), "eps_low": 0.2,
        "eps_high": 0.2,
    }
    compute(name, **{k: probe[k] for k in inputs(name) if k in probe}, **given)  # type: ignore[arg-type]


# --- the entries ----------------------------------------------------------------------------------------------


@register("opsm", reads_behaviour=True,
          note="compares the policy with the sampler's log-probs mu, which rows no sampler drew do not have")
def opsm(
    *, logprobs: Tensor, behaviour_logprobs: Tensor, advantages: Tensor, mask: Tensor, threshold: float = 0.5
) -> Tensor:
    """Off-policy sequence masking: w = 0 on every token of a negative-advantage response the policy has
    drifted from by more than ``threshold``, else 1.

    KL_i = sum_t m_t (log mu_t - log pi_theta_t) / max(1, sum_t m_t) (``behaviour_logprobs`` minus
    ``logprobs``); w_i,t = 1 if A_i >= 0 or KL_i <= delta, else 0 (token advantages: per token). Shapes: the
    log-probs and ``mask`` ``[N, T]``, ``advantages`` ``[N]`` or ``[N, T]``; returns ``[N, T]``.
    Paper: DeepSeek-V3.2 (arXiv:2512.02556), Eq. 9, delta = ``threshold``; TRL's ``off_policy_mask_threshold``
    (``offpolicy.off_policy_sequence_mask`` holds the details). The paper gives no value; 0.5 is TRL's example.
    Hand example: delta 0.1, A = [-1, -1, +1], mean log mu - log pi = [0.05, 0.3, 0.3] -> rows [1, 0, 1].
    Nearest neighbour: the behaviour correction ``seq_mask`` drops a sequence on pi_old / mu alone, whatever its
    advantage; ``icepop`` masks tokens, not sequences.
    """
    if threshold <= 0:
        raise ValueError(f"opsm: threshold must be > 0; got {threshold}")
    keep = off_policy_sequence_mask(logprobs, behaviour_logprobs, advantages, mask, threshold=threshold)
    return keep.float().expand(mask.shape).contiguous()


@register("top_entropy", replayable=False,
          note="its quantile is over the update's entropies, which rows stored for replay do not keep")
def top_entropy(*, entropies: Tensor, mask: Tensor, rho: float = 0.2) -> Tensor:
    """80/20: w = 1 on the top-``rho`` share of the update's response tokens by the policy's entropy, 0 elsewhere.

    tau = quantile({H_t : m_t = 1}, 1 - rho) (linear interpolation); w_t = 1 if H_t >= tau and m_t = 1, else 0.
    The quantile is over all the rows given (the update's rows: this entry reads no forward pass). Shapes:
    ``entropies``, ``mask`` ``[N, T]``; returns ``[N, T]``.
    Paper: Wang et al. 2025, "Beyond the 80/20 Rule: High-Entropy Minority Tokens Drive Effective Reinforcement
    Learning for LLM Reasoning", arXiv:2506.01939, rho = 0.2; TRL's ``top_entropy_quantile``
    (``selection/entropy_tokens.py`` holds the details).
    Hand example: H = [0.1, 0.5, 0.9] on three trained tokens, rho = 0.2: quantile(0.8) = 0.5 + 0.6 (0.9 - 0.5)
    = 0.74, so w = [0, 0, 1].
    Nearest neighbour: the ``clip_cov`` / ``kl_cov`` losses also single out a few tokens, by the covariance of
    log-prob and advantage rather than by entropy, and change their loss rather than weight it.
    """
    return high_entropy_mask(entropies, mask, rho)


@register("aapo", row_coupled=True, drivers=("hint_reroll",),
          note="Affinity is a statistic over each group's rows of the minibatch; only hint_reroll re-rolls groups")
def aapo(
    *,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    group_ids: Tensor,
    hint_rerolled: Tensor,
    eps_low: float,
    lam: float = 1.0,
) -> Tensor:
    """HINT's AAPO: every token of a re-rolled group's row gets Affinity(group)^lambda, the other rows 1.

    With rho_t = pi_theta / pi_old over the group's rows in the minibatch, weights |A| and the band
    B = [1 - eps, 1 + eps] (eps = the loss's ``eps_low``, the PPO clip): Affinity = EUR exp(-UC / tau)
    (``diagnostics/affinity.py`` has EUR, UC and tau); w_i,t = Affinity(g_i)^lambda if the row was re-rolled.
    It is 1 on an on-policy minibatch (rho = 1) and below 1 once the policy has moved (later epochs or
    minibatches). Shapes: log-probs and ``mask`` ``[N, T]``, ``advantages`` ``[N]`` or ``[N, T]``,
    ``group_ids`` and ``hint_rerolled`` ``[N]``; returns ``[N, T]``.
    Paper: HINT (arXiv:2510.09388; seed ``papers/000_99b2b1db2eead048.txt:3``),
    affinity_lambda = 1 (ViviqwerAsd/HINT @ 2e917e5, ``lsrl_hint.py``).
    Hand example: eps 0.2, one re-rolled group with rho = [1.0, 1.1, 1.3] and |A| = 1: Affinity 0.395255,
    so lambda 1 gives w = 0.395255 on its tokens and 1 on a row of another group.
    Nearest neighbour: the behaviour correction ``tis`` weights each token by its own ratio pi_old / mu; AAPO
    weighs a whole group by how far pi_theta has moved from pi_old over it.
    """
    if lam < 0:
        raise ValueError(f"aapo: lam must be >= 0; got {lam}")
    aff = group_affinity(logprobs, old_logprobs, mask, group_ids, advantages, eps=eps_low)
    w = aff.to(logprobs.dtype).pow(lam)
    w = torch.where(hint_rerolled.to(torch.bool), w, torch.ones_like(w))
    return w[:, None].expand(mask.shape).float().contiguous()


@register("prob_reweight")
def prob_reweight(*, old_logprobs: Tensor, mask: Tensor, alpha: float = 0.2) -> Tensor:
    """Advantage Reweighting: w_t = alpha * pi_old(o_t) + (1 - alpha), so a token's policy gradient shrinks with its
    probability under the policy that sampled it, and low-probability tokens no longer dominate the update.

    pi_old(o_t) = exp(old_logprobs_t); w_t in [1 - alpha, 1] (alpha = 0: every weight 1). For the clipped
    surrogate, which is linear in A_t for a positive weight, this equals the paper's A'_t = w_t A_t. Shapes:
    ``old_logprobs``, ``mask`` ``[N, T]``; returns ``[N, T]`` (padding 1: the mask removes it).
    Paper: Yang et al. 2025, "Do Not Let Low-Probability Tokens Over-Dominate in RL for LLMs", arXiv:2505.12929
    (Advantage Reweighting; its code zhyang2226/AR-Lopti, ``compute_reweight_advantage`` method
    ``both_linear``: (k * exp(old_log_prob) + tau) * A with tau = 1 - k, k = 0.2 in its AR run, 0.3 with Lopti).
    Hand example: alpha 0.2, pi_old = [0.9, 0.1] -> w = [0.2 * 0.9 + 0.8, 0.2 * 0.1 + 0.8] = [0.98, 0.82].
    Nearest neighbour: ``top_entropy`` keeps a token by the entropy of its whole distribution (0 or 1); this
    scales it smoothly by the sampled token's own probability, and no token's weight falls below 1 - alpha.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"prob_reweight: alpha must be in [0, 1]; got {alpha}")
    w = alpha * old_logprobs.float().exp() + (1.0 - alpha)
    return torch.where(mask > 0, w, torch.ones_like(w))


# --- metrics ----------------------------------------------------------------------------------------------------

_STATS: dict[str, Callable[..., dict[str, float]]] = {}


def statistic(name: str) -> Callable[[Callable[..., dict[str, float]]], Callable[..., dict[str, float]]]:
    """Register the metrics loss weight ``name`` logs beside ``loss_weight/<name>_mean``:
    ``fn(weight_NT, mask_NT, **inputs) -> {metric: value}``, its inputs by :data:`INPUTS` names.
    """

    def deco(fn: Callable[..., dict[str, float]]) -> Callable[..., dict[str, float]]:
        _STATS[name] = fn
        return fn

    return deco


@torch.no_grad()
def stats(name: str, weight_NT: Tensor, mask: Tensor, **inputs: Tensor) -> dict[str, float]:
    """The metrics of weights ``weight_NT`` ``[n, T]`` of one minibatch: ``loss_weight/<name>_mean`` (the mean
    over the trained tokens ``mask``) and the entry's own (:func:`statistic`), reading the ``inputs`` it names.
    """
    m = mask.float()
    n = float(m.sum())
    out = {f"loss_weight/{name}_mean": float((weight_NT.float() * m).sum()) / n if n else 1.0}
    fn = _STATS.get(name)
    if fn is not None:
        wanted = inspect.signature(fn).parameters
        out |= fn(weight_NT.float(), m, **{k: v for k, v in inputs.items() if k in wanted})
    return out


@statistic("opsm")
def _opsm_stats(weight_NT: Tensor, mask_NT: Tensor) -> dict[str, float]:
    """``offpolicy/masked_frac``: the share of the minibatch's responses left out (token advantages: pro rata)."""
    rows = mask_NT.sum(-1) > 0
    kept_N = (weight_NT * mask_NT).sum(-1) / mask_NT.sum(-1).clamp(min=1.0)
    return {"offpolicy/masked_frac": float((1.0 - kept_N[rows]).mean()) if rows.any() else 0.0}


@statistic("top_entropy")
def _top_entropy_stats(weight_NT: Tensor, mask_NT: Tensor) -> dict[str, float]:
    """``policy/entropy_kept_frac``: the share of the trained tokens that keep the policy gradient."""
    return {"policy/entropy_kept_frac": float((weight_NT * mask_NT).sum() / mask_NT.sum().clamp(min=1.0))}


@statistic("aapo")
def _aapo_stats(weight_NT: Tensor, mask_NT: Tensor, *, hint_rerolled: Tensor, advantages: Tensor) -> dict[str, float]:
    """``policy/aapo_weight``: the mean weight of the re-rolled rows that carry a signal (a group whose
    advantages are all 0 has Affinity 0, but its loss is 0 whatever the weight); none: no metric.
    """
    if weight_NT.shape[-1] == 0:
        return {}
    weighted = hint_rerolled.to(torch.bool) & (advantages.reshape(len(weight_NT), -1).abs().sum(-1) > 0)
    return {"policy/aapo_weight": float(weight_NT.amax(-1)[weighted].mean())} if weighted.any() else {}
