"""Rollout drivers: the ``produce`` phase of the loop, one registry entry per way of producing rollouts.

A driver turns the data stream into one scored generation batch: it draws P prompts at the data
cursor, has the engine sample G completions each, scores them with the reward components and
returns a :class:`~posttrain.produce.batch.Batch`. It holds no trainer state: what it reads is the
:class:`ProduceContext` (task, tokenizer, engine, sampling, rewards, config) and its own explicit
state (``None`` for stateless drivers), which it returns advanced; the loop keeps that state in the
checkpoint under the driver's name. Sampling is seeded from ``(seed, "sample", step, batch)``.

This module is the registry (:data:`DRIVERS`, :class:`Driver`) and what drivers share (drawing prompts,
sampling and scoring them); it imports no driver. Each driver lives in its own module and registers
itself with :func:`register`; ``produce/__init__.py`` imports them all:

- ``single_turn`` (``produce/drivers/single_turn.py``): sample and score.
- ``hint_reroll`` (``produce/drivers/hint.py``): HINT (arXiv:2510.09388): all-wrong groups are sampled again
  with the example's hint and replace the originals.
- ``partial_states`` (``produce/drivers/partial_states.py``): ReST-GRPO (arXiv:2508.19576): queued partial
  states (prompt + a prefix of an earlier good response) take the place of some stream prompts, and
  eligible groups queue new ones; the queue is the driver's state.
- ``external_mix`` (``produce/drivers/external_mix.py``): RL-PLUS (arXiv:2508.00222): G - n_external
  samples and n_external copies of the example's demonstration per group.
- ``multi_turn`` (``produce/drivers/multi_turn.py``): episodes in the task's environment (``task.name =
  "env"``), token in and token out (``rollout/multiturn.py``); the environment's episode reward is the
  ``task`` component, and the turn-level arrays ride along as ``Batch.turns``.

``rollout.driver`` names the driver and ``rollout.driver_params`` its options (typed by the model each
driver declares at registration, :data:`SPECS`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch
from pydantic import BaseModel
from torch import Tensor

from posttrain.algorithms.registry import Registry
from posttrain.config.base import Section
from posttrain.models.chat import encode_example
from posttrain.produce.batch import Batch
from posttrain.rewards import RewardPool, reward_fields, score_batch
from posttrain.rollout import Rollout, RolloutEngine, SamplingParams
from posttrain.seeds import derive_seed
from posttrain.tasks.base import Example, Task

if TYPE_CHECKING:  # the config validates the drivers' declarations (config/checks.py): no import of it at run time
    from posttrain.config import ProduceSettings


@dataclass
class ProduceContext:
    """What a driver may read: no model, optimizer or loop state, only the engine and the run's settings."""

    task: Task
    tokenizer: object
    engine: RolloutEngine
    sampling: SamplingParams
    rewards: list[tuple[str, dict]]  # (name, params) of each component
    weights_K: Tensor  # each component's weight
    settings: ProduceSettings
    pool: RewardPool | None = None
    reference: object | None = None  # ReferenceRewards (produce/ref_samples.py): PAR's / A*-PO's reference samples

    def score(self, examples: list[Example], rollouts: Rollout) -> tuple[Tensor, Tensor, Tensor, dict, list[dict]]:
        """:func:`score` with this run's components (unweighted ``[P, G, K]``)."""
        return score(self.rewards, self.task, examples, rollouts, self.settings, self.pool)


class Driver(Protocol):
    """A rollout driver: one signature for every entry of :data:`DRIVERS`."""

    def __call__(self, ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Batch, object]:
        """Generation batch ``batch`` of learner step ``step``, its prompts drawn at data ``cursor``: the
        scored :class:`Batch` (``rewards_PG`` not yet shaped) and the driver's ``state`` advanced.
        """
        ...


DRIVERS: Registry[Driver] = Registry("rollout driver")


class NoOptions(Section):
    """A driver without options (``rollout.driver_params`` stays empty)."""


@dataclass(frozen=True)
class DriverSpec:
    """What a driver declares at registration besides its :class:`~posttrain.algorithms.registry.Traits`
    (which ``config/checks.py`` reads with every other chosen entry's): its options and its own checks.
    """

    options: type[BaseModel]  # ``rollout.driver_params``, typed, with their defaults
    episodes: bool = False  # runs episodes in the task's environment (task.name = "env"; turn-level inputs)
    check: Callable[[ProduceSettings], None] | None = None  # load-free check of what no trait says; raises ValueError
    # at set-up: (settings, task, tokenizer, longest prompt's tokens, context) -> raises ConfigError when its
    # prompts do not fit the context
    fits: Callable[[ProduceSettings, Task, object, int, int], None] | None = None


