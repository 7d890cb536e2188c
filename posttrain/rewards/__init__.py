"""Reward functions ``(prompt, completion, **fields) -> float | None`` and protected scoring.

``None`` means "could not score". Nothing a reward function does can break the run: scoring goes
through :mod:`posttrain.rewards.pool` (worker processes, a per-call timeout, a per-batch deadline)
or, with ``workers=0``, runs in this process; either way an exception, a hang, a crash or a
non-finite value is scored ``None``, counted by status and kept with its sample for the log.

The fields given to every function in training are the example's fields plus ``answer``,
``example`` (the :class:`~posttrain.tasks.base.Example`) and ``task``; a function takes what it
needs and ignores the rest (``**_``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any

from posttrain.rewards.pool import STATUSES, Call, Outcome, RewardPool, classify, run_in_process
from posttrain.rewards.registry import REGISTRY, RewardFn, register, reward_names
from posttrain.tasks.base import Example, Task

__all__ = [
    "REGISTRY",
    "Call",
    "Outcome",
    "RewardFn",
    "RewardPool",
    "ScoreReport",
    "register",
    "reward_fields",
    "reward_names",
    "is_batched",
    "pool_for",
    "score",
    "score_batch",
]


def reward_fields(example: Example, task: Task) -> dict[str, Any]:
    """The keyword fields a reward (or step reward) gets for ``example`` in training: the example's
    fields plus ``answer``, ``example`` and ``task`` (module docstring).
    """
    return {**example.fields, "answer": example.answer, "example": example, "task": task}


@register("task")
def task_reward(prompt: str, completion: str, *, task: Task, example: Example, **_: object) -> float:
    """The built-in task's verifier: 1.0 if the completion solves the example, else 0.0."""
    return float(task.verify(completion, example))


@dataclass
class ScoreReport:
    """Per-component outcome of scoring one batch of N completions with K reward components."""

    names: list[str]
    values: list[list[float | None]]  # [K][N]
    counts: list[dict[str, int]]  # per component: calls per status (see pool.STATUSES)
    failures: list[dict[str, Any]] = field(default_factory=list)  # every failed call, with its sample

    @property
    def errors(self) -> list[int]:
        """Per component: calls that raised, returned a non-number or crashed their worker."""
        return [c["error"] + c["crashed"] for c in self.counts]

    @property
    def nonfinite(self) -> list[int]:
        """Per component: NaN / inf results."""
        return [c["nonfinite"] for c in self.counts]

    @property
    def timeouts(self) -> list[int]:
        """Per component: calls past their timeout or the batch deadline."""
        return [c["timeout"] for c in self.counts]


def is_batched(name: str) -> bool:
    """Whether reward ``name`` scores whole batches (lists in, list out) in the trainer's process."""
    return bool(getattr(REGISTRY.get(name), "batched", False))


def run_batched(
    name: str,
    params: Mapping[str, object],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Sequence[Mapping[str, object]],
) -> list[Outcome]:
    """Run a batched reward (e.g. a reward model) here; any failure scores the whole batch ``None``.

    A batched reward may return an :class:`Outcome` for an item it could not score (an unparseable
    judgement, a batch past its time limit): it is counted and logged under its status and reason.
    """
    keys = set.intersection(*(set(f) for f in fields)) if fields else set()
    columns = {k: [f[k] for f in fields] for k in sorted(keys)}
    try:
        values = REGISTRY.get(name)(list(prompts), list(completions), **params, **columns)
        if len(values) != len(completions):
            raise ValueError(f"returned {len(values)} values for {len(completions)} completions")
    except Exception as e:  # noqa: BLE001 - a failing reward must not stop the run
        return [Outcome(None, "error", f"{type(e).__name__}: {e}")] * len(completions)
    return [v if isinstance(v, Outcome) else classify(v) for v in values]


