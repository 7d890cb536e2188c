"""The file of precomputed reference rewards: A*-PO's offline stage, written by ``posttrain astar-values``.

A*-PO (Brantley, Chen, Gao et al. 2025, "Accelerating RL for LLM Reasoning with Optimal Advantage
Regression", arXiv:2505.20686; authors' code ZhaolinGao/A-PO, ``rl_dataset.py::_process_values``) samples
N = 8 responses per training prompt from the frozen reference policy before training, scores them, and
keeps V*(x) = beta1 log( (1/N) sum_j exp(r_j / beta1) ) (beta1 = 0.5; beta1 = 0: the mean); with
``filter_incorrect`` it drops the prompts whose N samples are all wrong.

One JSON object a line, one line per prompt::

    {"prompt": "12+34=", "id": 7, "rewards": [1.0, 0.0, ...], "v_star": 0.7169, "beta1": 0.5, "all_failed": false}

``rewards`` are the M weighted rewards of :class:`~posttrain.produce.ref_samples.ReferenceRewards` (what the
run would sample), ``v_star`` :func:`posttrain.algorithms.advantages.optimal_value` of them at ``beta1``
(for reading: the run recomputes V* from ``rewards`` with its own beta1), ``all_failed`` that the task's
verifier found none of the M correct; ``id`` only when the examples carry one (``Example.fields["id"]``).

A run names the file in ``algorithm.reference_values``: the listed prompts' rewards are preloaded, a prompt
the file lacks is sampled when met, as without a file (so a file of the first ``--limit`` prompts is
usable); a file with another M than the run's is refused before any model loads. With
``algorithm.filter_unsolved`` the all-failed prompts leave a dataset's training pool before training
(prompts the file lacks stay).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from posttrain.algorithms.advantages import optimal_value
from posttrain.config import ConfigError, ProduceSettings
from posttrain.produce.ref_samples import ReferenceRewards
from posttrain.tasks.base import Example, Task

KEY = "algorithm.reference_values"


@dataclass
class ReferenceValues:
    """A file's contents: each prompt's ``[M]`` rewards, and the prompts whose samples all failed."""

    path: str
    rewards: dict[str, Tensor]  # prompt -> [M]
    unsolved: set[str]


def value_row(ex: Example, rewards_M: Tensor, correct_M: Tensor | None, beta1: float) -> dict:
    """One line of the file for example ``ex`` (module docstring). Without ``correct_M`` (verdicts
    unknown) a prompt counts as failed when no reward is > 0, the authors' test on {0, 1} rewards.
    """
    row: dict = {"prompt": ex.prompt}
    if "id" in ex.fields:
        row["id"] = ex.fields["id"]
    solved = bool(correct_M.any()) if correct_M is not None else bool((rewards_M > 0).any())
    return row | {
        "rewards": [float(r) for r in rewards_M],
        "v_star": float(optimal_value(rewards_M.double(), beta1=beta1)),
        "beta1": beta1,
        "all_failed": not solved,
    }


def write_values(path: Path, rows: list[dict]) -> None:
    """Write ``rows`` as JSONL, atomically (a temp file, then a rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tmp.replace(path)


def read_values(path: str, samples: int) -> ReferenceValues:
    """Read and check a file of ``posttrain astar-values`` for a run that samples ``samples`` per prompt.

    Raises:
        ConfigError: naming ``algorithm.reference_values``: no such file, an unreadable line, or a
            line whose number of rewards is not ``samples`` (a stale file), with the fix.

    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{KEY}: no file {path!r}; write it with `posttrain astar-values RECIPE --out {path}`")
    rewards: dict[str, Tensor] = {}
    unsolved: set[str] = set()
    for i, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        prompt, r, failed = _parse(line, f"{path} line {i}")
        if len(r) != samples:
            raise ConfigError(
                f"{KEY}: {path} line {i} holds {len(r)} reference rewards per prompt, but this run samples {samples} "
                "(algorithm.advantage_params.samples, or par's samples): the file is stale; write it again with "
                f"`posttrain astar-values RECIPE --out {path}` and this run's settings, or set the samples to {len(r)}"
            )
        rewards[prompt] = torch.tensor(r, dtype=torch.float32)
        if failed:
            unsolved.add(prompt)
    if not rewards:
        raise ConfigError(f"{KEY}: {path} holds no prompts")
    return ReferenceValues(path, rewards, unsolved)


def _parse(line: str, where: str) -> tuple[str, list[float], bool]:
    """A line's prompt, rewards and ``all_failed``, or a ConfigError saying what is wrong where."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{KEY}: {where} is not JSON ({e.msg})") from None
    prompt, r = (row.get("prompt"), row.get("rewards")) if isinstance(row, dict) else (None, None)
    if not isinstance(prompt, str):
        raise ConfigError(f"{KEY}: {where} has no string 'prompt' (is it a file of `posttrain astar-values`?)")
    ok = isinstance(r, list) and all(isinstance(x, int | float) and not isinstance(x, bool) for x in r)
    if not ok or not all(math.isfinite(x) for x in r):
        raise ConfigError(f"{KEY}: {where}: 'rewards' must be a list of finite numbers, got {r!r:.80}")
    return prompt, [float(x) for x in r], row.get("all_failed") is True


def drop_unsolved(task: Task, unsolved: set[str]) -> str:
    """Remove the prompts in ``unsolved`` from ``task``'s training pool (A*-PO's ``filter_incorrect``;
    ``algorithm.filter_unsolved``); returns a line for the log. Call it before any prompt is drawn: the
    stream's order depends on the pool.

    Raises:
        ConfigError: the task has no pool, or no training prompt is left.

    """
    pools = getattr(task, "pools", None)
    if pools is None:
        raise ConfigError(f"algorithm.filter_unsolved: task {task.name!r} has no pool of training prompts to filter")
    before = len(pools["train"])
    pools["train"] = [ex for ex in pools["train"] if ex.prompt not in unsolved]
    if not pools["train"]:
        raise ConfigError(f"algorithm.filter_unsolved: every one of the {before} training prompts had all its "
                          "reference samples fail; nothing is left to train on (unset algorithm.filter_unsolved)")
    return f"filter_unsolved: dropped {before - len(pools['train'])} of {before} training prompts (all reference " \
           "samples incorrect)"


def run_values(settings: ProduceSettings, samples: int) -> ReferenceValues | None:
    """The run's file (``algorithm.reference_values``), read and checked against its ``samples`` per
    prompt; ``None`` without one. The loop calls it before any model loads.
    """
    path = settings.algorithm.reference_values
    return read_values(path, samples) if path is not None else None


def use_values(settings: ProduceSettings, values: ReferenceValues | None, task: Task,
               reference: ReferenceRewards | None) -> list[str]:
    """Apply a run's file before any prompt is drawn: the task's pool filtered (``filter_unsolved``),
    the reference sampler preloaded. Returns lines for the log.
    """
    if values is None:
        return []
    notes = [drop_unsolved(task, values.unsolved)] if settings.algorithm.filter_unsolved else []
    if reference is not None:
        reference.preload(values.rewards)
    return [f"reference values: {len(values.rewards)} prompts read from {values.path} (others sampled when met)",
            *notes]
