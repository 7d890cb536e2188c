"""PNG plots of metrics: against step and against cumulative wall time, one run or several overlaid.

A *metric group* is the prefix of a key before its first "/" (``reward/mean`` -> ``reward``);
top-level keys such as ``accuracy`` and ``loss`` form the ``main`` group. Wall time is the running
sum of ``time/step_s`` (training time; held-out evaluation is not counted). Several runs of one
method (seeds) are drawn as the mean over seeds with a shaded min-max band.
"""

from __future__ import annotations

import io
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

MAIN_GROUP = "main"
STEP_TIME_KEY = "time/step_s"
_PANEL_COLS = 4  # metric panels per row in a group figure


def plot_metrics(rows: list[dict], keys: list[str], out: Path, title: str = "") -> Path | None:
    """One PNG with a panel per metric key present in ``rows`` (x = step)."""
    present = [k for k in keys if any(r.get(k) is not None for r in rows)]
    if not present:
        return None
    fig, axes = plt.subplots(1, len(present), figsize=(4 * len(present), 3.2), squeeze=False)
    for ax, key in zip(axes[0], present, strict=True):
        pts = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], lw=1.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# --------------------------------------------------------------------------- series


@dataclass
class Series:
    """One line on a plot: a run (one element in ``runs``) or a method's seeds (several)."""

    label: str
    runs: list[list[dict]] = field(default_factory=list)  # metrics.jsonl rows of each run


def _value(row: dict, key: str) -> float | None:
    v = row.get(key)
    if isinstance(v, int | float) and math.isfinite(v):
        return float(v)
    return None


def numeric_keys(rows: list[dict]) -> list[str]:
    """The metric keys (not ``step``) with at least one finite number, sorted."""
    return sorted({k for r in rows for k in r if k != "step" and _value(r, k) is not None})


def metric_groups(rows: list[dict]) -> dict[str, list[str]]:
    """Metric keys by group (the prefix before the first "/", top-level keys in ``main``), main first."""
    groups: dict[str, list[str]] = defaultdict(list)
    for key in numeric_keys(rows):
        groups[key.split("/", 1)[0] if "/" in key else MAIN_GROUP].append(key)
    return dict(sorted(groups.items(), key=lambda kv: (kv[0] != MAIN_GROUP, kv[0])))


def wall_times(rows: list[dict]) -> dict[int, float] | None:
    """Step -> cumulative ``time/step_s`` up to and including it; None when no row has a step time."""
    if not any(_value(r, STEP_TIME_KEY) is not None for r in rows):
        return None
    total, out = 0.0, {}
    for r in sorted(rows, key=lambda r: r["step"]):
        total += _value(r, STEP_TIME_KEY) or 0.0
        out[r["step"]] = total
    return out


def curve(runs: list[list[dict]], key: str, x: str = "step") -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(x, mean, min, max)`` of ``key`` over the runs, at each step where some run logged it.

    ``x = "wall"`` puts each step at the mean over runs of its cumulative wall time (runs without
    step times are left out of that axis).
    """
    by_step: dict[int, list[float]] = defaultdict(list)
    wall_by_step: dict[int, list[float]] = defaultdict(list)
    for rows in runs:
        walls = wall_times(rows) if x == "wall" else None
        if x == "wall" and walls is None:
            continue
        for r in rows:
            v = _value(r, key)
            if v is None:
                continue
            by_step[r["step"]].append(v)
            if walls is not None:
                wall_by_step[r["step"]].append(walls[r["step"]])
    steps = sorted(by_step)
    xs = [float(np.mean(wall_by_step[s])) if x == "wall" else float(s) for s in steps]
    vals = [by_step[s] for s in steps]
    return (
        np.array(xs),
        np.array([np.mean(v) for v in vals]),
        np.array([np.min(v) for v in vals]),
        np.array([np.max(v) for v in vals]),
    )


# --------------------------------------------------------------------------- figures


def _draw(ax: plt.Axes, series: list[Series], key: str, x: str) -> bool:
    drawn = False
    for i, s in enumerate(series):
        xs, mean, lo, hi = curve(s.runs, key, x)
        if not len(xs):
            continue
        color = f"C{i % 10}"
        ax.plot(xs, mean, lw=1.3, color=color, label=s.label, marker="." if len(xs) <= 30 else None, ms=4)
        if len(s.runs) > 1 and len(xs) > 1:
            ax.fill_between(xs, lo, hi, color=color, alpha=0.2, lw=0)
        elif len(s.runs) > 1:  # a single point (e.g. one held-out eval): the spread as an error bar
            ax.errorbar(xs, mean, yerr=[mean - lo, hi - mean], color=color, capsize=3, lw=1)
        drawn = True
    return drawn


def curves_figure(series: list[Series], keys: list[str], title: str = "") -> Figure | None:
    """A figure with two panels, each a grid with one subplot per key: against step, against wall time.

    Each series is one line (its mean over runs, with a min-max band when it has several runs).
    The wall-time panel is left out when no run logged ``time/step_s``. None when no key has data.
    """
    keys = [k for k in keys if any(_value(r, k) is not None for s in series for rows in s.runs for r in rows)]
    if not keys:
        return None
    has_wall = any(wall_times(rows) is not None for s in series for rows in s.runs)
    panels = [("step", "step")] + ([("wall", "wall time (s)")] if has_wall else [])
    ncols = min(_PANEL_COLS, len(keys))
    nrows = math.ceil(len(keys) / ncols)
    legend = len(series) > 1 or any(len(s.runs) > 1 for s in series)
    # fixed layout in inches (a layout engine doubles the drawing time of these many-axes figures)
    row_h, head_h, gap_h = 2.2, 0.3, 0.25
    top_h = (0.45 if title else 0.1) + (0.35 if legend else 0.0)
    panel_h = head_h + row_h * nrows
    width = 3.3 * ncols + 0.3
    height = top_h + panel_h * len(panels) + gap_h * (len(panels) - 1) + 0.1
    fig = plt.figure(figsize=(width, height))
    handles: dict[str, object] = {}
    y = height - top_h  # top of the current panel, inches from the bottom
    for x, xlabel in panels:
        fig.text(0.01, (y - 0.05) / height, f"against {xlabel.split(' (')[0]}", fontsize=10, weight="bold", va="top")
        grid = fig.add_gridspec(
            nrows,
            ncols,
            left=0.55 / width,
            right=1 - 0.15 / width,
            top=(y - head_h - 0.25) / height,
            bottom=(y - panel_h + 0.4) / height,
            hspace=0.6,
            wspace=0.3,
        )
        for i, key in enumerate(keys):
            ax = fig.add_subplot(grid[i // ncols, i % ncols])
            if not _draw(ax, series, key, x):
                ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="0.5")
            ax.set_title(key, fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8, labelpad=1)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            for h, lab in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(lab, h)
        y -= panel_h + gap_h
    if legend and handles:
        fig.legend(
            handles.values(),
            handles.keys(),
            loc="upper center",
            bbox_to_anchor=(0.5, 1 - (top_h - 0.35) / height),
            ncols=min(len(handles), 5),
            fontsize=8,
            frameon=False,
        )
    if title:
        fig.suptitle(title, fontsize=11, y=1 - 0.08 / height, va="top")
    return fig


def figure_png(fig: Figure, dpi: int = 80) -> bytes:
    """Render ``fig`` to PNG bytes and close it."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def _filename(group: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", group) + ".png"


