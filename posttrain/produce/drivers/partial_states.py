"""The ``partial_states`` rollout driver: ReST-GRPO's partial-state prompts inside the loop.

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

import torch
from pydantic import Field
from torch import Tensor

from posttrain.algorithms import selection
from posttrain.config import ProduceSettings
from posttrain.config.base import Section
from posttrain.errors import ConfigError
from posttrain.produce.batch import Batch
from posttrain.produce.drivers.registry import ProduceContext, draw_prompts, register, sample_and_score
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example, Task


class PartialStatesParams(Section):
    """``rollout.driver = "partial_states"`` (ReST-GRPO, arXiv:2508.19576): a group whose rewards spread
    (std >= min_std) and whose best response scores >= accept queues prompt + line prefixes of that
    response; later steps sample queued partial states in place of up to ``share`` of their prompts
    (posttrain/produce/drivers/partial_states.py).
    """

    min_std: float = Field(0.05, ge=0, description="population std of a group's rewards needed")
    accept: float = Field(0.9, description="the best response's reward needed")
    alpha: float = Field(0.95, gt=0, lt=1, description="P(prefix of k lines) ~ alpha^(k-1)")
    ratio: float = Field(0.5, gt=0, le=1, description="ceil(ratio * lines) prefixes drawn")
    share: float = Field(0.5, gt=0, le=1, description="the largest share of a batch's prompts taken from the queue")
    capacity: int = Field(256, ge=1, description="most queued partial states (oldest dropped)")
    separator: str = Field("\n", min_length=1, description="what splits a response into steps (lines, as the paper)")


def partial_states_fit(
    settings: ProduceSettings, task: Task, tokenizer: object, longest: int, max_positions: int
) -> None:
    """A partial state is the prompt + up to ``max_new_tokens`` of a response, then a continuation of as many."""
    if longest + 2 * settings.rollout.max_new_tokens > max_positions:
        raise ConfigError(
            f"rollout.driver = 'partial_states': prompts of task {settings.task.name!r} take up to {longest} tokens; a "
            f"partial state adds a response prefix of up to rollout.max_new_tokens={settings.rollout.max_new_tokens} "
            f"tokens before the continuation, which exceeds the model's context of {max_positions} tokens"
        )


@register("partial_states", options=PartialStatesParams, fits=partial_states_fit, async_safe=False, engines=("hf",),
          note="its queue holds prefixes of responses from the steps the learner has trained on; tested with "
          "the hf engine only so far")
def partial_states(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Batch, object]:
    """ReST-GRPO: queued partial states replace up to ``share`` of the stream prompts; eligible base
    groups queue prefixes of their best response (module docstring). State: the queue (a list of plain
    dicts, checkpointable).
    """
    P = ctx.settings.rollout.prompts_per_step
    taken, queue = take(list(state or []), ctx.settings)
    n_stream = P - len(taken)
    stream = draw_prompts(ctx.task, n_stream, ctx.settings.seed, cursor) if n_stream else []
    examples = [*stream, *(item_example(it) for it in taken)]
    prefixes = [""] * n_stream + [it["prefix"] for it in taken]
    out = sample_and_score(ctx, examples, prefixes, step, batch, consumed=n_stream)
    queue, pushed = push(queue, examples, prefixes, out.scored_texts, out.rewards_PGK.sum(-1), ctx.settings, step,
                         batch)
    out.metrics |= {
        "selection/partial_groups": float(len(taken)),
        "selection/partial_pushed": float(pushed),
        "selection/partial_queue": float(len(queue)),
    }
    return out, queue


def as_item(example: Example, prefix: str) -> dict:
    """A queue item: the example as plain values (checkpointable) and its prefix."""
    ex = {"prompt": example.prompt, "answer": example.answer, "demonstration": example.demonstration,
          "fields": dict(example.fields), "hint": example.hint}
    for key in ("messages", "tools", "chat_template_kwargs"):  # a chat row's parts (models/chat.py)
        if getattr(example, key) is not None:
            ex[key] = getattr(example, key)
    return {"example": ex, "prefix": prefix}


def item_example(item: dict) -> Example:
    """The example a queue item was made from."""
    return Example(**item["example"])


def take(queue: list[dict], settings: ProduceSettings) -> tuple[list[dict], list[dict]]:
    """The items this generation batch uses (oldest first) and the queue left."""
    n = min(len(queue), int(settings.rollout.params().share * settings.rollout.prompts_per_step))
    return queue[:n], queue[n:]


def push(
    queue: list[dict],
    examples: Sequence[Example],
    prefixes: Sequence[str],
    texts: Sequence[str],
    rewards_PG: Tensor,
    settings: ProduceSettings,
    step: int,
    batch: int,
) -> tuple[list[dict], int]:
    """Append the drawn prefixes of every eligible base group (module docstring); returns the new
    queue (capped at ``rollout.driver_params.capacity``, oldest dropped) and how many items were pushed.
    """
    r = settings.rollout.params()
    G = rewards_PG.shape[1]
    base = torch.tensor([not p for p in prefixes], dtype=torch.bool)
    eligible = selection.rest_partial_state_mask(
        rewards_PG, min_std=r.min_std, accept_threshold=r.accept
    )
    out, pushed = list(queue), 0
    for g in (eligible & base).nonzero().flatten().tolist():
        best = int(rewards_PG[g].argmax())  # the first of the best
        lines = selection.line_prefixes(texts[g * G + best], sep=r.separator)
        gen = torch.Generator().manual_seed(derive_seed(settings.seed, "rest", step, batch, g))
        ks = selection.rest_sample_prefixes(len(lines), generator=gen, alpha=r.alpha, ratio=r.ratio)
        for k in ks.tolist():
            out.append(as_item(examples[g], lines[k - 1]))
            pushed += 1
    return out[-r.capacity :], pushed
