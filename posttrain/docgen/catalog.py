"""``posttrain algorithms``: list every registry entry with its one-line summary and paper."""

from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table

from posttrain.algorithms import (
    advantages,
    aggregation,
    entropy,
    kl,
    loss_weights,
    losses,
    offpolicy,
    preference,
    selection,
    sft_losses,
    shaping,
    value,
)
from posttrain.algorithms.registry import Registry, UnknownNameError
from posttrain.models import parameterization
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.rewards.steps import REGISTRY as STEP_REWARDS

REGISTRIES: dict[str, Registry] = {
    "advantage": advantages.REGISTRY,
    "loss": losses.REGISTRY,
    "aggregation": aggregation.REGISTRY,
    "kl": kl.REGISTRY,
    "entropy": entropy.REGISTRY,
    "correction": offpolicy.REGISTRY,
    "loss_weight": loss_weights.REGISTRY,
    "shaper": shaping.REGISTRY,
    "group_filter": selection.REGISTRY,
    "preference": preference.REGISTRY,
    "sft_loss": sft_losses.REGISTRY,
    "reward": REWARDS,
    "step_reward": STEP_REWARDS,
    "parameterization": parameterization.REGISTRY,
    "value_head": value.REGISTRY,
}

_ARXIV = re.compile(r"arXiv[: ]?(\d{4}\.\d{4,5})")


def paper_of(doc: str) -> str:
    """The first arXiv id a docstring cites, or an empty string."""
    m = _ARXIV.search(doc)
    return f"arXiv:{m.group(1)}" if m else ""


def print_algorithms(console: Console, name: str | None = None) -> None:
    """Print the table of all entries, or the full docstring of entry ``name`` (in every registry)."""
    if name:
        found = False
        for kind, reg in REGISTRIES.items():
            if name in reg:
                found = True
                console.rule(f"[bold]{kind}: {name}")
                console.print(reg.doc(name), markup=False, highlight=False)
        if not found:
            every = sorted({n for reg in REGISTRIES.values() for n in reg.names()})
            raise UnknownNameError("algorithm", name, every)
        return
    table = Table(title="posttrain registries (posttrain algorithms NAME prints the formula and details)")
    for col in ("kind", "name", "summary", "paper", "from"):
        table.add_column(col, overflow="fold")
    for kind, reg in REGISTRIES.items():
        for n in reg.names():
            table.add_row(kind, n, reg.summary(n), paper_of(reg.doc(n)), _origin(reg.origin(n)))
    for kind, n, summary, origin in _envs_and_tasks():
        table.add_row(kind, n, summary, "", _origin(origin))
    console.print(table)


def _origin(origin: str | None) -> str:
    """The table's "from" cell: built-in, or the plugin file / module that registered the entry."""
    return "built-in" if origin is None else f"plugin {origin}"


def _envs_and_tasks() -> list[tuple[str, str, str, str | None]]:
    """Environments and tasks (classes, not functions: listed, not in :data:`REGISTRIES`' method docs)."""
    from posttrain.envs import ENVS
    from posttrain.plugins import TASK_ORIGINS
    from posttrain.tasks import TASKS

    rows = [("env", n, ENVS.summary(n), ENVS.origin(n)) for n in ENVS.names()]
    for n in sorted(TASKS):
        doc = (TASKS[n].__doc__ or "").strip()
        rows.append(("task", n, doc.splitlines()[0] if doc else "", TASK_ORIGINS.get(n)))
    return rows
