"""A rich progress bar with step, ETA and live key metrics, and the end-of-run summary table."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table


def make_progress(console: Console, description: str, enabled: bool = True) -> Progress:
    """A progress display: description, bar, step/total, elapsed, ETA, live metrics."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        TextColumn("{task.fields[metrics]}"),
        console=console,
        disable=not enabled,
        transient=False,
    )


def fmt_metrics(metrics: dict[str, float], keys: list[tuple[str, str]]) -> str:
    """Short ``label=value`` text for the progress line."""
    parts = []
    for key, label in keys:
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label}={metrics[key]:.3g}")
    return " ".join(parts)


def summary_table(title: str, rows: list[tuple[str, str]]) -> Table:
    """A two-column table (name, value)."""
    table = Table(title=title)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in rows:
        table.add_row(name, value)
    return table
