"""Steps 1-3 of the loop: produce (the rollout driver: prompts -> rollouts -> rewards), then shape and
filter, into a training batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from posttrain.produce.drivers import ProduceContext, Produced, draw_prompts, produce, score
from posttrain.rewards import RewardPool, reward_fields, score_batch
from posttrain.rewards.steps import score_steps
from posttrain.rollout import Rollout, concat_rollouts
from posttrain.rollout.multiturn import Turns
from posttrain.run.parts import Parts
from posttrain.tasks.base import Example, Task

__all__ = ["Batch", "collect", "draw_prompts", "reference_rewards", "score", "shape", "shape_rewards", "step_rewards"]


@dataclass
class Batch:
    """One step's training batch: P kept groups and what it took to collect them."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    comps: Rollout
    rewards_PG: Tensor  # the weighted sum of the components, shaped
    rewards_PGK: Tensor  # each component times its weight, unshaped
    valid_PG: Tensor
    correct_PG: Tensor  # the task's verifier said correct (accuracy), for the group diagnostics
    rerolled_P: Tensor  # bool [P]: HINT re-rolled the group with its hint
    driver_state: object  # the rollout driver's state after this step (ReST-GRPO's queue; None: stateless)
    metrics: dict[str, float]
    failures: list[dict]  # reward calls that failed (error, timeout, crash, NaN), with their samples
    consumed: int  # prompts taken from the data stream
    generate_s: float
    reward_s: float
    gen_tokens: int
    turns: Turns | None = None  # multi-turn episodes' turn-level arrays [P, G, K] (rollout/multiturn.py)
    external_PG: Tensor | None = None  # bool [P, G]: an external row (the external_mix driver's demonstrations)


def collect(
    ctx: ProduceContext,
    parts: Parts,
    step: int,
    cursor: int,
    shaper_states: list[object | None] | None = None,
    driver_state: object = None,
) -> Batch:
    """Produce (the rollout driver), then shape and filter, until ``prompts_per_step`` groups pass the
    group filter or ``rollout.max_gen_batches`` generation batches are spent.

    With the default filter (``none``) this is one generation batch. With ``dynamic_sampling`` and
    ``max_gen_batches > 1`` it is DAPO's dynamic sampling (arXiv:2503.14476): groups whose rewards
    are all equal carry no signal and are replaced by fresh ones. Prompts are a deterministic
    function of the data cursor and sampling of ``(seed, step, batch)``, so resume replays nothing.
    Metrics describe every generated sample (the policy), not only the kept ones, averaged over the
    generation batches; ``reward/mean`` the groups that go on (a driver's re-rolled ones included).
    """
    cfg = ctx.cfg
    P = cfg.rollout.prompts_per_step
    kept: list[tuple[Produced, list[int], Tensor]] = []
    all_metrics, failures = [], []
    consumed, gen_s, reward_s, gen_tokens, n_batches, n_groups, n_kept = 0, 0.0, 0.0, 0, 0, 0, 0
    while n_kept < P and n_batches < cfg.rollout.max_gen_batches:
        out, driver_state = produce(ctx, driver_state, step, n_batches, cursor + consumed)
        t1 = time.perf_counter()
        rewards_PG = shape(ctx, parts, out, shaper_states)
        valid = rewards_PG[out.valid_PG]
        out.metrics["reward/mean"] = float(valid.mean()) if valid.numel() else float("nan")
        out.metrics["reward/std"] = float(valid.std()) if valid.numel() > 1 else 0.0
        keep = parts.group_filter(rewards_PG).tolist()
        reward_s += out.reward_s + time.perf_counter() - t1
        gen_s += out.generate_s
        consumed += out.consumed
        n_batches += 1
        n_groups += P
        gen_tokens += out.gen_tokens
        failures += out.failures
        all_metrics.append(out.metrics)
        groups = [g for g in range(P) if keep[g]][: P - n_kept]
        if not groups and n_batches == cfg.rollout.max_gen_batches and not kept:
            groups = list(range(P))  # nothing passed: train on nothing
            out = replace(out, valid_PG=torch.zeros_like(out.valid_PG))
        kept.append((out, groups, rewards_PG))
        n_kept += len(groups)
    metrics = {k: sum(m.get(k, 0.0) for m in all_metrics) / len(all_metrics) for k in all_metrics[0]}
    metrics["selection/gen_batches"] = float(n_batches)
    metrics["selection/kept_groups"] = float(n_kept)
    metrics["selection/kept_frac"] = n_kept / n_groups
    if hasattr(ctx.task, "pools"):  # a dataset: how far through it the stream is
        metrics["data/epoch"] = (cursor + consumed) / max(len(ctx.task.pools["train"]), 1)

    def cat(get: Callable[[Produced, list[int], Tensor], Tensor]) -> Tensor:
        return torch.cat([get(*k) for k in kept])

    return Batch(
        examples=[o.examples[g] for o, gs, _ in kept for g in gs],
        prompt_ids=[o.prompt_ids[g] for o, gs, _ in kept for g in gs],
        comps=concat_rollouts([o.comps.select_groups(gs) for o, gs, _ in kept], ctx.engine.pad_id),
        rewards_PG=cat(lambda o, gs, r: r[gs]),
        rewards_PGK=cat(lambda o, gs, r: o.rewards_PGK[gs]),
        valid_PG=cat(lambda o, gs, r: o.valid_PG[gs]),
        correct_PG=cat(lambda o, gs, r: o.correct_PG[gs]),
        rerolled_P=cat(lambda o, gs, r: o.rerolled_P[gs]),
        driver_state=driver_state,
        metrics=metrics,
        failures=failures,
        consumed=consumed,
        generate_s=gen_s,
        reward_s=reward_s,
        gen_tokens=gen_tokens,
        turns=Turns.cat([o.turns.select(gs) for o, gs, _ in kept]) if kept[0][0].turns is not None else None,
        external_PG=cat(lambda o, gs, r: o.external_PG[gs]) if kept[0][0].external_PG is not None else None,
    )


