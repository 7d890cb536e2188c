"""Advantage inputs the loop computes on demand: each only when the run's estimator requires it.

``metric [P, G]`` (CANON; ``algorithm.advantage_metric``) and ``prompt_confidence [P]``
(ProGRPO) join the inputs every estimator may read (``lengths``, ``mask``, ``logprobs``, ...).
The token ``entropies`` they may build on come from ``update.policy_entropies``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from posttrain.algorithms.advantages import low_prob_confidence
from posttrain.rollout import Completions
from posttrain.train.logprobs import prompt_logprobs
from posttrain.train.parts import Parts


def advantage_inputs(
    parts: Parts,
    model: torch.nn.Module,
    prompt_ids: list[list[int]],
    comps: Completions,
    entropies_NT: Tensor | None,
    pad_id: int,
    temperature: float,
) -> dict[str, Tensor]:
    """The on-demand inputs the estimator requires, by name; ``{}`` when it requires none."""
    P, G = len(prompt_ids), comps.n
    out: dict[str, Tensor] = {}
    if parts.metric is not None:
        ent_PGT = entropies_NT.view(P, G, -1) if entropies_NT is not None else None
        out["metric"] = response_metric(parts.metric, comps.lengths.view(P, G), ent_PGT, comps.mask.view(P, G, -1))
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
