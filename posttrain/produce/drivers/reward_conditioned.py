"""The ``reward_conditioned`` rollout driver: each sample of a group is conditioned on a reward token.

RC-GRPO (reward-conditioned GRPO, arXiv:2602.03025; catalog L185). A group whose G samples all earn the same
reward has no GRPO advantage and teaches nothing; RC-GRPO keeps a spread inside the group by conditioning
each sample on a reward token, ``<|high_reward|>`` or ``<|low_reward|>``, chosen per sample slot, from a
policy that learned what the tokens mean (stage 1: SFT of a reward-conditioned trajectory policy on
mixed-quality trajectories, each with its token). Stage 2 is plain GRPO on such groups: the advantages are the
usual group-normalized ones, ``A_i = (r_i - mean(r)) / std(r)``; the catalog's example, tokens ``[H, H, L, L]``
earning ``[1, 1, 0, 1]``, gives ``[0.5, 0.5, -1.5, 0.5]`` where the same prompt unconditioned might earn
``[1, 1, 1, 1]`` and an all-zero advantage. Evaluation conditions on the high token.

Here the engine samples ``counts[j]`` completions of each prompt after token ``tokens[j]`` (default: G split
as evenly as possible, in token order: ``[H, H, L, L]`` for G = 4), and group p is the concatenation of those
parts. Where the token goes: a group shares one prompt in a :class:`~posttrain.rollout.Rollout`, so the token
opens the assistant's turn instead of ending the user's, i.e. it is the first completion tokens of its row,
attended to and never trained on (loss mask 0, behaviour log-prob 0, turn id -1, not in the text the rewards
read). The policy's log-probs of the sampled tokens are so conditioned on the token exactly as the sampler
was. A stage-1 SFT set for this placement puts the token at the start of each demonstration.

``selection/rc_reward_<j>``: the mean reward of the samples after token j (what the conditioning moves).
Options: ``rollout.driver_params`` (:class:`RewardConditionedParams`). Stateless.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from pydantic import Field
from torch import Tensor

from posttrain.config.base import Section
from posttrain.errors import ConfigError
from posttrain.models.chat import encode_example
from posttrain.produce.batch import Batch
from posttrain.produce.drivers.registry import ProduceContext, draw_prompts, register
from posttrain.rollout import Rollout
from posttrain.rollout.batch import join_groups
from posttrain.seeds import derive_seed

if TYPE_CHECKING:
    from posttrain.config import ProduceSettings


class RewardConditionedParams(Section):
    """``rollout.driver = "reward_conditioned"`` (RC-GRPO, arXiv:2602.03025): each sample slot of a group is
    conditioned on one of ``tokens``, ``counts`` slots each (posttrain/produce/drivers/reward_conditioned.py).
    """

    tokens: list[str] = Field(["<|high_reward|>", "<|low_reward|>"], min_length=1,
                              description="the reward tokens, highest first; each opens its samples' response")
    counts: list[int] | None = Field(None, description="samples of each token per group (sums to "
                                     "rollout.group_size); default: the group split evenly, in token order")


def slot_counts(tokens: list[str], counts: list[int] | None, G: int) -> list[int]:
    """How many of a group's G samples follow each token: ``counts``, or G spread evenly (the first tokens
    take the remainder): 4 over 2 tokens -> [2, 2]; 5 over 2 -> [3, 2].
    """
    if counts is not None:
        return list(counts)
    base, extra = divmod(G, len(tokens))
    return [base + (j < extra) for j in range(len(tokens))]


def counts_fit(settings: ProduceSettings) -> None:
    """Distinct, non-empty tokens; ``counts`` one per token, each >= 0, summing to the group size."""
    p, G = settings.rollout.params(), settings.rollout.group_size
    if any(not t for t in p.tokens) or len(set(p.tokens)) != len(p.tokens):
        raise ValueError(f"rollout.driver_params.tokens: {p.tokens} must be distinct, non-empty strings")
    if p.counts is not None and (len(p.counts) != len(p.tokens) or min(p.counts) < 0 or sum(p.counts) != G):
        raise ValueError(f"rollout.driver_params.counts: {p.counts} must give one count >= 0 per token "
                         f"({len(p.tokens)}) summing to rollout.group_size = {G}")
    if p.counts is None and G < len(p.tokens):
        raise ValueError(f"rollout.group_size: {G} samples cannot follow each of the {len(p.tokens)} reward "
                         "tokens; use a larger group or fewer tokens")


def tokens_fit(settings: ProduceSettings, task: object, tokenizer: object, longest: int, max_positions: int) -> None:
    """The longest prompt, its longest reward token and ``rollout.max_new_tokens`` fit the model's context."""
    r = settings.rollout
    most = max(len(token_ids(tokenizer, t)) for t in r.params().tokens)
    if longest + most + r.max_new_tokens > max_positions:
        raise ConfigError(
            f"rollout.driver = 'reward_conditioned': prompts of task {settings.task.name!r} take up to {longest} "
            f"tokens, a reward token up to {most} more; with rollout.max_new_tokens={r.max_new_tokens} that exceeds "
            f"the model's context of {max_positions} tokens: shorten rollout.driver_params.tokens or "
            "rollout.max_new_tokens"
        )


