"""Per-prompt training accuracy, logged every step, and 1-shot RLVR's historical-variance ranking.

Every step the loop appends one line per trained group to ``<run>/prompt_stats.jsonl``:
``{"step", "prompt", "pass_rate", "n"}`` (the task verifier's accuracy over the group's ``n``
samples; ``log.prompt_stats``). ``posttrain rank-prompts RUN`` folds those lines, step by step,
into :class:`~posttrain.algorithms.selection.PassRateHistory` and ranks prompts by the population
std of their pass rates over the steps they appeared in (:func:`rank_by_historical_variance`,
Wang et al. 2025, arXiv:2504.20571): the examples whose accuracy moved most during a full-data run.
``task.dataset.train_prompts = <the ranking's JSONL>`` then trains on the top ones (the paper:
the top one, repeated).

The paper records one accuracy per epoch; the loop reads a dataset epoch by epoch (every prompt
once per epoch), so a prompt's series is its accuracy once per epoch, as in the paper. Built-in
tasks draw fresh problems, so their prompts rarely recur: the ranking needs a dataset task
(``task.dataset``) trained for two epochs or more.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from torch import Tensor

from posttrain.algorithms.selection.pass_rate import (
    PassRateHistory,
    pass_rate_std,
    rank_by_historical_variance,
    record,
)
from posttrain.reporting.sinks import keep_steps
from posttrain.tasks.base import Example

FILE = "prompt_stats.jsonl"


class PromptStatsLog:
    """Appends each step's per-prompt accuracy to ``<run>/prompt_stats.jsonl``.

    ``start_step`` is the number of steps already completed: on resume the file keeps only the
    lines of steps up to it, so steps re-run after a crash are not counted twice.
    """

    def __init__(self, run_dir: Path, start_step: int = 0) -> None:
        self.path = Path(run_dir) / FILE
        keep_steps(self.path, start_step)
        self._file = self.path.open("a")

    def write(self, step: int, examples: Sequence[Example], correct_PG: Tensor, valid_PG: Tensor) -> None:
        """One line per group: how many of its valid samples the verifier accepted, of how many."""
        n_P = valid_PG.sum(1).tolist()
        ok_P = (correct_PG & valid_PG).sum(1).tolist()
        for ex, ok, n in zip(examples, ok_P, n_P, strict=True):
            if n:
                row = {"step": step, "prompt": ex.prompt, "correct": int(ok), "n": int(n), "pass_rate": ok / n}
                self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._file.close()


def history_from_log(path: Path) -> PassRateHistory:
    """The pass-rate history of a ``prompt_stats.jsonl``: one observation per prompt per step, in
    step order (a prompt drawn twice in one step counts once, its samples pooled).

    Raises:
        ValueError: a line that is not a prompt-stats record (naming the file and line).

    """
    by_step: dict[int, dict[str, tuple[int, int]]] = {}
    for i, line in enumerate(Path(path).read_text().splitlines()):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            step, prompt, ok, n = int(row["step"]), str(row["prompt"]), int(row["correct"]), int(row["n"])
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path} line {i + 1}: not a prompt-stats record ({e!r})") from None
        prev_ok, prev_n = by_step.setdefault(step, {}).get(prompt, (0, 0))
        by_step[step][prompt] = (prev_ok + ok, prev_n + n)
    history = PassRateHistory()
    for step in sorted(by_step):
        history = record(history, by_step[step])
    return history


def rank_prompts(path: Path, *, top: int | None = None, min_appearances: int = 2) -> list[dict]:
    """Prompts of a ``prompt_stats.jsonl`` ranked by historical variance, highest first:
    ``{"prompt", "score", "appearances", "rates"}`` for those seen in at least ``min_appearances``
    steps (one appearance has std 0 and says nothing). Ties keep first-appearance order (the
    authors' stable sort; :func:`rank_by_historical_variance`).
    """
    history = history_from_log(path)
    eligible = PassRateHistory(rates={p: r for p, r in history.rates.items() if len(r) >= min_appearances})
    scores = pass_rate_std(eligible)
    return [
        {"prompt": p, "score": scores[p], "appearances": len(eligible.rates[p]), "rates": list(eligible.rates[p])}
        for p in rank_by_historical_variance(eligible, top_n=top)
    ]


def cli_rank_prompts(args: argparse.Namespace, console: Console) -> int:
    """``posttrain rank-prompts RUN [--top N] [--min-appearances K] [--out F]``: print the ranking
    (and write it as JSONL); exit 2 with a message when there is nothing to rank.
    """
    path = Path(args.run)
    path = path / FILE if path.is_dir() else path
    if not path.is_file():
        console.print(f"[bold red]error:[/] no {FILE} at {path} (written by `posttrain train` with log.prompt_stats)")
        return 2
    if (args.top is not None and args.top < 1) or args.min_appearances < 1:
        console.print("[bold red]error:[/] --top and --min-appearances must be >= 1")
        return 2
    try:
        rows = rank_prompts(path, top=args.top, min_appearances=args.min_appearances)
    except ValueError as e:
        console.print(f"[bold red]error:[/] {escape(str(e))}", soft_wrap=True)
        return 2
    if not rows:
        console.print(
            f"[bold red]error:[/] no prompt of {path} appears in {args.min_appearances} or more steps; the ranking "
            "needs prompts that recur (a dataset task, task.dataset, trained for more than an epoch)"
        )
        return 2
    table = Table(title=f"prompts by historical variance of their pass rate ({path})")
    for col in ("rank", "score (std)", "steps", "pass rates", "prompt"):
        table.add_column(col, overflow="fold")
    for i, r in enumerate(rows[:20]):
        rates = " ".join(f"{q:.2f}" for q in r["rates"][:12]) + (" ..." if len(r["rates"]) > 12 else "")
        table.add_row(str(i + 1), f"{r['score']:.4f}", str(r["appearances"]), rates, escape(r["prompt"][:200]))
    console.print(table)
    if len(rows) > 20:
        console.print(f"... {len(rows) - 20} more")
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
        console.print(
            f"wrote {len(rows)} prompts to {args.out}; train on them with "
            f"'task.dataset.train_prompts=\"{args.out}\"'",
            soft_wrap=True,
        )
    return 0
