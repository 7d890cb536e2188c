"""Rollout drivers: the ``produce`` phase of the loop, one registry entry per way of producing rollouts.

A driver turns the data stream into one scored generation batch: it draws P prompts at the data
cursor, has the engine sample G completions each, scores them with the reward components and
returns a :class:`Produced`. It holds no trainer state: what it reads is the
:class:`ProduceContext` (task, tokenizer, engine, sampling, rewards, config) and its own explicit
state (``None`` for stateless drivers), which it returns advanced; the loop keeps that state in the
checkpoint under the driver's name. Sampling is seeded from ``(seed, "sample", step, batch)``.

- ``single_turn``: sample and score.
- ``hint_reroll``: HINT (arXiv:2510.09388): all-wrong groups are sampled again with the example's
  hint and replace the originals (``produce/hint.py``).
- ``partial_states``: ReST-GRPO (arXiv:2508.19576): queued partial states (prompt + a prefix of an
  earlier good response) take the place of some stream prompts, and eligible groups queue new ones
  (``produce/partial_states.py``); the queue is the driver's state.
- ``external_mix``: RL-PLUS (arXiv:2508.00222): G - n_external samples and n_external copies of the
  example's demonstration per group (``produce/drivers_external.py``).
- ``multi_turn``: episodes in the task's environment (``task.name = "env"``), token in and token
  out (``rollout/multiturn.py``); the environment's episode reward is the ``task`` component, and
  the turn-level arrays ride along as ``Produced.turns``.

``rollout.driver`` names the driver and ``rollout.driver_params`` its options (typed in
``config.DRIVER_PARAMS``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry
from posttrain.config import Config
from posttrain.models.load import encode_chat
from posttrain.produce import partial_states as partial
from posttrain.produce.hint import hint_reroll as reroll
from posttrain.rewards import RewardPool, reward_fields, score_batch
from posttrain.rollout import Rollout, RolloutEngine, SamplingParams
from posttrain.rollout.multiturn import END_REASONS, EpisodeRecord, Turns, task_episodes
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example, Task


@dataclass
class ProduceContext:
    """What a driver may read: no model, optimizer or loop state, only the engine and the run's settings."""

    task: Task
    tokenizer: object
    engine: RolloutEngine
    sampling: SamplingParams
    rewards: list[tuple[str, dict]]  # (name, params) of each component
    weights_K: Tensor  # each component's weight
    cfg: Config
    pool: RewardPool | None = None
    reference: object | None = None  # ReferenceRewards (produce/ref_samples.py): PAR's / A*-PO's reference samples

    def score(self, examples: list[Example], comps: Rollout) -> tuple[Tensor, Tensor, Tensor, dict, list[dict]]:
        """:func:`score` with this run's components (unweighted ``[P, G, K]``)."""
        return score(self.rewards, self.task, examples, comps, self.cfg, self.pool)


@dataclass
class Produced:
    """One scored generation batch of P groups."""

    examples: list[Example]
    prompt_ids: list[list[int]]  # the prompt each group is trained on
    comps: Rollout  # the trained rows
    scored_texts: list[str]  # what the rewards read (a partial state's prefix + its continuation)
    rewards_PGK: Tensor  # each component times its weight, unshaped
    valid_PG: Tensor
    correct_PG: Tensor  # the task's verifier said correct
    rerolled_P: Tensor  # bool [P]: HINT re-rolled the group with its hint
    metrics: dict[str, float]
    failures: list[dict]  # reward calls that failed, with their samples
    consumed: int  # prompts taken from the data stream
    generate_s: float
    reward_s: float
    gen_tokens: int  # every sampled token, discarded ones included
    turns: Turns | None = None  # multi-turn episodes' turn-level arrays [P, G, K]
    external_PG: Tensor | None = None  # bool [P, G]: an external row (external_mix: the demonstration)


Driver = Callable[[ProduceContext, object, int, int, int], tuple[Produced, object]]
DRIVERS: Registry[Driver] = Registry("rollout driver")
register = DRIVERS.register


def produce(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Produced, object]:
    """One generation batch from the configured driver (``rollout.driver``); returns it and the
    driver's advanced state.
    """
    return DRIVERS.get(ctx.cfg.rollout.driver)(ctx, state, step, batch, cursor)


