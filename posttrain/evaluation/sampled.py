"""Sampled evaluation: n completions per held-out prompt -> pass@k, maj@k, mean@k, lengths, calibration.

Used by ``posttrain eval``, by the trainer every ``eval.every`` steps and at the end of a run. With
``n = 1`` and ``temperature = 0`` it is greedy pass@1.

Correctness is the task's verifier scored through the protected reward path (a reward pool when
one is given), the answer for majority voting is ``task.extract``, and a verbalized confidence
(``<confidence>q</confidence>``, RLCR) is read from every completion: when some carry one, ECE,
Brier and AUROC are computed over those.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from transformers import PreTrainedTokenizerBase

from posttrain.config import Config
from posttrain.envs.task import EnvTask
from posttrain.evaluation.episodes import evaluate_episodes
from posttrain.evaluation.metrics import auroc, brier, ece, maj_at_k, mean_pass_at_k
from posttrain.models.chat import encode_example
from posttrain.rewards import RewardPool, reward_fields, score_batch
from posttrain.rewards.calibration import parse_confidence
from posttrain.rollout.base import RolloutEngine, SamplingParams
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example, Task


@dataclass
class EvalResult:
    """Aggregate ``metrics`` and one record per problem (its samples, answers and correctness)."""

    metrics: dict[str, float]
    problems: list[dict] = field(default_factory=list)


def evaluate_samples(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    *,
    n: int = 1,
    ks: list[int] | tuple[int, ...] = (1,),
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    system_prompt: str | None = None,
    max_batch: int = 256,
    seed: int = 0,
    pool: RewardPool | None = None,
) -> EvalResult:
    """Sample ``n`` completions for each example and compute the metrics (see the module docstring).

    ``ks`` are the k of pass@k and maj@k (each at most ``n``). Metrics: ``pass@k``, ``maj@k``,
    ``mean@n`` (the average correctness of one sample), ``length_mean``, ``length_max``,
    ``truncation_rate``, ``verify_errors`` (verifier calls that failed, scored wrong), and
    ``confidence_rate`` plus ``ece``, ``brier``, ``auroc`` when completions state a confidence.
    A multi-turn environment's task (``task.name = "env"``) runs episodes instead
    (``evaluation/episodes.py``: ``pass@k`` of the environment's success, turns, end reasons).
    """
    if isinstance(task, EnvTask):  # a multi-turn environment: episodes, scored by the environment
        metrics, problems = evaluate_episodes(engine, tokenizer, task, examples, n=n, ks=ks,
                                              max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                              max_batch=max_batch, seed=seed)
        return EvalResult(metrics, problems)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    bad = [k for k in ks if not 1 <= k <= n]
    if bad:
        raise ValueError(f"every k must be in 1..n={n}; got {bad}")
    if not examples:
        raise ValueError("no examples to evaluate")
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, n=n)
    per_call = max(1, max_batch // n)
    problems: list[dict] = []
    lengths, finished, errors = [], [], 0
    for start in range(0, len(examples), per_call):
        batch = examples[start : start + per_call]
        prompts = [encode_example(tokenizer, ex, system_prompt) for ex in batch]
        rollouts = engine.generate(prompts, sampling, seed=seed + start)
        rows = [ex for ex in batch for _ in range(n)]
        fields = [reward_fields(ex, task) for ex in rows]
        report = score_batch([("task", {})], [ex.prompt for ex in rows], rollouts.texts, fields, pool=pool)
        errors += sum(v is None for v in report.values[0])
        scores = [0.0 if v is None else v for v in report.values[0]]
        lengths += rollouts.lengths.tolist()
        finished += rollouts.finished.tolist()
        for i, ex in enumerate(batch):
            texts = rollouts.texts[i * n : (i + 1) * n]
            correct = [s > 0.5 for s in scores[i * n : (i + 1) * n]]
            problems.append(
                {
                    "prompt": ex.prompt,
                    "answer": ex.answer,
                    "completions": texts,
                    "answers": [task.extract(t) for t in texts],
                    "correct": correct,
                    "confidence": [parse_confidence(t) for t in texts],
                }
            )
    return EvalResult(_metrics(problems, n, ks, lengths, finished, errors), problems)


def _metrics(
    problems: list[dict], n: int, ks: list[int] | tuple[int, ...], lengths: list[int], finished: list[bool], errors: int
) -> dict[str, float]:
    """:func:`evaluate_samples`'s metrics from its problem records, completion lengths and verifier errors."""
    n_correct = np.array([sum(p["correct"]) for p in problems])
    metrics: dict[str, float] = {}
    for k in ks:
        metrics[f"pass@{k}"] = mean_pass_at_k(n, n_correct, k)
        metrics[f"maj@{k}"] = float(np.mean([_majority(p, k) for p in problems]))
    metrics[f"mean@{n}"] = float(n_correct.mean() / n)
    metrics["length_mean"] = float(np.mean(lengths))
    metrics["length_max"] = float(np.max(lengths))
    metrics["truncation_rate"] = 1.0 - float(np.mean(finished))
    metrics["verify_errors"] = float(errors)
    conf = [(q, c) for p in problems for q, c in zip(p["confidence"], p["correct"], strict=True) if q is not None]
    metrics["confidence_rate"] = len(conf) / (len(problems) * n)
    if conf:
        q, y = np.array([c[0] for c in conf]), np.array([c[1] for c in conf], dtype=float)
        metrics["ece"], metrics["brier"], metrics["auroc"] = ece(q, y), brier(q, y), auroc(q, y)
    return metrics


def evaluate_config(
    engine: RolloutEngine,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    examples: list[Example],
    cfg: Config,
    pool: RewardPool | None = None,
) -> EvalResult:
    """:func:`evaluate_samples` with the run's ``[eval]`` settings (what ``train`` and ``eval`` run)."""
    return evaluate_samples(
        engine,
        tokenizer,
        task,
        examples,
        n=cfg.eval.n,
        ks=cfg.eval.k,
        max_new_tokens=cfg.rollout.max_new_tokens,
        temperature=cfg.eval.temperature,
        top_p=cfg.eval.top_p,
        system_prompt=cfg.task.system_prompt,
        seed=derive_seed(cfg.seed, "eval-sampling"),
        pool=pool,
    )


def _majority(problem: dict, k: int) -> float:
    # an answer is keyed with its verdict: a verifier that is not a function of the extracted
    # answer alone (e.g. the text around it matters) then never makes one class both right and wrong
    answers = [(a, c) if a is not None else None for a, c in zip(problem["answers"], problem["correct"], strict=True)]
    correct = [c and a is not None for a, c in zip(answers, problem["correct"], strict=True)]
    return maj_at_k(answers, correct, k)
