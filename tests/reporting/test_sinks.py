"""Metric sinks: metrics.jsonl, W&B offline and MLflow file store, each read back from disk."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
import time
from pathlib import Path

import pytest
from rich.console import Console

from posttrain.config import ConfigError
from posttrain.config.run import LogConfig
from posttrain.reporting.sinks import MetricSinks, _flatten, mlflow_key, read_metrics

NAN = float("nan")
STEPS = {1: {"reward/mean": 0.5, "eval/pass@1": 0.25, "bad": NAN}, 2: {"reward/mean": 0.75, "eval/pass@1": 0.5}}
CONFIG = {"train": {"lr": 0.001, "betas": [0.9, 0.99]}, "reward": [{"name": "task", "params": {}}], "note": "x" * 7000}


def _log(**kw) -> LogConfig:
    return LogConfig(tensorboard=False, progress=False, **kw)


def _write(sinks: MetricSinks, steps: dict[int, dict[str, float]]) -> None:
    for step, metrics in steps.items():
        sinks.write(step, metrics)
    sinks.close()


@pytest.fixture
def wandb_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep W&B's settings and caches out of the user's home; no API key, no network."""
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)


def test_jsonl_nonfinite_as_null_and_trimmed_on_resume(tmp_path: Path):
    _write(MetricSinks(tmp_path, _log()), STEPS | {3: {"reward/mean": 1.0}})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]
    assert read_metrics(tmp_path / "metrics.jsonl")[0]["bad"] is None
    # resumed from the step-2 checkpoint: step 3 is re-run, so its old row goes
    _write(MetricSinks(tmp_path, _log(), start_step=2), {3: {"reward/mean": 2.0}})
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.5), (2, 0.75), (3, 2.0)]


def test_mlflow_key_mapping():
    assert mlflow_key("eval/pass@1") == "eval/pass_at_1"
    assert mlflow_key("reward/task:exact/mean") == "reward/task_exact/mean"
    assert mlflow_key("a//b/./c/") == "a/b/c"  # MLflow rejects names that normalize to another path
    assert mlflow_key("time/step_s-1.0 x") == "time/step_s-1.0 x"  # allowed characters are kept
    assert len(mlflow_key("k" * 300)) == 250


def test_flatten_config():
    flat = _flatten(CONFIG)
    assert flat["train.lr"] == "0.001"
    assert flat["train.betas"] == "[0.9, 0.99]"  # a list of scalars is one value
    assert flat["reward.0.name"] == "task"  # a list of tables is indexed
    assert flat["reward.0.params"] == "{}"


def test_missing_package_is_a_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ConfigError, match=r"pip install posttrain\[wandb\]"):
        MetricSinks(tmp_path, _log(wandb=True))
    with pytest.raises(ConfigError, match=r"pip install posttrain\[mlflow\]"):
        MetricSinks(tmp_path, _log(mlflow=True))
    assert not (tmp_path / "metrics.jsonl").exists()  # nothing opened before the check


# --- Weights & Biases (offline) -----------------------------------------------------------------


def _wandb_records(path: Path) -> list:
    """Records of a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then LevelDB-log
    style chunks (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks,
    each record a ``wandb_internal_pb2.Record``. wandb >= 0.19 ships no Python reader of its own.
    """
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, buf, out = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = block - pos % block
        _crc, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (n == 0 and kind == 0):  # block trailer padding
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + n], pos + 7 + n
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            out.append(record)
    return out


def _wandb_history(run_dir: Path, want_steps: int = 0) -> tuple[set[str], dict[int, dict[str, float]]]:
    """Run ids and ``{step: metrics}`` of every offline run under ``run_dir/wandb``; waits (up to
    10 s) until ``want_steps`` steps are there: wandb's service process writes the file after
    ``finish()`` returns.
    """
    deadline = time.monotonic() + 10
    while True:
        ids, history = _wandb_read(run_dir)
        if len(history) >= want_steps or time.monotonic() > deadline:
            return ids, history
        time.sleep(0.1)


