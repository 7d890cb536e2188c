"""``posttrain report``: one self-contained HTML page about one or several run directories.

The page holds each run's config, the key training curves (runs overlaid; the seeds of one method
drawn as a mean line with a min-max band), pass@k and maj@k against k, a calibration diagram,
the best and worst sampled completions by reward, and every metric group. Images are embedded as
base64 PNG; the page loads nothing from outside and runs no script.

Structure (stable, tests rely on it): ``<section id="runs">`` (``table.runs``), ``id="config"``
(``details.config``), ``id="curves"``, ``id="pass-at-k"`` (``table.pass-at-k``), ``id="calibration"``,
``id="samples"`` (``table.samples``, rows ``tr.best`` / ``tr.worst``; a multi-turn episode's transcript in
``pre.transcript`` with ``span.trained`` / ``span.context``), ``id="metrics"``; every plot is
an ``<img class="plot" alt="...">``; a missing input is said in a ``<p class="missing">``.
"""

from __future__ import annotations

import base64
import datetime
import json
import math
import re
import tomllib
from dataclasses import dataclass, field
from html import escape
from pathlib import Path

import numpy as np

from posttrain.reporting.plots import (
    Series,
    calibration_figure,
    curves_figure,
    figure_png,
    metric_groups,
    passk_figure,
)

RUN_FILES = ("config.toml", "metrics.jsonl", "summary.json", "eval.json")
KEY_METRICS = [
    "reward/mean",
    "accuracy",
    "eval/pass@1",
    "eval/ece",
    "policy/entropy",
    "policy/kl_ref",
    "response/length_mean",
    "response/truncation_rate",
    "loss",
    "optim/grad_norm",
    "sft/loss",
    "sft/val_accuracy",
]
SAMPLES_SHOWN = 5  # best and worst completions per run


class RunDirError(ValueError):
    """A path given to the report is not a run directory."""


@dataclass
class RunData:
    """What the report reads from one run directory; missing files leave their field empty."""

    path: Path
    label: str = ""
    config: str | None = None
    metrics: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    summary: dict | None = None
    eval: dict | None = None
    failures: int = 0
    missing: list[str] = field(default_factory=list)  # expected files that are absent
    bad_lines: int = 0  # unreadable JSONL lines (e.g. a run killed mid-write)


def _read_jsonl(path: Path, run: RunData) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line) if line.strip() else None
        except json.JSONDecodeError:
            run.bad_lines += 1
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) else None


def load_run(path: Path) -> RunData:
    """Read a run directory; raises :class:`RunDirError` when ``path`` is not one."""
    path = Path(path)
    if not path.is_dir():
        raise RunDirError(f"{path}: no such directory (expected a run directory written by posttrain train)")
    if not any((path / f).is_file() for f in RUN_FILES):
        raise RunDirError(
            f"{path} is not a run directory: it has none of {', '.join(RUN_FILES)} "
            "(give the --out directory of posttrain train)"
        )
    run = RunData(path)
    for name in ("config.toml", "metrics.jsonl", "samples.jsonl", "summary.json"):
        if not (path / name).is_file():
            run.missing.append(name)
    if (path / "config.toml").is_file():
        run.config = (path / "config.toml").read_text()
    if (path / "metrics.jsonl").is_file():
        run.metrics = [r for r in _read_jsonl(path / "metrics.jsonl", run) if isinstance(r.get("step"), int)]
    if (path / "samples.jsonl").is_file():
        run.samples = _read_jsonl(path / "samples.jsonl", run)
    run.summary = _read_json(path / "summary.json")
    run.eval = _read_json(path / "eval.json")
    if (path / "reward_failures.jsonl").is_file():
        run.failures = sum(1 for line in (path / "reward_failures.jsonl").read_text().splitlines() if line.strip())
    return run


def _labels(paths: list[Path]) -> list[str]:
    """Shortest distinct trailing part of each path (``name``, then ``parent/name``, then the path)."""
    for depth in (1, 2):
        labels = ["/".join(p.resolve().parts[-depth:]) for p in paths]
        if len(set(labels)) == len(labels):
            return labels
    return [str(p) for p in paths]


# --------------------------------------------------------------------------- data for the plots


def _final_metrics(run: RunData) -> tuple[dict, str]:
    """Held-out metrics at the end of the run: ``eval.json`` when present, else summary ``final``."""
    if run.eval and isinstance(run.eval.get("metrics"), dict):
        return run.eval["metrics"], "eval.json"
    if run.summary and isinstance(run.summary.get("final"), dict):
        return run.summary["final"], "summary.json"
    return {}, ""


