"""Evaluation in a multi-turn environment (``task.name = "env"``): n episodes per held-out problem.

An episode is correct when its environment says it succeeded (``info["success"]``); ``pass@k`` and
``mean@n`` are read as for single-turn tasks (greedy pass@1 with ``n = 1``, ``temperature = 0``).
Also: ``reward_mean`` (the episode reward), ``turns_mean``, ``turns_to_solve`` (mean turns of the
solved episodes; NaN when none), ``solved_within/<t>`` (the share of episodes solved within t
turns), ``length_mean`` (sampled tokens), ``truncation_rate`` (episodes cut by a turn's or the
episode's token limit), ``env_errors`` (episodes whose environment raised or hung) and ``end_reason/*`` shares.
"""

from __future__ import annotations

import numpy as np
from transformers import PreTrainedTokenizerBase

from posttrain.evaluation.metrics import mean_pass_at_k
from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.rollout.multiturn import END_REASONS, EpisodeSource, task_episodes
from posttrain.tasks.base import Example


def evaluate_episodes(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: EpisodeSource,
    examples: list[Example],
    *,
    n: int = 1,
    ks: list[int] | tuple[int, ...] = (1,),
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_batch: int = 256,
    seed: int = 0,
) -> tuple[dict[str, float], list[dict]]:
    """Run ``n`` episodes of every example; returns the metrics and one record per problem."""
    if not examples:
        raise ValueError("no examples to evaluate")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, n=n)
    per_call = max(1, max_batch // n)
    problems, recs_all = [], []
    for start in range(0, len(examples), per_call):
        batch = examples[start: start + per_call]
        recs, rollouts, _ = task_episodes(engine, tokenizer, task, batch, sampling,
                                       lambda rnd, s=start: seed + 1000 * s + rnd)
        recs_all += recs
        for i, ex in enumerate(batch):
            mine = recs[i * n: (i + 1) * n]
            problems.append({"prompt": ex.prompt, "answer": ex.answer,
                             "completions": rollouts.texts[i * n: (i + 1) * n],
                             "correct": [r.success > 0.5 for r in mine],
                             "rewards": [r.reward for r in mine], "ends": [r.end for r in mine]})
    n_correct = np.array([sum(p["correct"]) for p in problems])
    metrics = {f"pass@{k}": mean_pass_at_k(n, n_correct, k) for k in ks}
    metrics[f"mean@{n}"] = float(n_correct.mean() / n)
    metrics["reward_mean"] = float(np.mean([r.reward or 0.0 for r in recs_all]))
    metrics["turns_mean"] = float(np.mean([len(r.turns) for r in recs_all]))
    solved = [len(r.turns) for r in recs_all if r.success > 0.5]
    metrics["turns_to_solve"] = float(np.mean(solved)) if solved else float("nan")
    # the share of episodes solved within t turns, t = 1 .. the longest episode (the last equals mean@n)
    for t in range(1, max(len(r.turns) for r in recs_all) + 1):
        metrics[f"solved_within/{t}"] = float(np.mean([r.success > 0.5 and len(r.turns) <= t for r in recs_all]))
    metrics["length_mean"] = float(np.mean([sum(len(t.action_ids) for t in r.turns) for r in recs_all]))
    metrics["truncation_rate"] = float(np.mean([r.end in ("length", "budget") for r in recs_all]))
    metrics["env_errors"] = float(sum(r.reward is None for r in recs_all))
    metrics |= {f"end_reason/{e}": float(np.mean([r.end == e for r in recs_all])) for e in END_REASONS}
    return metrics, problems
