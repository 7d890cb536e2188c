"""The numbers ``posttrain compare`` reports: per run, then mean ± std over the seeds of a label.

Per run (read from its directory, nothing recomputed by a model):

- ``pass@1``, ``pass@K``: ``summary.json["final"]`` (the held-out evaluation after the last step);
  ``K`` is the largest ``k`` the run evaluated (``pass@K == pass@1`` when ``eval.k=[1]``).
- ``tokens``: completion tokens generated for training, summed over ``metrics.jsonl`` rows as
  ``round(throughput/gen_tokens_per_s * time/generate_s)`` (the loop logs the rate, not the count,
  and computes the rate as count / time; evaluation samples are not counted).
- ``wall_s``: the wall time of the train processes compare ran for this run, summed over its
  attempts (``compare_attempts.jsonl``; so a resumed run counts every part); a run compare did not
  run itself falls back to ``summary.json["wall_s"]``. Parallel runs share the cores, so their wall
  times are comparable with each other only at the same ``--parallel``.
- ``train_s``: the sum of ``time/step_s`` (rollouts + rewards + update, no evaluation).
- ``steps_to_target``: the first step whose ``eval/pass@1`` (the periodic held-out evaluation) is
  at least the target, with the final evaluation counted at the last step; when the run has no
  periodic evaluation (``eval.every=0``) the training-batch ``accuracy`` is used instead
  (``target_metric`` says which). ``None`` when never reached.
"""

from __future__ import annotations

import json
import math
import statistics
from html import escape
from pathlib import Path

from rich.table import Table

from posttrain.reporting.sinks import read_metrics

ATTEMPTS = "compare_attempts.jsonl"
"""Per run directory: one JSON row per train process compare ran there (``resume``, ``rc``, ``elapsed_s``)."""

STATS = ("pass@1", "pass@K", "tokens", "wall_s", "train_s", "steps_to_target")


