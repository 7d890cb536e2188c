"""Advantage inputs the loop computes on demand: each only when the run's estimator requires it.

``metric [P, G]`` (CANON; ``algorithm.advantage_metric``) and ``prompt_confidence [P]``
(ProGRPO) join the inputs every estimator may read (``lengths``, ``mask``, ``logprobs``, ...).
The token ``entropies`` they may build on come from ``update.policy_entropies``.
``token_rewards [P, G, T]`` carry the KL penalty in the reward (``algorithm.kl_reward_coef``) to
the estimators that take them (``gae``, ``reinforce_pp``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from posttrain.algorithms.advantages import low_prob_confidence
from posttrain.rollout import Rollout
from posttrain.train.logprobs import completion_logprobs, prompt_logprobs
from posttrain.train.parts import Parts


def advantage_inputs(
    parts: Parts,
    model: torch.nn.Module,
    ref_model: torch.nn.Module | None,
    prompt_ids: list[list[int]],
    comps: Rollout,
    mask_NT: Tensor,
    entropies_NT: Tensor | None,
    pad_id: int,
    temperature: float,
    kl_coef: float | None = None,
) -> dict[str, Tensor]:
    """The on-demand inputs the estimator requires, by name; ``{}`` when it requires none.
    ``kl_coef`` is the KL-in-the-reward coefficient in use (the adaptive controller's; default
    ``parts.kl_reward_coef``).
    """
    P, G = len(prompt_ids), comps.n
    out: dict[str, Tensor] = {}
    if parts.kl_reward is not None:
        if ref_model is None:
            raise ValueError("the KL penalty in the reward needs the reference model")
        row_prompts = [p for p in prompt_ids for _ in range(G)]
        out["token_rewards"] = kl_token_rewards(
            parts.kl_reward,
            parts.kl_reward_coef if kl_coef is None else kl_coef,
            ref_model,
            row_prompts,
            comps,
            mask_NT,
            pad_id,
            temperature,
        ).view(P, G, -1)
    if parts.metric is not None:
        ent_PGT = entropies_NT.view(P, G, -1) if entropies_NT is not None else None
        out["metric"] = response_metric(parts.metric, comps.lengths.view(P, G), ent_PGT, comps.loss_mask.view(P, G, -1))
    if parts.needs_prompt_confidence:
        out["prompt_confidence"] = prompt_confidence(
            model, prompt_ids, pad_id=pad_id, temperature=temperature, fraction=parts.prompt_fraction
        )
    return out


def response_metric(kind: str, lengths_PG: Tensor, entropies_PGT: Tensor | None, mask_PGT: Tensor) -> Tensor:
    """One number per response, ``[P, G]``: its length (``"length"``), or the mean of its token
    entropies over its response tokens (``"entropy"``; 0 for an empty response), as CANON's
    authors' code regroups by (catalog 3.19).
    """
    if kind == "length":
        return lengths_PG.float()
    if entropies_PGT is None:
        raise ValueError("the entropy metric needs the policy's token entropies")
    m_PGT = mask_PGT.float()
    return (entropies_PGT.float().cpu() * m_PGT).sum(-1) / m_PGT.sum(-1).clamp(min=1.0)


def prompt_confidence(
    model: torch.nn.Module, prompt_ids: list[list[int]], *, pad_id: int, temperature: float, fraction: float
) -> Tensor:
    """ProGRPO's c(q), ``[P]``: ``low_prob_confidence`` of the prompt's own token log-probs under
    ``model``, exp(mean of the lowest ``fraction`` of log pi(x_j | x_<j)), the inverse "T_low"
    perplexity of the prompt. Provisional (see ``advantages.progrpo``).
    """
    logp_PL, mask_PL = prompt_logprobs(model, prompt_ids, pad_id=pad_id, temperature=temperature)
    return low_prob_confidence(logp_PL[:, None], mask_PL[:, None], fraction=fraction)[:, 0]


@torch.no_grad()
def kl_token_rewards(
    estimator: Callable[[Tensor, Tensor], Tensor],
    coef: float,
    ref_model: torch.nn.Module,
    row_prompts: list[list[int]],
    comps: Rollout,
    mask_NT: Tensor,
    pad_id: int,
    temperature: float,
) -> Tensor:
    """The KL penalty in the reward, ``[N, T]``: r^KL_t = -coef * KL_t on every response token (0 on
    padding), KL_t = ``estimator(log pi_old(y_t), log pi_ref(y_t))`` with the sampler's log-probs
    and the reference's, both at the sampling temperature (InstructGPT / PPO-RLHF, REINFORCE++;
    verl ``apply_kl_penalty`` with ``use_kl_in_reward``; OpenRLHF ``compute_reward``).
    """
    ref_NT = completion_logprobs(
        ref_model, row_prompts, comps.token_ids, mask_NT, pad_id=pad_id, temperature=temperature
    )[0].float().cpu()
    m = mask_NT.float().cpu()
    return -coef * estimator(comps.behaviour_logprobs.float().cpu(), ref_NT) * m


def kl_reward_metrics(token_rewards_PGT: Tensor | None, mask_PGT: Tensor, coef: float) -> dict[str, float]:
    """``kl_reward/kl``: the KL estimate per response token, mean over responses of each one's token
    mean (verl's ``actor/reward_kl_penalty``); ``kl_reward/penalty``: the penalty summed over a
    response, mean over responses. ``{}`` without a KL in the reward.
    """
    if token_rewards_PGT is None:
        return {}
    m = mask_PGT.float()
    n = m.sum(-1)
    keep = n > 0
    if not keep.any():
        return {"kl_reward/kl": float("nan"), "kl_reward/penalty": float("nan")}
    per_seq_sum = (token_rewards_PGT.float() * m).sum(-1)[keep]
    return {
        "kl_reward/kl": float((-per_seq_sum / n[keep]).mean() / coef),
        "kl_reward/penalty": float(per_seq_sum.mean()),
        "kl_reward/coef": coef,
    }
