"""Step (process) rewards: name -> ``(prompt, completion, **fields) -> list[float]``, one score per
reasoning step of the completion, in order.

They feed the process-reward shapers (``prm_clip``, ``prm_delta``; arXiv:2410.15115) as
``step_rewards [P, G, K]`` with ``step_mask [P, G, K]`` (steps left-aligned, K the most steps of
any response in the batch). Chosen with ``algorithm.step_reward`` (+ ``step_reward_params``); the
fields are the ones every reward gets (the example's fields, ``answer``, ``example``, ``task``).

They run in the trainer's process, per completion: a scorer that raises scores that response with
no steps (it is counted in ``step_reward/errors``), except :class:`StepRewardError`, which says the
scorer cannot work with this run at all and stops it with its message. ``prm`` (a process reward
model, :mod:`posttrain.rewards.prm`) is registered by that module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from importlib import import_module

import torch
from torch import Tensor

from posttrain.algorithms.registry import Registry
from posttrain.errors import ConfigError
from posttrain.rewards import reward_fields
from posttrain.tasks.base import Example, Task

StepRewardFn = Callable[..., Sequence[float]]
REGISTRY: Registry = Registry("step reward")
register = REGISTRY.register


class StepRewardError(ConfigError):
    """The step scorer cannot score this run (e.g. its task writes no steps): a setup error."""


@register("reference_steps")
def reference_steps(prompt: str, completion: str, *, task: Task, example: Example, **_: object) -> list[float]:
    """1.0 for each written step equal to the reference solution's step at the same position, else 0.0.

    An oracle process reward for tasks that write worked steps and know the right ones (the
    arithmetic task with ``steps = true``: column sums or partial products): the automatic step
    labels a PRM is trained to predict (Math-Shepherd-style), computed exactly. The task must
    provide ``split_steps(completion) -> list[str]`` and ``reference_steps(example) -> list[str]``.
    A step past the reference's last scores 0. Example (``58+67``, reference ``15,12``): ``"15,13>..."``
    -> ``[1.0, 0.0]``; ``"15,12,1>..."`` -> ``[1.0, 1.0, 0.0]``; ``"521"`` (no scratchpad) -> ``[]``.
    """
    split, ref = getattr(task, "split_steps", None), getattr(task, "reference_steps", None)
    if split is None or ref is None:
        raise StepRewardError(f"step reward 'reference_steps': task {task.name!r} has no reference steps")
    want = ref(example)
    if not want:
        raise StepRewardError(
            f"step reward 'reference_steps': task {task!r} writes no steps "
            "(for arithmetic set task.params.steps = true)"
        )
    return [1.0 if k < len(want) and step == want[k] else 0.0 for k, step in enumerate(split(completion))]


def score_steps(
    name: str,
    params: Mapping[str, object],
    prompts: Sequence[str],
    completions: Sequence[str],
    fields: Sequence[Mapping[str, object]],
) -> tuple[Tensor, Tensor, int]:
    """Score every completion's steps: ``(step_rewards [N, K], step_mask [N, K], errors)``.

    K is the most steps of any completion (at least 1); padding has mask 0 and score 0. A call that
    raises (other than :class:`StepRewardError`) or returns a non-finite score counts as an error
    and gives that completion no steps. A scorer with a ``batch`` attribute (``batch(prompts,
    completions, **params) -> list[list[float]]``, e.g. ``prm``'s batched forward) scores the whole
    list in one call; if that call raises, every completion is scored one by one instead.
    """
    fn = REGISTRY.get(name)
    batched: list | None = None
    batch = getattr(fn, "batch", None)
    if batch is not None:
        try:
            batched = list(batch(list(prompts), list(completions), **params))
        except StepRewardError:
            raise
        except Exception:  # noqa: BLE001 - fall back to per-completion calls, which count errors one by one
            batched = None
    rows: list[list[float]] = []
    errors = 0
    for i, (prompt, completion, f) in enumerate(zip(prompts, completions, fields, strict=True)):
        try:
            raw = batched[i] if batched is not None else fn(prompt, completion, **params, **f)
            scores = [float(s) for s in raw]
        except StepRewardError:
            raise
        except Exception:  # noqa: BLE001 - a broken scorer loses one sample's steps, not the run
            scores = None
        if scores is None or not all(s == s and abs(s) != float("inf") for s in scores):
            errors += 1
            scores = []
        rows.append(scores)
    K = max(1, max(map(len, rows), default=0))
    values = torch.zeros(len(rows), K)
    mask = torch.zeros(len(rows), K)
    for i, r in enumerate(rows):
        values[i, : len(r)] = torch.tensor(r, dtype=torch.float32)
        mask[i, : len(r)] = 1.0
    return values, mask, errors


def check_step_reward(name: str, params: Mapping[str, object], task: Task) -> None:
    """Score one training example's demonstration at set-up, so a scorer that cannot work with this
    task fails before any model loads (:class:`StepRewardError`, a :class:`ConfigError`).
    """
    (ex,) = task.examples("train", 1, seed=0)
    fields = reward_fields(ex, task)
    try:
        REGISTRY.get(name)(ex.prompt, ex.demonstration, **params, **fields)
    except StepRewardError:
        raise
    except Exception as e:  # noqa: BLE001 - e.g. a missing `path`, a model that does not load
        raise StepRewardError(
            f"algorithm.step_reward {name!r} (params {dict(params)}) fails on a training example's "
            f"demonstration: {type(e).__name__}: {e}"
        ) from e


def step_reward_names() -> list[str]:
    """Registered step-reward names."""
    return REGISTRY.names()


# Built-in step-reward modules that register themselves (after `register` exists: they import it).
import_module("posttrain.rewards.prm")
import_module("posttrain.rewards.progress")