def score_batch(
    fns: Sequence[tuple[str, Mapping[str, object]]],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Sequence[Mapping[str, object]],
    *,
    pool: RewardPool | None = None,
) -> ScoreReport:
    """Score every completion with every component ``(name, params)``; failures become ``None``.

    Per-completion rewards run in ``pool``'s worker processes under its timeouts when a pool is
    given, else here one by one (no timeouts). Batched rewards (:func:`is_batched`, e.g.
    ``reward_model``) run here on the whole batch.
    """
    if not (len(prompts) == len(completions) == len(fields)):
        raise ValueError(
            f"score_batch: {len(prompts)} prompts, {len(completions)} completions and {len(fields)} field rows"
        )
    n = len(completions)
    per_call = [(k, name, params) for k, (name, params) in enumerate(fns) if not is_batched(name)]
    calls = [
        Call(name, dict(params), p, c, dict(f))
        for _, name, params in per_call
        for p, c, f in zip(prompts, completions, fields, strict=True)
    ]
    ran: list[Outcome] = pool.run(calls) if pool is not None and calls else run_in_process(calls)
    outcomes: dict[int, list[Outcome]] = {k: ran[j * n : (j + 1) * n] for j, (k, _, _) in enumerate(per_call)}
    for k, (name, params) in enumerate(fns):
        if k not in outcomes:
            outcomes[k] = run_batched(name, params, prompts, completions, fields)
    names = [name for name, _ in fns]
    values, counts, failures = [], [], []
    for k, name in enumerate(names):
        block = outcomes[k]
        values.append([o.value for o in block])
        count = dict.fromkeys(STATUSES, 0)
        for i, o in enumerate(block):
            count[o.status] += 1
            if o.status not in ("ok", "none"):
                failures.append(
                    {
                        "reward": name,
                        "index": i,
                        "status": o.status,
                        "message": o.message,
                        "prompt": prompts[i],
                        "completion": completions[i],
                    }
                )
        counts.append(count)
    return ScoreReport(names, values, counts, failures)


def pool_for(scoring: object) -> RewardPool | None:
    """The reward pool a ``[scoring]`` config section asks for (``workers = 0``: none, score in-process)."""
    if not scoring.workers:
        return None
    return RewardPool(scoring.workers, call_timeout_s=scoring.timeout_s, deadline_s=scoring.deadline_s)


def score(
    name: str,
    prompts: Sequence[str],
    completions: Sequence[str],
    *,
    params: Mapping[str, object] | None = None,
    workers: int = 2,
    timeout_s: float = 10.0,
    deadline_s: float | None = None,
    **fields: Sequence[object],
) -> list[float | None]:
    r"""Score ``completions`` with reward ``name`` through the whole protected path.

    Each keyword in ``fields`` is a list with one value per completion (``answer=[...]``,
    ``tests=[...]``). Calls run in ``workers`` fresh worker processes (``0``: in this process, no
    timeouts), each call limited to ``timeout_s`` and the whole batch to ``deadline_s``. A call that
    raises, hangs, crashes its worker or returns NaN gives ``None``.

    Example:
        >>> score("math", ["1+1?"], ["\\boxed{2}"], answer=["2"])  # doctest: +SKIP
        [1.0]

    """
    REGISTRY.get(name)  # unknown names fail here, with the choices
    for key, col in fields.items():
        if len(col) != len(completions):
            raise ValueError(f"field {key!r} has {len(col)} values for {len(completions)} completions")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    rows = [{key: col[i] for key, col in fields.items()} for i in range(len(completions))]
    fns = [(name, params or {})]
    if workers == 0 or is_batched(name):
        return score_batch(fns, prompts, completions, rows).values[0]
    with RewardPool(workers, call_timeout_s=timeout_s, deadline_s=deadline_s) as pool:
        return score_batch(fns, prompts, completions, rows, pool=pool).values[0]


# Built-in reward modules register themselves on import (by name, so that the modules called
# ``math`` and ``format`` shadow nothing here).
for _module in ("calibration", "code", "conciseness", "format", "judge", "math", "partial_credit", "remote",
                "reward_model"):
    import_module(f"posttrain.rewards.{_module}")