def run_stats(run: Path, target: float | None) -> dict:
    """The reported numbers of one complete run directory (see the module docstring)."""
    summary = json.loads((run / "summary.json").read_text())
    final = summary["final"]
    rows = read_metrics(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    ks = sorted(int(key[len("pass@") :]) for key in final if key.startswith("pass@") and key[5:].isdigit())
    k = ks[-1] if ks else 1
    tokens = sum(round((r.get("throughput/gen_tokens_per_s") or 0.0) * (r.get("time/generate_s") or 0.0)) for r in rows)
    attempts = run / ATTEMPTS
    if attempts.exists():
        wall = sum(json.loads(line)["elapsed_s"] for line in attempts.read_text().splitlines() if line.strip())
    else:
        wall = float(summary["wall_s"])
    out = {
        "steps": summary["steps"],
        "pass@1": final.get("pass@1"),
        "k": k,
        "pass@K": final.get(f"pass@{k}"),
        "tokens": tokens,
        "wall_s": wall,
        "train_s": sum(r.get("time/step_s") or 0.0 for r in rows),
        "steps_to_target": None,
        "target_metric": None,
    }
    if target is not None:
        key = "eval/pass@1" if any(r.get("eval/pass@1") is not None for r in rows) else "accuracy"
        curve = [(r["step"], r.get(key)) for r in rows]
        if key == "eval/pass@1":
            curve.append((summary["steps"], final.get("pass@1")))
        hits = [step for step, v in curve if v is not None and v >= target]
        out["steps_to_target"] = min(hits) if hits else None
        out["target_metric"] = key
    return out


def _mean_std(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "std": None, "n": 0}
    std = statistics.stdev(values) if len(values) > 1 else 0.0  # unbiased, over seeds
    return {"mean": statistics.fmean(values), "std": std, "n": len(values)}


def aggregate(per_seed: dict[int, dict], seeds: list[int]) -> dict:
    """Mean and unbiased std over the complete seeds of one label.

    ``steps_to_target`` averages the seeds that reached the target; ``reached`` counts them.
    """
    done = [per_seed[s] for s in seeds if s in per_seed]
    agg: dict = {"seeds": seeds, "complete": len(done), "runs": {str(s): per_seed[s] for s in per_seed}}
    for key in STATS:
        agg[key] = _mean_std([r[key] for r in done if r[key] is not None])
    agg["k"] = max((r["k"] for r in done), default=None)
    agg["reached"] = sum(r["steps_to_target"] is not None for r in done)
    agg["target_metric"] = next((r["target_metric"] for r in done if r["target_metric"]), None)
    return agg


def _fmt(stat: dict, kind: str) -> str:
    m, s = stat["mean"], stat["std"]
    if m is None or (isinstance(m, float) and math.isnan(m)):
        return "-"
    if kind == "frac":
        return f"{m:.3f} ± {s:.3f}"
    if kind == "int":
        return f"{m:,.0f} ± {s:,.0f}"
    return f"{m:.1f} ± {s:.1f}"


def table_rows(summary: dict) -> tuple[list[str], list[list[str]]]:
    """Header and rows of the summary table (shared by the console and ``summary.md``)."""
    labels = summary["labels"]
    ks = {a["k"] for a in labels.values() if a["k"] is not None}
    k = f"{ks.pop()}" if len(ks) == 1 else "K"
    target = summary["target"]
    show_k = k != "1"  # pass@K is pass@1 when every run evaluated k=1 only
    header = ["run", "seeds", "final pass@1", *([f"pass@{k}"] if show_k else []), "tokens generated", "wall time (s)"]
    if target is not None:
        header.append(f"steps to {target:g}")
    rows = []
    for label, a in labels.items():
        row = [
            label,
            f"{a['complete']}/{len(a['seeds'])}",
            _fmt(a["pass@1"], "frac"),
            *([_fmt(a["pass@K"], "frac")] if show_k else []),
            _fmt(a["tokens"], "int"),
            _fmt(a["wall_s"], "s"),
        ]
        if target is not None:
            if not a["complete"]:
                row.append("-")
            elif a["reached"]:
                row.append(f"{_fmt(a['steps_to_target'], 'int')} ({a['reached']}/{a['complete']})")
            else:
                row.append("not reached")
        rows.append(row)
    return header, rows


def rich_table(summary: dict, title: str) -> Table:
    """The summary table for the console."""
    header, rows = table_rows(summary)
    table = Table(title=title)
    for i, col in enumerate(header):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in rows:
        table.add_row(*row)
    return table


def markdown_table(summary: dict, title: str) -> str:
    """The summary table as Markdown, with a note on what each column is."""
    header, rows = table_rows(summary)
    lines = [f"# {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    metric = next((a["target_metric"] for a in summary["labels"].values() if a["target_metric"]), None)
    lines += [
        "",
        "Mean ± std (unbiased) over the complete seeds. pass@1 and pass@k: the held-out evaluation after the "
        "last step. Tokens: completion tokens generated for training. Wall time: the train processes, summed "
        f"over resumes (at --parallel {summary['parallel']}).",
    ]
    if summary["target"] is not None:
        lines.append(
            f"Steps to {summary['target']:g}: the first step where `{metric or 'eval/pass@1'}` reached it, "
            "averaged over the seeds that reached it (count in brackets)."
        )
    return "\n".join(lines) + "\n"


def html_section(summary: dict) -> str:
    """The summary table as an HTML ``<section id="compare">`` (put at the top of the report)."""
    header, rows = table_rows(summary)
    notes = markdown_table(summary, "").split("\n\n", 2)[-1].strip().splitlines()
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return (
        '<section id="compare"><h2>Comparison</h2>'
        f'<table class="compare"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'
        + "".join(f'<p class="meta">{escape(n.replace("`", ""))}</p>' for n in notes)
        + "</section>\n"
    )
