"""ReST-GRPO's partial-state prompts inside the loop (``rollout.driver = "partial_states"``).

ReST-RL (Zhoubian et al. 2025, arXiv:2508.19576; catalog 3.4; THUDM/ReST-RL
``experiment/process_gen_data.py``) builds each GRPO round's data offline: a prompt whose sampled
rewards spread (population std >= 0.05) and whose best completion scores >= 0.9 also yields
partial-state prompts, ``prompt + prefix``, the prefix being the first k lines of that best
completion (``rollout.driver_params.separator``, a newline by default), with ceil(0.5 * lines) values
of k drawn with replacement, P(k) ~ 0.95^(k-1)
(:func:`~posttrain.algorithms.selection.rest_sample_prefixes`). Here the same rule runs online:

1. after a generation batch is scored, every *base* group that passes
   :func:`~posttrain.algorithms.selection.rest_partial_state_mask` (on the weighted, unshaped reward
   sum) pushes its drawn prefixes onto a FIFO queue (at most ``rollout.driver_params.capacity``; the
   oldest are dropped), draws seeded from ``(seed, "rest", step, batch, group)``;
2. each later generation batch takes up to ``floor(rollout.partial_share * P)`` queued items
   (oldest first) in place of prompts from the data stream. Such a group is sampled from the chat
   prompt followed by the prefix's tokens, scored on ``prefix + continuation`` (what the reward sees
   is a whole response) and trained on the continuation given ``prompt + prefix``.

The queue is part of the loop state (checkpointed), so a resumed run continues it. Partial-state
groups never push prefixes of their own. A partial-state response (prefix + continuation) can be
up to twice ``rollout.max_new_tokens`` long; the context check allows for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from posttrain.algorithms import selection
from posttrain.config import Config
from posttrain.rollout import Rollout
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example


def as_item(example: Example, prefix: str) -> dict:
    """A queue item: the example as plain values (checkpointable) and its prefix."""
    ex = {"prompt": example.prompt, "answer": example.answer, "demonstration": example.demonstration,
          "fields": dict(example.fields), "hint": example.hint}
    return {"example": ex, "prefix": prefix}


def item_example(item: dict) -> Example:
    """The example a queue item was made from."""
    return Example(**item["example"])


def take(queue: list[dict], cfg: Config) -> tuple[list[dict], list[dict]]:
    """The items this generation batch uses (oldest first) and the queue left."""
    n = min(len(queue), int(cfg.rollout.params().share * cfg.rollout.prompts_per_step))
    return queue[:n], queue[n:]


def prefix_ids(tokenizer: object, prefix: str) -> list[int]:
    """The prefix's tokens, appended to the chat prompt (the assistant turn has begun)."""
    return list(tokenizer(prefix, add_special_tokens=False)["input_ids"]) if prefix else []


def with_prefixes(comps: Rollout, prefixes: Sequence[str]) -> Rollout:
    """``comps`` whose texts are each group's prefix + continuation: the whole response, to score."""
    if not any(prefixes):
        return comps
    texts = [prefixes[i // comps.n] + t for i, t in enumerate(comps.texts)]
    return replace(comps, texts=texts)


def push(
    queue: list[dict],
    examples: Sequence[Example],
    prefixes: Sequence[str],
    texts: Sequence[str],
    rewards_PG: Tensor,
    cfg: Config,
    step: int,
    batch: int,
) -> tuple[list[dict], int]:
    """Append the drawn prefixes of every eligible base group (module docstring); returns the new
    queue (capped at ``rollout.driver_params.capacity``, oldest dropped) and how many items were pushed.
    """
    r = cfg.rollout.params()
    G = rewards_PG.shape[1]
    base = torch.tensor([not p for p in prefixes], dtype=torch.bool)
    eligible = selection.rest_partial_state_mask(
        rewards_PG, min_std=r.min_std, accept_threshold=r.accept
    )
    out, pushed = list(queue), 0
    for g in (eligible & base).nonzero().flatten().tolist():
        best = int(rewards_PG[g].argmax())  # the first of the best
        lines = selection.line_prefixes(texts[g * G + best], sep=r.separator)
        gen = torch.Generator().manual_seed(derive_seed(cfg.seed, "rest", step, batch, g))
        ks = selection.rest_sample_prefixes(len(lines), generator=gen, alpha=r.alpha, ratio=r.ratio)
        for k in ks.tolist():
            out.append(as_item(examples[g], lines[k - 1]))
            pushed += 1
    return out[-r.capacity :], pushed