SPECS: dict[str, DriverSpec] = {}


def register(
    name: str,
    *,
    options: type[BaseModel] = NoOptions,
    episodes: bool = False,
    check: Callable[[ProduceSettings], None] | None = None,
    fits: Callable[[ProduceSettings, Task, object, int, int], None] | None = None,
    **traits: object,
) -> Callable[[Driver], Driver]:
    """Register a driver as ``name`` in :data:`DRIVERS` with its traits (``Registry.register``) and its
    :class:`DriverSpec` in :data:`SPECS`.
    """
    into = DRIVERS.register(name, **traits)

    def deco(fn: Driver) -> Driver:
        fn = into(fn)  # a duplicate name raises before the spec is written
        SPECS[name] = DriverSpec(options, episodes, check, fits)
        return fn

    return deco


def produce(ctx: ProduceContext, state: object, step: int, batch: int, cursor: int) -> tuple[Batch, object]:
    """One generation batch from the configured driver (``rollout.driver``); returns it and the
    driver's advanced state.
    """
    return DRIVERS.get(ctx.settings.rollout.driver)(ctx, state, step, batch, cursor)


def sample_and_score(
    ctx: ProduceContext, examples: list[Example], prefixes: list[str], step: int, batch: int, consumed: int
) -> Batch:
    """Sample G completions for each example's chat prompt (+ its response prefix, if any) and score
    prefix + continuation with every reward component.
    """
    t0 = time.perf_counter()
    prompt_ids = [
        encode_example(ctx.tokenizer, ex, ctx.settings.task.system_prompt) + prefix_ids(ctx.tokenizer, pre)
        for ex, pre in zip(examples, prefixes, strict=True)
    ]
    rollouts = ctx.engine.generate(prompt_ids, ctx.sampling, seed=derive_seed(ctx.settings.seed, "sample", step, batch))
    scored = with_prefixes(rollouts, prefixes)
    t1 = time.perf_counter()
    rewards_PGK, valid_PG, correct_PG, metrics, failures = ctx.score(examples, scored)
    return Batch(
        examples=examples,
        prompt_ids=prompt_ids,
        rollouts=rollouts,
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
        gen_tokens=rollouts.num_tokens,
    )


def prefix_ids(tokenizer: object, prefix: str) -> list[int]:
    """A response prefix's tokens, appended to the chat prompt (the assistant turn has begun)."""
    return list(tokenizer(prefix, add_special_tokens=False)["input_ids"]) if prefix else []


def with_prefixes(rollouts: Rollout, prefixes: Sequence[str]) -> Rollout:
    """``rollouts`` whose texts are each group's prefix + continuation: the whole response, to score."""
    if not any(prefixes):
        return rollouts
    texts = [prefixes[i // rollouts.n] + t for i, t in enumerate(rollouts.texts)]
    return replace(rollouts, texts=texts)


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
    rollouts: Rollout,
    settings: ProduceSettings,
    pool: RewardPool | None = None,
) -> tuple[Tensor, Tensor, Tensor, dict[str, float], list[dict]]:
    """Score every completion with every reward component (in ``pool``'s workers when given).

    Returns rewards ``[P, G, K]``, a validity mask ``[P, G]``, the verifier's verdicts ``[P, G]``,
    per-component metrics and the failed calls. ``None`` scores become 0, or mask the sample out
    of the update, as ``scoring.on_error`` says. ``accuracy`` is the task's verifier, scored in
    the same protected way (reusing a plain ``task`` component when the recipe has one).
    """
    G = rollouts.n
    rows = [ex for ex in examples for _ in range(G)]
    fields = [reward_fields(ex, task) for ex in rows]
    fns = list(rewards)
    acc_k = next((k for k, (name, params) in enumerate(fns) if name == "task" and not params), None)
    if acc_k is None:
        fns.append(("task", {}))
        acc_k = len(fns) - 1
    report = score_batch(fns, [ex.prompt for ex in rows], rollouts.texts, fields, pool=pool)
    P, K = len(examples), len(rewards)
    values = torch.tensor([[math.nan if v is None else v for v in col] for col in report.values]).T  # [N, K+]
    accuracy = values[:, acc_k].nan_to_num(0.0)
    values = values[:, :K]
    missing = values.isnan()
    valid_N = ~missing.any(1) if settings.scoring.on_error == "mask" else torch.ones(len(rows), dtype=torch.bool)
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
