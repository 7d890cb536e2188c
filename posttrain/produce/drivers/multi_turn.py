"""The ``multi_turn`` rollout driver: episodes in the task's environment (``task.name = "env"``).

P environment problems, G episodes each, token in and token out (``rollout/multiturn.py``), run to
their ends and scored by the environment: its episode reward is the ``task`` component, ``accuracy``
its success, and the turn-level arrays ride along as ``Batch.turns``. Stateless.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

import torch

from posttrain.produce.batch import Batch
from posttrain.produce.drivers.registry import ProduceContext, draw_prompts, register
from posttrain.rollout.multiturn import END_REASONS, EpisodeRecord, task_episodes
from posttrain.seeds import derive_seed

if TYPE_CHECKING:
    from posttrain.config import ProduceSettings


def whole_episodes(settings: ProduceSettings) -> None:
    """An episode is sampled by one policy: ``rollout.on_new_weights`` must finish it (no cut between turns)."""
    if settings.rollout.on_new_weights != "finish":
        raise ValueError(f"rollout.on_new_weights = '{settings.rollout.on_new_weights}' does not run with the "
                         "multi_turn driver (an episode cut between turns would span two policies); use "
                         "rollout.on_new_weights = 'finish' there (resubmit and continue run with the other drivers)")


@register("multi_turn", episodes=True, check=whole_episodes, replayable=False,
          note="a multi-turn episode's rows carry turn masks and turn ids")
def multi_turn(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Batch, object]:
    """P environment problems, G episodes each, run to their ends (``rollout/multiturn.py``) and
    scored by the environment. Stateless.
    """
    P, G, task = ctx.settings.rollout.prompts_per_step, ctx.sampling.n, ctx.task
    examples = draw_prompts(task, P, ctx.settings.seed, cursor)
    t0 = time.perf_counter()
    recs, rollouts, turns = task_episodes(ctx.engine, ctx.tokenizer, task, examples, ctx.sampling,
                                       lambda rnd: derive_seed(ctx.settings.seed, "sample", step, batch, rnd))
    reward_N = torch.tensor([math.nan if r.reward is None else r.reward for r in recs])
    missing = reward_N.isnan()
    valid = ~missing if ctx.settings.scoring.on_error == "mask" else torch.ones(len(recs), dtype=torch.bool)
    success = torch.tensor([r.success for r in recs])
    failures = [{"reward": "task", "index": n, "status": r.end, "message": r.error or "", "prompt":
                 examples[n // G].prompt,
                 "completion": rollouts.texts[n]} for n, r in enumerate(recs) if r.reward is None]
    metrics = {"accuracy": float(success.mean()), "reward/task/mean": float(reward_N.nan_to_num(0.0).mean()),
               "reward/task/errors": float(sum(r.end == "error" for r in recs)), "reward/task/nonfinite": 0.0,
               "reward/task/timeouts": float(sum(r.end == "timeout" for r in recs)),
               "reward/invalid_frac": float(missing.float().mean()), **episode_metrics(recs)}
    return Batch(
        examples=examples, prompt_ids=rollouts.prompt_ids, rollouts=rollouts, scored_texts=rollouts.texts,
        rewards_PGK=reward_N.nan_to_num(0.0).view(P, G, 1) * ctx.weights_K, valid_PG=valid.view(P, G),
        correct_PG=(success > 0.5).view(P, G), rerolled_P=torch.zeros(P, dtype=torch.bool), metrics=metrics,
        failures=failures, consumed=P, generate_s=time.perf_counter() - t0, reward_s=0.0,
        gen_tokens=int(rollouts.loss_mask.sum()), turns=turns,
    ), state


def episode_metrics(recs: list[EpisodeRecord]) -> dict[str, float]:
    """``episode/turns_mean``, ``episode/success``, ``episode/end_reason/*`` (shares) and ``tools/*``
    (calls, errors, timeouts and an environment's own ``tool_*`` counters, per episode),
    ``episode/format_errors`` (per episode).
    """
    n = max(len(recs), 1)
    out = {"episode/turns_mean": sum(len(r.turns) for r in recs) / n,
           "episode/success": sum(r.success for r in recs) / n}
    out |= {f"episode/end_reason/{e}": sum(r.end == e for r in recs) / n for e in END_REASONS}
    for key, name in (("tool_calls", "tools/calls"), ("tool_errors", "tools/errors"),
                      ("tool_timeouts", "tools/timeouts"), ("format_errors", "episode/format_errors")):
        out[name] = sum(r.info.get(key, 0.0) for r in recs) / n
    finer = sorted({k for r in recs for k in r.info if k.startswith("tool_")} - {"tool_calls", "tool_errors",
                                                                                 "tool_timeouts"})
    for key in finer:  # an environment's own counters (json_tools: tool_invalid_json, tool_bad_args, ...)
        out[f"tools/{key.removeprefix('tool_')}"] = sum(float(r.info.get(key, 0.0)) for r in recs) / n
    return out