def shape(ctx: ProduceContext, parts: Parts, out: Produced, shaper_states: list[object | None] | None) -> Tensor:
    """The summed rewards ``[P, G]`` of a generation batch through the configured shapers
    (:func:`shape_rewards` on what the rewards read: a partial state's prefix + its continuation).
    """
    scored = replace(out.comps, texts=out.scored_texts)
    return shape_rewards(ctx, parts, out.examples, scored, out.rewards_PGK.sum(-1), out.metrics, shaper_states)


def shape_rewards(
    ctx: ProduceContext,
    parts: Parts,
    examples: list[Example],
    scored: Rollout,
    rewards_PG: Tensor,
    metrics: dict[str, float],
    shaper_states: list[object | None] | None,
) -> Tensor:
    """``rewards_PG`` (the weighted sum of the components) through the configured shapers, in order,
    with the inputs they read from ``scored`` (the responses' own lengths; the step scorer's step
    rewards, which add their metrics to ``metrics``) and from the prompts (PAR's reference rewards).

    ReMax's greedy baseline ``[P, 1]`` goes through here too (``prepare/providers.py``), so a sample and
    the greedy response are rewarded by one definition.
    """
    P = rewards_PG.shape[0]
    lengths_PG = scored.lengths.view(P, -1).float()
    ref_P1 = None
    if parts.needs_ref_rewards:  # PAR's references: M sampled from the reference policy, or the demonstration
        ref_P1 = ctx.reference(examples, parts.par_samples) if parts.par_samples else \
            reference_rewards(ctx.rewards, ctx.weights_K, ctx.task, examples, ctx.pool)
    steps = step_rewards(parts.step_reward, ctx.task, examples, scored, metrics) if parts.step_reward else {}
    for shaper, st in zip(parts.shapers, shaper_states or [None] * len(parts.shapers), strict=True):
        rewards_PG = shaper(rewards_PG, lengths=lengths_PG, ref_rewards=ref_P1, state=st, **steps)
    return rewards_PG


def step_rewards(
    scorer: tuple[str, dict],
    task: Task,
    examples: list[Example],
    comps: Rollout,
    metrics: dict[str, float],
) -> dict[str, Tensor]:
    """The process-reward shapers' inputs: ``step_rewards`` and ``step_mask``, ``[P, G, K]``, from the
    step scorer ``(name, params)`` (``algorithm.step_reward``; ``posttrain/rewards/steps.py``).

    Adds ``step_reward/mean`` (over every scored step), ``step_reward/steps_mean`` (steps per
    response) and ``step_reward/errors`` (responses whose scorer failed) to ``metrics``.
    """
    name, params = scorer
    G = comps.n
    rows = [ex for ex in examples for _ in range(G)]
    fields = [reward_fields(ex, task) for ex in rows]
    values_NK, mask_NK, errors = score_steps(name, params, [ex.prompt for ex in rows], comps.texts, fields)
    n_steps = mask_NK.sum()
    metrics["step_reward/mean"] = float((values_NK * mask_NK).sum() / n_steps) if n_steps else float("nan")
    metrics["step_reward/steps_mean"] = float(mask_NK.sum(-1).mean())
    metrics["step_reward/errors"] = float(errors)
    P = len(examples)
    return {"step_rewards": values_NK.view(P, G, -1), "step_mask": mask_NK.view(P, G, -1)}


def reference_rewards(
    rewards: list[tuple[str, dict]],
    weights_K: Tensor,
    task: Task,
    examples: list[Example],
    pool: RewardPool | None,
) -> Tensor:
    """The weighted reward of each prompt's reference response (its demonstration), ``[P, 1]``.

    What PAR (arXiv:2502.18770) centres the policy's rewards on: with a reward model as the
    reward, the RM's score of the SFT reference. A reference that cannot be scored counts 0.
    """
    fields = [reward_fields(ex, task) for ex in examples]
    report = score_batch(rewards, [ex.prompt for ex in examples], [ex.demonstration for ex in examples], fields,
                         pool=pool)
    values = torch.tensor([[0.0 if v is None else v for v in col] for col in report.values]).T  # [P, K]
    return (values * weights_K).sum(-1, keepdim=True)