def token_ids(tokenizer: object, token: str) -> list[int]:
    """The token's ids as they follow the generation prompt (no special tokens added)."""
    return list(tokenizer(token, add_special_tokens=False)["input_ids"])


def opened_by(part: Rollout, ids: list[int]) -> Rollout:
    """``part`` with ``ids`` prepended to every row's completion as context: attended, never trained on."""
    N, k = part.token_ids.shape[0], len(ids)

    def lead(x: Tensor, value: float) -> Tensor:
        return torch.cat([torch.full((N, k), value, dtype=x.dtype), x], dim=1)

    return replace(part, token_ids=torch.cat([torch.tensor([ids] * N, dtype=torch.long).view(N, k), part.token_ids],
                                             dim=1),
                   attention_mask=lead(part.attention_mask, 1.0), loss_mask=lead(part.loss_mask, 0.0),
                   behaviour_logprobs=lead(part.behaviour_logprobs, 0.0), turn_ids=lead(part.turn_ids, -1))


@register("reward_conditioned", options=RewardConditionedParams, check=counts_fit, fits=tokens_fit)
def reward_conditioned(ctx: ProduceContext, state: object, step: int, batch: int,
                       cursor: int) -> tuple[Batch, object]:
    """P stream prompts; in each group ``counts[j]`` samples after reward token j (module docstring), scored.
    Stateless. Seed: RC-GRPO, ``papers/004_f298e9ec572f7f27.txt:185``.
    """
    s = ctx.settings
    opts, P = s.rollout.params(), s.rollout.prompts_per_step
    examples = draw_prompts(ctx.task, P, s.seed, cursor)
    t0 = time.perf_counter()
    prompt_ids = [encode_example(ctx.tokenizer, ex, s.task.system_prompt) for ex in examples]
    parts, slots = [], []
    for j, (token, n) in enumerate(zip(opts.tokens, slot_counts(opts.tokens, opts.counts, ctx.sampling.n),
                                       strict=True)):
        if n == 0:
            continue
        ids = token_ids(ctx.tokenizer, token)
        got = ctx.engine.generate([p + ids for p in prompt_ids], replace(ctx.sampling, n=n),
                                  seed=derive_seed(s.seed, "sample", step, batch, j))
        parts.append(opened_by(got, ids))
        slots += [j] * n
    rollouts = join_groups(parts, ctx.engine.pad_id, prompt_ids)  # the bare prompts
    t1 = time.perf_counter()
    rewards_PGK, valid_PG, correct_PG, metrics, failures = ctx.score(examples, rollouts)
    rewards_PG, slot_G = (rewards_PGK * ctx.weights_K).sum(-1), torch.tensor(slots)
    metrics = metrics | {f"selection/rc_reward_{j}": float(rewards_PG[:, slot_G == j].mean())
                         for j in sorted(set(slots))}
    return Batch(examples=examples, prompt_ids=prompt_ids, rollouts=rollouts, scored_texts=rollouts.texts,
                 rewards_PGK=rewards_PGK * ctx.weights_K, valid_PG=valid_PG, correct_PG=correct_PG,
                 rerolled_P=torch.zeros(P, dtype=torch.bool), metrics=metrics, failures=failures, consumed=P,
                 generate_s=t1 - t0, reward_s=time.perf_counter() - t1,
                 gen_tokens=int(rollouts.loss_mask.sum())), state  # sampled tokens, not the reward tokens
