"""The keep rule of rejection-sampling fine-tuning (``posttrain rft``) and the rows it trains on.

Of the G samples of each prompt, a round keeps the *verified* ones, those whose reward (the weighted
sum of the run's reward components) is at least the threshold, and fine-tunes on them with the SFT
loss. This is the E-step filter of ReST-EM (Singh et al. 2023, arXiv:2312.06585: a binary reward,
r(x, y) = 1 keeps y), STaR's "keep the rationales that reach the right answer" (Zelikman et al.
2022, arXiv:2203.14465) and, with ``max_per_prompt = 1`` and a threshold below every reward, RAFT's
best-of-K per prompt (Dong et al. 2023, arXiv:2304.06767).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from torch import Tensor

from posttrain.produce.batch import Batch


@dataclass(frozen=True)
class Kept:
    """Which samples a round keeps, and how many each part of the rule dropped."""

    index_P: list[list[int]]  # the kept sample indices g of each prompt, ascending
    verified: int  # valid samples with reward >= threshold (before dedup and the cap)
    duplicates: int  # verified samples dropped as a repeat of a kept one of the same prompt
    capped: int  # verified, distinct samples dropped by the per-prompt cap

    @property
    def kept(self) -> int:
        """Samples kept, over all prompts."""
        return sum(len(g) for g in self.index_P)


def keep_samples(
    rewards_PG: Tensor,
    valid_PG: Tensor,
    keys_PG: Sequence[Sequence[Hashable]],
    *,
    threshold: float,
    max_per_prompt: int = 0,
    dedup: bool = True,
) -> Kept:
    """The keep rule: which of each prompt's G samples a round trains on (a pure function of its inputs).

    Per prompt p:

        V_p = {g : valid_pg and r_pg >= threshold}           (verified)
        order V_p by reward, highest first, ties by g         (RAFT's ranking)
        dedup: drop g when an earlier g' in that order has key_pg' = key_pg
        cap:   keep the first ``max_per_prompt`` (0 = all)

    ``rewards_PG`` float ``[P, G]``, ``valid_PG`` bool ``[P, G]`` (False: a reward call failed and
    ``scoring.on_error = "mask"``), ``keys_PG`` P lists of G hashable keys (the completions' token ids:
    equal keys are the same completion). Returns the kept indices of each prompt in ascending order.
    """
    if max_per_prompt < 0:
        raise ValueError(f"max_per_prompt must be >= 0 (0 = no cap); got {max_per_prompt}")
    P, G = rewards_PG.shape
    if valid_PG.shape != (P, G) or len(keys_PG) != P or any(len(k) != G for k in keys_PG):
        raise ValueError(f"rewards {tuple(rewards_PG.shape)}, valid {tuple(valid_PG.shape)} and keys "
                         f"{[len(k) for k in keys_PG]} disagree")
    rewards, valid = rewards_PG.tolist(), valid_PG.tolist()
    index_P: list[list[int]] = []
    verified = duplicates = capped = 0
    for p in range(P):
        ranked = sorted((g for g in range(G) if valid[p][g] and rewards[p][g] >= threshold),
                        key=lambda g: (-rewards[p][g], g))
        verified += len(ranked)
        seen: set[Hashable] = set()
        distinct = []
        for g in ranked:
            if dedup and keys_PG[p][g] in seen:
                duplicates += 1
                continue
            seen.add(keys_PG[p][g])
            distinct.append(g)
        keep = distinct[:max_per_prompt] if max_per_prompt else distinct
        capped += len(distinct) - len(keep)
        index_P.append(sorted(keep))
    return Kept(index_P, verified, duplicates, capped)


@dataclass
class KeptRows:
    """Kept (prompt, completion) pairs as the SFT loss reads them (``trainers/sft.py::demonstration_loss``)."""

    prompts: list[list[int]]  # the prompt each completion is trained on
    targets: list[list[int]]  # completion token ids, EOS included when the sample finished
    loss_masks: list[list[float]]  # 1 on the tokens the policy sampled
    rewards: list[float]
    texts: list[tuple[str, str]]  # (prompt, completion) text, for the run's kept-samples log


def completion_keys(out: Batch) -> list[list[tuple[int, ...]]]:
    """Each sample's completion token ids (up to its end), ``[P][G]``: the dedup keys."""
    rollouts, G = out.rollouts, out.rollouts.n
    lengths = rollouts.attention_mask.sum(1).long().tolist()
    rows = [tuple(rollouts.token_ids[n, : lengths[n]].tolist()) for n in range(len(lengths))]
    return [rows[p * G : (p + 1) * G] for p in range(len(out.examples))]


def kept_rows(out: Batch, rewards_PG: Tensor, kept: Kept) -> KeptRows:
    """The rows of the kept samples of one generation batch: each completion with the prompt its group is
    trained on (``Batch.prompt_ids``) and its loss mask (the sampled tokens; a truncated sample has no EOS).
    """
    rollouts, G = out.rollouts, out.rollouts.n
    rows = KeptRows([], [], [], [], [])
    for p, gs in enumerate(kept.index_P):
        for g in gs:
            n = p * G + g
            length = int(rollouts.attention_mask[n].sum())
            rows.prompts.append(list(out.prompt_ids[p]))
            rows.targets.append(rollouts.token_ids[n, :length].tolist())
            rows.loss_masks.append(rollouts.loss_mask[n, :length].tolist())
            rows.rewards.append(float(rewards_PG[p, g]))
            rows.texts.append((out.examples[p].prompt, out.scored_texts[n]))
    return rows