def sample_and_score(
    ctx: ProduceContext, examples: list[Example], prefixes: list[str], step: int, batch: int, consumed: int
) -> Produced:
    """Sample G completions for each example's chat prompt (+ its response prefix, if any) and score
    prefix + continuation with every reward component.
    """
    t0 = time.perf_counter()
    prompt_ids = [
        encode_chat(ctx.tokenizer, ex.prompt, ctx.cfg.task.system_prompt) + partial.prefix_ids(ctx.tokenizer, pre)
        for ex, pre in zip(examples, prefixes, strict=True)
    ]
    comps = ctx.engine.generate(prompt_ids, ctx.sampling, seed=derive_seed(ctx.cfg.seed, "sample", step, batch))
    scored = partial.with_prefixes(comps, prefixes)
    t1 = time.perf_counter()
    rewards_PGK, valid_PG, correct_PG, metrics, failures = ctx.score(examples, scored)
    return Produced(
        examples=examples,
        prompt_ids=prompt_ids,
        comps=comps,
        scored_texts=scored.texts,
        rewards_PGK=rewards_PGK * ctx.weights_K,
        valid_PG=valid_PG,
        correct_PG=correct_PG,
        rerolled_P=torch.zeros(len(examples), dtype=torch.bool),
        metrics=metrics,
        failures=failures,
        consumed=consumed,
        generate_s=t1 - t0,
        reward_s=time.perf_counter() - t1,
        gen_tokens=comps.num_tokens,
    )


@register("single_turn")
def single_turn(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Produced, object]:
    """P stream prompts, G samples each, scored. Stateless."""
    P = ctx.cfg.rollout.prompts_per_step
    examples = draw_prompts(ctx.task, P, ctx.cfg.seed, cursor)
    return sample_and_score(ctx, examples, [""] * P, step, batch, consumed=P), state


@register("hint_reroll")
def hint_reroll(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Produced, object]:
    """``single_turn``, then HINT's re-roll of the all-wrong groups that have a hint (``produce/hint.py``):
    ``accuracy`` and ``reward/<name>/*`` still describe the policy's own samples.
    """
    out, _ = single_turn(ctx, None, step, batch, cursor)
    t0 = time.perf_counter()
    re = reroll(ctx.cfg, ctx.tokenizer, ctx.engine, ctx.sampling, out.examples, out.prompt_ids, out.comps,
                out.rewards_PGK, out.valid_PG, out.correct_PG, ctx.score, ctx.weights_K, step, batch)
    spent = time.perf_counter() - t0
    return replace(
        out, comps=re.comps, scored_texts=re.comps.texts, rewards_PGK=re.rewards_PGK, valid_PG=re.valid_PG,
        correct_PG=re.correct_PG, prompt_ids=re.train_ids, rerolled_P=re.rerolled_P, metrics=out.metrics | re.metrics,
        failures=out.failures + re.failures, generate_s=out.generate_s + re.generate_s,
        reward_s=out.reward_s + spent - re.generate_s, gen_tokens=out.gen_tokens + re.discarded_tokens,
    ), state


@register("partial_states")
def partial_states(
    ctx: ProduceContext, state: object, step: int, batch: int, cursor: int
) -> tuple[Produced, object]:
    """ReST-GRPO: queued partial states replace up to ``share`` of the stream prompts; eligible base
    groups queue prefixes of their best response (``produce/partial_states.py``). State: the queue (a list
    of plain dicts, checkpointable).
    """
    P = ctx.cfg.rollout.prompts_per_step
    taken, queue = partial.take(list(state or []), ctx.cfg)
    n_stream = P - len(taken)
    stream = draw_prompts(ctx.task, n_stream, ctx.cfg.seed, cursor) if n_stream else []
    examples = [*stream, *(partial.item_example(it) for it in taken)]
    prefixes = [""] * n_stream + [it["prefix"] for it in taken]
    out = sample_and_score(ctx, examples, prefixes, step, batch, consumed=n_stream)
    queue, pushed = partial.push(queue, examples, prefixes, out.scored_texts, out.rewards_PGK.sum(-1), ctx.cfg,
                                 step, batch)
    out.metrics |= {
        "selection/partial_groups": float(len(taken)),
        "selection/partial_pushed": float(pushed),
        "selection/partial_queue": float(len(queue)),
    }
    return out, queue