def _wandb_read(run_dir: Path) -> tuple[set[str], dict[int, dict[str, float]]]:
    ids, history = set(), {}
    for f in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for r in _wandb_records(f):
            if r.HasField("run"):
                ids.add(r.run.run_id)
            if r.HasField("history"):
                row = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item}
                history[row.pop("_step")] = {k: v for k, v in row.items() if not k.startswith("_")}
    return ids, history


def test_wandb_offline_logs_and_resumes_the_same_run(tmp_path: Path, wandb_home: None):
    pytest.importorskip("wandb", reason="wandb not installed (pip install posttrain[wandb])")
    env = {k: os.environ.get(k) for k in ("WANDB_MODE", "WANDB_SILENT")}
    _write(MetricSinks(tmp_path, _log(wandb=True), config=CONFIG), STEPS)
    assert {k: os.environ.get(k) for k in env} == env  # set only for the duration of init
    run_id = (tmp_path / "wandb_run_id").read_text().strip()
    ids, history = _wandb_history(tmp_path, want_steps=2)
    assert ids == {run_id}
    assert history == {1: {"reward/mean": 0.5, "eval/pass@1": 0.25}, 2: {"reward/mean": 0.75, "eval/pass@1": 0.5}}

    _write(MetricSinks(tmp_path, _log(wandb=True), start_step=2, config=CONFIG), {3: {"reward/mean": 1.0}})
    ids, history = _wandb_history(tmp_path, want_steps=3)
    assert ids == {run_id} and history[3] == {"reward/mean": 1.0}
    assert len(list((tmp_path / "wandb").glob("offline-run-*"))) == 2  # one directory per process, one id


# --- MLflow (local file store) ------------------------------------------------------------------


def _mlflow_history(run_dir: Path, key: str) -> list[tuple[int, float]]:
    from mlflow import MlflowClient

    client = MlflowClient((run_dir / "mlruns").as_uri())
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_mlflow_logs_params_metrics_and_resumes_the_same_run(tmp_path: Path):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install posttrain[mlflow])")
    from mlflow import MlflowClient

    _write(MetricSinks(tmp_path, _log(mlflow=True), config=CONFIG), STEPS)
    client = MlflowClient((tmp_path / "mlruns").as_uri())
    run_id = (tmp_path / "mlflow_run_id").read_text().strip()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == tmp_path.name
    assert client.get_experiment(run.info.experiment_id).name == "posttrain"
    assert run.data.params["train.lr"] == "0.001" and len(run.data.params["note"]) == 6000
    assert _mlflow_history(tmp_path, "reward/mean") == [(1, 0.5), (2, 0.75)]
    assert _mlflow_history(tmp_path, "eval/pass_at_1") == [(1, 0.25), (2, 0.5)]
    assert "bad" not in run.data.metrics  # non-finite values are dropped

    # resume from step 2 with a changed value: same run, the param stays, the new value is a tag
    changed = CONFIG | {"train": {"lr": 0.002, "betas": [0.9, 0.99]}}
    _write(MetricSinks(tmp_path, _log(mlflow=True), start_step=2, config=changed), {3: {"reward/mean": 1.0}})
    assert (tmp_path / "mlflow_run_id").read_text().strip() == run_id
    run = client.get_run(run_id)
    assert run.data.params["train.lr"] == "0.001" and run.data.tags["resumed.train.lr"] == "0.002"
    assert _mlflow_history(tmp_path, "reward/mean") == [(1, 0.5), (2, 0.75), (3, 1.0)]

    # a fresh start in the same directory is a new run
    _write(MetricSinks(tmp_path, _log(mlflow=True), config=CONFIG), {1: {"reward/mean": 0.0}})
    assert (tmp_path / "mlflow_run_id").read_text().strip() != run_id


def test_rl_train_logs_to_mlflow(tiny_cfg):
    pytest.importorskip("mlflow", reason="mlflow not installed (pip install posttrain[mlflow])")
    from posttrain.train.rl import train

    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", "log.mlflow=true")
    train(cfg, console=Console(quiet=True))
    history = _mlflow_history(Path(cfg.out), "reward/mean")
    assert [s for s, _ in history] == [1, 2] and all(math.isfinite(v) for _, v in history)