def plot_metric_groups(rows: list[dict], out_dir: Path, *, dpi: int = 90) -> list[Path]:
    """One PNG per metric group in ``out_dir`` (``<group>.png``), each with two panels: every key
    of the group against step and against cumulative wall time (sum of ``time/step_s``).

    Returns the paths written, ``main`` first, then the groups in alphabetical order.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for group, keys in metric_groups(rows).items():
        fig = curves_figure([Series("run", [rows])], keys, title=f"{group} metrics")
        if fig is None:
            continue
        path = out_dir / _filename(group)
        path.write_bytes(figure_png(fig, dpi))
        written.append(path)
    return written


# --------------------------------------------------------------------------- pass@k and calibration


def passk_figure(series: dict[str, dict[str, dict[int, list[float]]]]) -> Figure | None:
    """pass@k and maj@k against k (log2 axis), one line per series: label -> metric -> k -> values.

    ``metric`` is ``"pass"`` or ``"maj"``; several values (seeds) give the mean with a min-max bar.
    None when no series has a value.
    """
    metrics = [m for m in ("pass", "maj") if any(s.get(m) for s in series.values())]
    if not metrics:
        return None
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.6 * len(metrics), 3.4), squeeze=False, layout="constrained")
    all_k: set[int] = set()
    for ax, metric in zip(axes[0], metrics, strict=True):
        for i, (label, data) in enumerate(series.items()):
            ks = sorted(data.get(metric, {}))
            if not ks:
                continue
            all_k.update(ks)
            vals = [data[metric][k] for k in ks]
            mean = np.array([np.mean(v) for v in vals])
            err = np.array(
                [
                    [m - np.min(v) for m, v in zip(mean, vals, strict=True)],
                    [np.max(v) - m for m, v in zip(mean, vals, strict=True)],
                ]
            )
            yerr = err if any(len(v) > 1 for v in vals) else None
            ax.errorbar(ks, mean, yerr=yerr, marker="o", ms=4, lw=1.3, capsize=3, color=f"C{i % 10}", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(all_k), [str(k) for k in sorted(all_k)])
        ax.minorticks_off()
        ax.set_xlabel("k")
        ax.set_title(f"{metric}@k", fontsize=10)
        ax.set_ylim(-0.02, 1.02)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    return fig


def calibration_figure(series: dict[str, tuple[np.ndarray, np.ndarray]], bins: int = 10) -> Figure | None:
    """Reliability diagram (accuracy against mean confidence per equal-width bin) and bin counts.

    ``series``: label -> (confidences in [0, 1], correct in {0, 1}); labels carry the ECE. None when
    no series has a confidence.
    """
    from posttrain.evaluation import ece, reliability_bins  # the evaluation package imports torch

    series = {k: v for k, v in series.items() if len(v[0])}
    if not series:
        return None
    fig, (ax, hist) = plt.subplots(1, 2, figsize=(9.2, 3.8), layout="constrained")
    ax.plot([0, 1], [0, 1], ls="--", color="0.5", lw=1, label="perfect calibration")
    edges = np.arange(bins + 1) / bins
    for i, (label, (conf, correct)) in enumerate(series.items()):
        rb = [b for b in reliability_bins(conf, correct, bins=bins) if b.count]
        color = f"C{i % 10}"
        ax.plot(
            [b.mean_conf for b in rb],
            [b.accuracy for b in rb],
            marker="o",
            ms=4,
            lw=1.3,
            color=color,
            label=f"{label} (ECE {ece(conf, correct, bins=bins):.3f}, n={len(conf)})",
        )
        counts = [b.count for b in reliability_bins(conf, correct, bins=bins)]
        hist.stairs(counts, edges, color=color, lw=1.5, label=label)
    ax.set(xlim=(0, 1), ylim=(0, 1), xlabel="confidence", ylabel="accuracy")
    ax.set_title("reliability diagram", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    hist.set(xlim=(0, 1), xlabel="confidence", ylabel="samples")
    hist.set_title("confidence histogram", fontsize=10)
    hist.grid(alpha=0.3)
    return fig
