"""Steps 1-3 of the loop: produce (the rollout driver: prompts -> rollouts -> rewards), then shape and
filter, into a training batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import Tensor

from posttrain.produce.batch import Batch
from posttrain.produce.drivers import ProduceContext, draw_prompts, produce, score
from posttrain.produce.parts import ProduceParts
from posttrain.rewards import RewardPool, reward_fields, score_batch
from posttrain.rewards.steps import score_steps
from posttrain.rollout import Rollout
from posttrain.tasks.base import Example, Task

__all__ = ["SAMPLED_INPUTS", "collect", "draw_prompts", "greedy_baseline", "reference_rewards",
           "sample_inputs", "score", "shape", "shape_rewards", "step_rewards"]


def collect(
    ctx: ProduceContext,
    parts: ProduceParts,
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
    settings = ctx.settings
    P = settings.rollout.prompts_per_step
    kept: list[Batch] = []  # each generation batch's kept groups (none, some or all)
    consumed, n_batches, n_kept = 0, 0, 0
    while n_kept < P and n_batches < settings.rollout.max_gen_batches:
        out, driver_state = produce(ctx, driver_state, step, n_batches, cursor + consumed)
        t1 = time.perf_counter()
        out.rewards_PG = shape(ctx, parts, out, shaper_states)
        valid = out.rewards_PG[out.valid_PG]
        out.metrics["reward/mean"] = float(valid.mean()) if valid.numel() else float("nan")
        out.metrics["reward/std"] = float(valid.std()) if valid.numel() > 1 else 0.0
        keep = parts.group_filter(out.rewards_PG).tolist()
        out.reward_s += time.perf_counter() - t1  # + shaping and the group filter
        out.driver_state = driver_state
        consumed += out.consumed
        n_batches += 1
        groups = [g for g in range(P) if keep[g]][: P - n_kept]
        if not groups and n_batches == settings.rollout.max_gen_batches and not n_kept:
            groups = list(range(P))  # nothing passed in any generation batch: train on nothing
            out = replace(out, valid_PG=torch.zeros_like(out.valid_PG))
        kept.append(out.select_groups(groups))
        n_kept += len(groups)
    batch = Batch.cat(kept, ctx.engine.pad_id)  # what it took adds up over every generation batch
    batch.metrics["selection/gen_batches"] = float(n_batches)
    batch.metrics["selection/kept_groups"] = float(n_kept)
    batch.metrics["selection/kept_frac"] = n_kept / (n_batches * P)
    if hasattr(ctx.task, "pools"):  # a dataset: how far through it the stream is
        batch.metrics["data/epoch"] = (cursor + consumed) / max(len(ctx.task.pools["train"]), 1)
    return sample_inputs(ctx, parts, batch)


def shape(ctx: ProduceContext, parts: ProduceParts, out: Batch, shaper_states: list[object | None] | None) -> Tensor:
    """The summed rewards ``[P, G]`` of a generation batch through the configured shapers
    (:func:`shape_rewards` on what the rewards read: a partial state's prefix + its continuation).
    """
    scored = replace(out.rollouts, texts=out.scored_texts)
    return shape_rewards(ctx, parts, out.examples, scored, out.rewards_PGK.sum(-1), out.metrics, shaper_states)


def shape_rewards(
    ctx: ProduceContext,
    parts: ProduceParts,
    examples: list[Example],
    scored: Rollout,
    rewards_PG: Tensor,
    metrics: dict[str, float],
    shaper_states: list[object | None] | None,
) -> Tensor:
    """``rewards_PG`` (the weighted sum of the components) through the configured shapers, in order,
    with the inputs they read from ``scored`` (the responses' own lengths; the step scorer's step
    rewards, which add their metrics to ``metrics``) and from the prompts (PAR's reference rewards).

    ReMax's greedy baseline ``[P, 1]`` goes through here too (:func:`greedy_baseline`), so a sample and
    the greedy response are rewarded by one definition.
    """
    P = rewards_PG.shape[0]
    lengths_PG = scored.lengths.view(P, -1).float()
    ref_P1 = None
    if parts.needs_ref_rewards:  # PAR's references: M sampled from the reference policy, or the demonstration
        ref_P1 = ctx.reference(examples, parts.ref_reward_samples) if parts.ref_reward_samples else \
            reference_rewards(ctx.rewards, ctx.weights_K, ctx.task, examples, ctx.pool)
    steps = step_rewards(parts.step_reward, ctx.task, examples, scored, metrics) if parts.step_reward else {}
    for shaper, st in zip(parts.shapers, shaper_states or [None] * len(parts.shapers), strict=True):
        rewards_PG = shaper(rewards_PG, lengths=lengths_PG, ref_rewards=ref_P1, state=st, **steps)
    return rewards_PG


def step_rewards(
    scorer: tuple[str, dict],
    task: Task,
    examples: list[Example],
    rollouts: Rollout,
    metrics: dict[str, float],
) -> dict[str, Tensor]:
    """The process-reward shapers' inputs: ``step_rewards`` and ``step_mask``, ``[P, G, K]``, from the
    step scorer ``(name, params)`` (``algorithm.step_reward``; ``posttrain/rewards/steps.py``).

    Adds ``step_reward/mean`` (over every scored step), ``step_reward/steps_mean`` (steps per
    response) and ``step_reward/errors`` (responses whose scorer failed) to ``metrics``.
    """
    name, params = scorer
    G = rollouts.n
    rows = [ex for ex in examples for _ in range(G)]
    fields = [reward_fields(ex, task) for ex in rows]
    values_NK, mask_NK, errors = score_steps(name, params, [ex.prompt for ex in rows], rollouts.texts, fields)
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


SampledInput = Callable[[ProduceContext, ProduceParts, Batch], tuple[Tensor, list[dict]]]


def greedy_baseline(ctx: ProduceContext, parts: ProduceParts, batch: Batch) -> tuple[Tensor, list[dict]]:
    """ReMax's baseline, ``[P]``, and the reward calls that failed: the reward of each prompt's greedy response,
    sampled by the engine that sampled the batch (the same policy) and rewarded like the samples: scored,
    weighted, summed, then through the run's shapers with its own inputs (its length, its step rewards, its
    prompt's references; :func:`shape_rewards`). The config admits only shapers that shape one response on
    its own (``shaping.baseline_unshapable``), so it passes no state.
    """
    greedy = ctx.engine.generate(batch.prompt_ids, replace(ctx.sampling, n=1, temperature=0.0))
    base_PK, _, _, _, failed = ctx.score(batch.examples, greedy)
    raw_P1 = (base_PK * ctx.weights_K).sum(-1)
    return shape_rewards(ctx, parts, batch.examples, greedy, raw_P1, {}, None)[:, 0], failed


def reference_samples(ctx: ProduceContext, parts: ProduceParts, batch: Batch) -> tuple[Tensor, list[dict]]:
    """The rewards of M responses per prompt sampled from the frozen reference policy, ``[P, M]``
    (``produce/ref_samples.py``, sampled once per prompt; A*-PO's V* reads them), M = ``ProduceParts.ref_samples``.
    """
    assert ctx.reference is not None, "reference_rewards need the reference sampler (the loop builds it)"
    return ctx.reference(batch.examples, parts.ref_samples), []


# The advantage inputs that are sampled (a model generates, the rewards score): the produce phase makes them
# for a batch when the run's estimator requires them (ProduceParts.inputs), and prepare's providers read them off it.
SAMPLED_INPUTS: dict[str, SampledInput] = {"baseline_rewards": greedy_baseline, "reference_rewards": reference_samples}


def sample_inputs(ctx: ProduceContext, parts: ProduceParts, batch: Batch) -> Batch:
    """``batch`` with the :data:`SAMPLED_INPUTS` the run's estimator requires (``ProduceParts.inputs``), by name,
    in ``Batch.sampled_inputs``; the reward calls they made that failed join ``Batch.failures``.
    """
    got, failures = {}, []
    for name in (n for n in parts.inputs if n in SAMPLED_INPUTS):
        got[name], failed = SAMPLED_INPUTS[name](ctx, parts, batch)
        failures += failed
    return replace(batch, sampled_inputs=got, failures=batch.failures + failures) if got else batch