@register("multi_turn")
def multi_turn(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Produced, object]:
    """P environment problems, G episodes each, run to their ends (``rollout/multiturn.py``) and
    scored by the environment. Stateless.
    """
    P, G, task = ctx.cfg.rollout.prompts_per_step, ctx.sampling.n, ctx.task
    examples = draw_prompts(task, P, ctx.cfg.seed, cursor)
    t0 = time.perf_counter()
    recs, comps, turns = task_episodes(ctx.engine, ctx.tokenizer, task, examples, ctx.sampling,
                                       lambda rnd: derive_seed(ctx.cfg.seed, "sample", step, batch, rnd))
    reward_N = torch.tensor([math.nan if r.reward is None else r.reward for r in recs])
    missing = reward_N.isnan()
    valid = ~missing if ctx.cfg.scoring.on_error == "mask" else torch.ones(len(recs), dtype=torch.bool)
    success = torch.tensor([r.success for r in recs])
    failures = [{"reward": "task", "index": n, "status": r.end, "message": r.error or "", "prompt":
                 examples[n // G].prompt, "completion": comps.texts[n]} for n, r in enumerate(recs) if r.reward is None]
    metrics = {"accuracy": float(success.mean()), "reward/task/mean": float(reward_N.nan_to_num(0.0).mean()),
               "reward/task/errors": float(sum(r.end == "error" for r in recs)), "reward/task/nonfinite": 0.0,
               "reward/task/timeouts": float(sum(r.end == "timeout" for r in recs)),
               "reward/invalid_frac": float(missing.float().mean()), **episode_metrics(recs)}
    return Produced(
        examples=examples, prompt_ids=comps.prompt_ids, comps=comps, scored_texts=comps.texts,
        rewards_PGK=reward_N.nan_to_num(0.0).view(P, G, 1) * ctx.weights_K, valid_PG=valid.view(P, G),
        correct_PG=(success > 0.5).view(P, G), rerolled_P=torch.zeros(P, dtype=torch.bool), metrics=metrics,
        failures=failures, consumed=P, generate_s=time.perf_counter() - t0, reward_s=0.0,
        gen_tokens=int(comps.loss_mask.sum()), turns=turns,
    ), state


def episode_metrics(recs: list[EpisodeRecord]) -> dict[str, float]:
    """``episode/turns_mean``, ``episode/success``, ``episode/end_reason/*`` (shares) and ``tools/*``
    (calls, errors, timeouts per episode), ``episode/format_errors`` (per episode).
    """
    n = max(len(recs), 1)
    out = {"episode/turns_mean": sum(len(r.turns) for r in recs) / n,
           "episode/success": sum(r.success for r in recs) / n}
    out |= {f"episode/end_reason/{e}": sum(r.end == e for r in recs) / n for e in END_REASONS}
    for key, name in (("tool_calls", "tools/calls"), ("tool_errors", "tools/errors"),
                      ("tool_timeouts", "tools/timeouts"), ("format_errors", "episode/format_errors")):
        out[name] = sum(r.info.get(key, 0.0) for r in recs) / n
    return out


def draw_prompts(task: Task, n: int, seed: int, start: int) -> list[Example]:
    """The next ``n`` training prompts at data cursor ``start``.

    A dataset (a task with ``stream``) is read epoch by epoch: every training prompt once per
    epoch, in an order shuffled per epoch by the run's seed, position = the cursor, so a resumed
    run continues the same sequence. A built-in task draws a fresh seeded sample each time.
    """
    stream = getattr(task, "stream", None)
    if stream is not None:
        return stream("train", start, n, derive_seed(seed, "data"))
    return task.examples("train", n, seed=derive_seed(seed, "data", start))


def score(
    rewards: list[tuple[str, dict]],
    task: Task,
    examples: list[Example],
    comps: Rollout,
    cfg: Config,
    pool: RewardPool | None = None,
) -> tuple[Tensor, Tensor, Tensor, dict[str, float], list[dict]]:
    """Score every completion with every reward component (in ``pool``'s workers when given).

    Returns rewards ``[P, G, K]``, a validity mask ``[P, G]``, the verifier's verdicts ``[P, G]``,
    per-component metrics and the failed calls. ``None`` scores become 0, or mask the sample out
    of the update, as ``scoring.on_error`` says. ``accuracy`` is the task's verifier, scored in
    the same protected way (reusing a plain ``task`` component when the recipe has one).
    """
    G = comps.n
    rows = [ex for ex in examples for _ in range(G)]
    fields = [reward_fields(ex, task) for ex in rows]
    fns = list(rewards)
    acc_k = next((k for k, (name, params) in enumerate(fns) if name == "task" and not params), None)
    if acc_k is None:
        fns.append(("task", {}))
        acc_k = len(fns) - 1
    report = score_batch(fns, [ex.prompt for ex in rows], comps.texts, fields, pool=pool)
    P, K = len(examples), len(rewards)
    values = torch.tensor([[math.nan if v is None else v for v in col] for col in report.values]).T  # [N, K+]
    accuracy = values[:, acc_k].nan_to_num(0.0)
    values = values[:, :K]
    missing = values.isnan()
    valid_N = ~missing.any(1) if cfg.scoring.on_error == "mask" else torch.ones(len(rows), dtype=torch.bool)
    values = values.nan_to_num(0.0)
    metrics: dict[str, float] = {"accuracy": float(accuracy.mean())}
    for k, (name, _) in enumerate(rewards):
        metrics[f"reward/{name}/mean"] = float(values[:, k].mean())
        metrics[f"reward/{name}/errors"] = float(report.errors[k])
        metrics[f"reward/{name}/nonfinite"] = float(report.nonfinite[k])
        metrics[f"reward/{name}/timeouts"] = float(report.timeouts[k])
    metrics["reward/invalid_frac"] = float(missing.any(1).float().mean())
    correct = (accuracy > 0.5).view(P, G)
    return values.view(P, G, -1), valid_N.view(P, G), correct, metrics, report.failures


# drivers kept in their own modules register into DRIVERS on import (after it and the helpers exist)
from posttrain.produce import drivers_external  # noqa: E402, F401