def _at_k(metrics: dict) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {"pass": {}, "maj": {}}
    for key, v in metrics.items():
        m = re.fullmatch(r"(pass|maj)@(\d+)", key)
        if m and isinstance(v, int | float) and math.isfinite(v):
            out[m.group(1)][int(m.group(2))] = float(v)
    return out


def _confidences(runs: list[RunData]) -> tuple[np.ndarray, np.ndarray]:
    conf, correct = [], []
    for run in runs:
        for prob in (run.eval or {}).get("problems", []):
            for q, c in zip(prob.get("confidence") or [], prob.get("correct") or [], strict=False):
                if isinstance(q, int | float) and math.isfinite(q):
                    conf.append(min(max(float(q), 0.0), 1.0))
                    correct.append(float(bool(c)))
    return np.array(conf), np.array(correct)


# --------------------------------------------------------------------------- HTML pieces


CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 1.5em auto; max-width: 1280px; padding: 0 1em; color: #222; }
h1 { font-size: 1.5em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: .2em; margin-top: 2em; }
table { border-collapse: collapse; margin: .5em 0 1em; }
th, td { border: 1px solid #ddd; padding: .25em .5em; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.best td:first-child { color: #1a7f37; } tr.worst td:first-child { color: #c62828; }
td pre, details pre { margin: 0; white-space: pre-wrap; word-break: break-word; max-height: 14em; overflow: auto; }
details pre { max-height: 40em; background: #f8f8f8; padding: .5em; }
pre.transcript .trained { background: #dcefdc; } pre.transcript .context { color: #777; }
img.plot { max-width: 100%; height: auto; display: block; margin: .5em 0; }
p.missing { color: #8a6d00; background: #fff8e1; padding: .3em .6em; }
.meta { color: #666; }
"""


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode("ascii")
    return f'<img class="plot" alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def _missing(text: str) -> str:
    return f'<p class="missing">{escape(text)}</p>'


def _num(v: object, digits: int = 3) -> str:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return "–"
    if isinstance(v, int):
        return str(v)
    return f"{v:.{digits}f}" if math.isfinite(v) else str(v)


def _table(cls: str, header: list[str], rows: list[tuple[str, list[str]]]) -> str:
    """A table from already-escaped cells; ``rows`` are (row class, cells)."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        f'<tr class="{c}">' + "".join(cells) + "</tr>" if c else f"<tr>{''.join(cells)}</tr>" for c, cells in rows
    )
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _td(v: object, digits: int = 3) -> str:
    if isinstance(v, int | float) and not isinstance(v, bool):
        return f'<td class="num">{_num(v, digits)}</td>'
    return f"<td>{escape(str(v))}</td>"


def _runs_section(runs: list[RunData], group_of: dict[Path, str]) -> str:
    rows = []
    for run in runs:
        cfg = {}
        if run.config:
            try:
                cfg = tomllib.loads(run.config)
            except tomllib.TOMLDecodeError:
                pass
        algo = cfg.get("algorithm", {}) if isinstance(cfg.get("algorithm"), dict) else {}
        method = " / ".join(str(algo[k]) for k in ("advantage", "loss") if k in algo)
        final, _ = _final_metrics(run)
        summary = run.summary or {}
        steps = summary.get("steps", run.metrics[-1]["step"] if run.metrics else "–")
        notes = [f"missing {', '.join(run.missing)}"] if run.missing else []
        if run.bad_lines:
            notes.append(f"{run.bad_lines} unreadable JSONL line(s)")
        cells = [
            _td(run.label), _td(group_of.get(run.path, "")), _td(method or "–"), _td(steps),
            _td(summary.get("wall_s", "–"), 1), _td(final.get("pass@1", "–")),
            _td(run.failures), _td("; ".join(notes)), f"<td><code>{escape(str(run.path))}</code></td>",
        ]  # fmt: skip
        rows.append(("", cells))
    header = ["run", "group", "method", "steps", "wall s", "final pass@1", "reward failures", "notes", "path"]
    return '<section id="runs"><h2>Runs</h2>' + _table("runs", header, rows) + "</section>"


def _config_section(runs: list[RunData]) -> str:
    parts = ['<section id="config"><h2>Config</h2>']
    for i, run in enumerate(runs):
        if run.config is None:
            parts.append(_missing(f"{run.label}: no config.toml"))
            continue
        parts.append(
            f'<details class="config" id="config-{i}"><summary>{escape(run.label)}</summary>'
            f"<pre>{escape(run.config)}</pre></details>"
        )
    return "\n".join(parts) + "</section>"


def _curves_section(series: list[Series], runs: list[RunData]) -> str:
    parts = ['<section id="curves"><h2>Training curves</h2>']
    if any(len(s.runs) > 1 for s in series):
        parts.append('<p class="meta">Groups of runs: mean over seeds, shaded band from min to max.</p>')
    fig = curves_figure(series, KEY_METRICS)
    parts.append(_img(figure_png(fig), "key metrics against step and wall time") if fig else "")
    without = [r.label for r in runs if not r.metrics]
    if without:
        parts.append(_missing(f"no metrics.jsonl (or no rows) in: {', '.join(without)}"))
    if fig is None and not without:
        parts.append(_missing("none of the key metrics was logged"))
    return "\n".join(parts) + "</section>"


def _passk_section(members: dict[str, list[RunData]]) -> str:
    parts = ['<section id="pass-at-k"><h2>pass@k and maj@k (held-out, end of training)</h2>']
    data: dict[str, dict[str, dict[int, list[float]]]] = {}
    without: list[str] = []
    for label, runs in members.items():
        per: dict[str, dict[int, list[float]]] = {"pass": {}, "maj": {}}
        for run in runs:
            at = _at_k(_final_metrics(run)[0])
            if not at["pass"] and not at["maj"]:
                without.append(run.label)
            for metric, by_k in at.items():
                for k, v in by_k.items():
                    per[metric].setdefault(k, []).append(v)
        if per["pass"] or per["maj"]:
            data[label] = per
    ks = sorted({k for per in data.values() for by_k in per.values() for k in by_k})
    rows = []
    for label, per in data.items():
        sources = sorted({_final_metrics(r)[1] for r in members[label]} - {""})
        for metric, by_k in per.items():
            if by_k:
                cells = [_td(label), _td(f"{metric}@k")] + [_at_k_cell(by_k.get(k, [])) for k in ks]
                rows.append(("", [*cells, _td(max(map(len, by_k.values()))), _td(", ".join(sources))]))
    fig = passk_figure(data)
    if fig is not None:
        parts.append(_img(figure_png(fig, dpi=90), "pass@k and maj@k against k"))
        header = ["run / group", "metric", *(f"k={k}" for k in ks), "runs", "source"]
        parts.append(_table("pass-at-k", header, rows))
    if without:
        parts.append(_missing(f"no pass@k (summary.json 'final' or eval.json) in: {', '.join(without)}"))
    return "\n".join(parts) + "</section>"


def _at_k_cell(values: list[float]) -> str:
    if not values:
        return "<td>–</td>"
    if len(values) == 1:
        return _td(values[0])
    return f'<td class="num">{np.mean(values):.3f} [{min(values):.3f}, {max(values):.3f}]</td>'


def _calibration_section(members: dict[str, list[RunData]]) -> str:
    parts = ['<section id="calibration"><h2>Calibration</h2>']
    fig = calibration_figure({label: _confidences(runs) for label, runs in members.items()})
    if fig is None:
        parts.append(
            _missing(
                "no confidences: the calibration diagram needs eval.json (posttrain eval) with completions "
                "that state a <confidence>q</confidence>"
            )
        )
    else:
        parts.append(_img(figure_png(fig, dpi=90), "calibration (reliability) diagram"))
    return "\n".join(parts) + "</section>"


def _best_worst(samples: list[dict], n: int) -> list[tuple[str, dict]]:
    scored = [s for s in samples if isinstance(s.get("reward"), int | float) and math.isfinite(s["reward"])]
    step = [int(s.get("step") or 0) for s in scored]
    order = sorted(range(len(scored)), key=lambda i: (-scored[i]["reward"], -step[i], i))
    best = order[: min(n, math.ceil(len(order) / 2))]  # with few rows, half are best and half worst
    worst = sorted(order[len(best) :], key=lambda i: (scored[i]["reward"], -step[i], i))[:n]
    return [("best", scored[i]) for i in best] + [("worst", scored[i]) for i in worst]


def _samples_section(runs: list[RunData]) -> str:
    parts = [
        '<section id="samples"><h2>Sampled completions</h2>',
        f'<p class="meta">Per run, the {SAMPLES_SHOWN} best and {SAMPLES_SHOWN} worst logged completions by reward '
        "(from samples.jsonl; ties go to the later step).</p>",
    ]
    header = ["", "step", "reward", "advantage", "prompt", "completion", "answer"]
    for i, run in enumerate(runs):
        parts.append(f'<h3 id="samples-{i}">{escape(run.label)}</h3>')
        picked = _best_worst(run.samples, SAMPLES_SHOWN)
        if not picked:
            why = "no samples.jsonl" if "samples.jsonl" in run.missing else "samples.jsonl has no scored rows"
            parts.append(_missing(f"{run.label}: {why}"))
            continue
        rows = []
        for kind, s in picked:
            cells = [_td(kind), _td(s.get("step", "–")), _td(s.get("reward")), _td(s.get("advantage"))]
            cells += [f"<td><pre>{escape(str(s.get('prompt', '')))}</pre></td>", _completion_cell(s),
                      f"<td><pre>{escape(str(s.get('answer', '')))}</pre></td>"]
            rows.append((kind, cells))
        parts.append(_table("samples", header, rows))
    return "\n".join(parts) + "</section>"


def _completion_cell(sample: dict) -> str:
    """The completion; a multi-turn episode's ``transcript`` with the trained (sampled) tokens marked
    apart from the context the environment and the chat template added.
    """
    segments = sample.get("transcript")
    if not isinstance(segments, list) or not segments:
        return f"<td><pre>{escape(str(sample.get('completion', '')))}</pre></td>"
    spans = "".join(
        f'<span class="{"trained" if trained else "context"}">{escape(str(text))}</span>' for text, trained in segments
    )
    return f'<td><pre class="transcript">{spans}</pre></td>'


def _metrics_section(series: list[Series]) -> str:
    parts = ['<section id="metrics"><h2>All metrics by group</h2>']
    groups = metric_groups([r for s in series for rows in s.runs for r in rows])
    if not groups:
        parts.append(_missing("no metrics.jsonl rows to plot"))
    for group, keys in groups.items():
        fig = curves_figure(series, keys)
        if fig is not None:
            parts.append(
                f'<details class="metric-group" id="group-{escape(group)}" open><summary>{escape(group)} '
                f"({len(keys)} metrics)</summary>{_img(figure_png(fig), f'{group} metrics')}</details>"
            )
    return "\n".join(parts) + "</section>"


# --------------------------------------------------------------------------- the page


def write_report(
    run_dirs: list[Path],
    out: Path,
    *,
    groups: dict[str, list[Path]] | None = None,
    title: str | None = None,
) -> Path:
    """Write one self-contained HTML report about ``run_dirs`` to ``out`` and return ``out``.

    ``groups`` (label -> run directories, e.g. the seeds of one method) are drawn as one series
    each, a mean with a min-max band; runs of ``run_dirs`` in no group are one series each. Every
    run of both appears in the config, runs and samples sections. Raises :class:`RunDirError` for a
    path that is not a run directory, ``ValueError`` when no run is given.
    """
    groups = {label: [Path(p) for p in paths] for label, paths in (groups or {}).items()}
    ordered: list[Path] = []
    for p in [*map(Path, run_dirs), *(p for paths in groups.values() for p in paths)]:
        if p.resolve() not in {q.resolve() for q in ordered}:
            ordered.append(p)
    if not ordered:
        raise ValueError("write_report needs at least one run directory")
    runs = [load_run(p) for p in ordered]
    for run, label in zip(runs, _labels(ordered), strict=True):
        run.label = label
    by_path = {run.path.resolve(): run for run in runs}
    group_of = {by_path[p.resolve()].path: label for label, paths in groups.items() for p in paths}
    members: dict[str, list[RunData]] = {
        label: [by_path[p.resolve()] for p in paths] for label, paths in groups.items()
    }
    for run in runs:
        if run.path not in group_of:
            members[run.label if run.label not in members else f"{run.label} (run)"] = [run]
    series = [Series(label, [r.metrics for r in rs if r.metrics]) for label, rs in members.items()]
    title = title or f"posttrain report: {', '.join(members)}"
    generated = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    body = [
        f"<h1>{escape(title)}</h1>",
        f'<p class="meta">{len(runs)} run(s), generated {escape(generated)} by posttrain report.</p>',
        _runs_section(runs, group_of),
        _config_section(runs),
        _curves_section(series, runs),
        _passk_section(members),
        _calibration_section(members),
        _samples_section(runs),
        _metrics_section(series),
    ]
    html = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(html, encoding="utf-8")
    return out
