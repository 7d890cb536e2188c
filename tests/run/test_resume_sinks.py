"""After a resume every metric sink holds each step once: metrics.jsonl and MLflow (file store)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.config.run import LogConfig
from posttrain.reporting.sinks import MetricSinks, keep_steps, read_metrics


def _log(**kw) -> LogConfig:
    return LogConfig(tensorboard=False, progress=False, **kw)


def _write(sinks: MetricSinks, steps: dict[int, float]) -> None:
    for step, value in steps.items():
        sinks.write(step, {"reward/mean": value})
    sinks.close()


def test_keep_steps_cuts_to_the_resumed_step_and_keeps_each_step_once(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    # a log from before this rule: steps 2-3 re-run once already (their second rows are the newer ones),
    # then a crash after logging step 5 and a line cut short
    lines = [{"step": 1, "v": "a"}, {"step": 2, "v": "a"}, {"step": 3, "v": "a"}, {"step": 2, "v": "b"},
             {"step": 3, "v": "b"}, {"step": 4, "v": "b"}, {"step": 5, "v": "b"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 6, "v"')
    text = path.read_text()
    keep_steps(path, 4)  # a log of several lines a step (prompt_stats.jsonl): only cut
    assert [(r["step"], r["v"]) for r in read_metrics(path)] == [(r["step"], r["v"]) for r in lines[:6]]
    path.write_text(text)
    keep_steps(path, 4, one_per_step=True)  # metrics.jsonl, resumed from the step-4 checkpoint
    assert [(r["step"], r["v"]) for r in read_metrics(path)] == [(1, "a"), (2, "b"), (3, "b"), (4, "b")]
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl"]  # replaced atomically, no temp file left


def _history(run_dir: Path, run_id: str, key: str = "reward/mean") -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient((run_dir / "mlruns").as_uri())
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_mlflow_after_a_step_back_holds_each_step_once(tmp_path: Path):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install posttrain[mlflow])")
    from mlflow import MlflowClient

    _write(MetricSinks(tmp_path, _log(mlflow=True)), {1: 0.1, 2: 0.2, 3: 0.3, 4: 0.4})
    first = (tmp_path / "mlflow_run_id").read_text().strip()
    # resumed from the step-2 checkpoint (step 4's was damaged, or the run crashed before it): MLflow
    # cannot remove logged values, so a new run takes over steps 1-2 and the re-run steps follow once
    _write(MetricSinks(tmp_path, _log(mlflow=True), start_step=2), {3: 3.0, 4: 4.0})
    second = (tmp_path / "mlflow_run_id").read_text().strip()
    assert second != first
    assert _history(tmp_path, second) == [(1, 0.1), (2, 0.2), (3, 3.0), (4, 4.0)]
    assert _history(tmp_path, first) == [(1, 0.1), (2, 0.2), (3, 0.3), (4, 0.4)]  # kept, not deleted
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    old, new = client.get_run(first), client.get_run(second)
    assert old.info.status == "KILLED" and old.data.tags["posttrain.superseded_by"] == second
    assert new.data.tags["posttrain.continues"] == first and new.data.tags["posttrain.resumed_at_step"] == "2"
    # a resume at the step the run ends on continues the same run
    _write(MetricSinks(tmp_path, _log(mlflow=True), start_step=4), {5: 5.0})
    assert (tmp_path / "mlflow_run_id").read_text().strip() == second
    assert [s for s, _ in _history(tmp_path, second)] == [1, 2, 3, 4, 5]
