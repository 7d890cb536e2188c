"""Metric sinks: ``metrics.jsonl`` (always), TensorBoard (unless turned off), and Weights & Biases,
MLflow and Trackio when chosen in ``[log]`` (optional packages: ``pip install posttrain[wandb]`` /
``posttrain[mlflow]`` / ``posttrain[trackio]``; Trackio's sink is in :mod:`posttrain.reporting.trackio_sink`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

from posttrain.config import ConfigError
from posttrain.config.run import LogConfig
from posttrain.durable import fsync_path, write_atomic
from posttrain.reporting.trackio_sink import TrackioSink

MLFLOW_EXPERIMENT = "posttrain"
WANDB_ID_FILE = "wandb_run_id"
MLFLOW_ID_FILE = "mlflow_run_id"
MLFLOW_MAX_PARAM_VALUE = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
# the per-step logs the loop appends beside metrics.jsonl; a checkpoint syncs them with it (MetricSinks.sync)
SIDE_LOGS = ("samples.jsonl", "reward_failures.jsonl", "prompt_stats.jsonl")
MLFLOW_MAX_KEY = 250  # MAX_ENTITY_KEY_LENGTH, for metric, param and tag keys
MLFLOW_MAX_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH (metrics allow 1000; one bound keeps it simple)


class MetricSinks:
    """Writes one JSON object per step to ``metrics.jsonl`` and the scalars to the chosen trackers.

    ``start_step`` is the number of steps already completed (0 for a new run). On resume each sink
    holds every step once (steps re-run after a crash or a step back to an older checkpoint):

    - ``metrics.jsonl`` keeps only steps up to ``start_step`` (:func:`keep_steps`);
    - TensorBoard purges events from ``start_step + 1`` on (``purge_step``);
    - MLflow continues the run whose id is in ``run_dir/mlflow_run_id``, unless that run holds steps
      after ``start_step``: then a new run takes over its history up to ``start_step`` (see
      :meth:`_MlflowSink._continue`);
    - W&B continues the run in ``wandb_run_id``; W&B drops a step below the run's current one ("Tried
      to log to step ... less than the current step", a warning), so a re-run step keeps the value
      first logged there (the same one where the run is deterministic) and later steps follow;
    - Trackio continues the run in ``trackio_run_id``, or, like MLflow, hands its history up to
      ``start_step`` to a new run (see :class:`TrackioSink`).

    A new run (``start_step == 0``) starts new W&B, MLflow and Trackio runs. ``config`` (the run's config
    as JSON-able dict) is the W&B and Trackio config and the MLflow params. A failing Trackio warns once
    and stops logging; the run goes on.
    """

    def __init__(
        self,
        run_dir: Path,
        log: LogConfig,
        start_step: int = 0,
        config: dict[str, Any] | None = None,
        name: str | None = None,
    ) -> None:
        run_dir = Path(run_dir).resolve()
        # import the optional packages first, so a missing one fails before anything is opened
        wandb = _optional("wandb", "log.wandb") if log.wandb else None
        mlflow = _optional("mlflow", "log.mlflow") if log.mlflow else None
        trackio = _optional("trackio", "log.trackio") if log.trackio else None
        self.path = run_dir / "metrics.jsonl"
        keep_steps(self.path, start_step, one_per_step=True)
        self._file = self.path.open("a")
        self._synced = False  # sync() fsynced the run directory (metrics.jsonl's entry in it)
        self._tb = None
        if log.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None
            )
        name = name or run_dir.name
        self._wandb = _WandbSink(wandb, run_dir, log, start_step, config, name) if wandb else None
        self._mlflow = _MlflowSink(mlflow, run_dir, log, start_step, config, name) if mlflow else None
        self._trackio = (
            TrackioSink(trackio, run_dir, log.trackio_project, start_step, config, name) if trackio else None
        )

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Record the metrics of ``step``."""
        row = {"step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        if self._tb is not None:
            for k, v in metrics.items():
                if isinstance(v, int | float) and math.isfinite(v):
                    self._tb.add_scalar(k, v, step)
        finite = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
        if self._wandb is not None:
            self._wandb.write(step, finite)
        if self._mlflow is not None:
            self._mlflow.write(step, finite)
        if self._trackio is not None:
            self._trackio.write(step, finite)

    def sync(self) -> None:
        """Make every ``metrics.jsonl`` line written so far durable (fsync). The harness calls it before each
        checkpoint: a resume trims the file to the checkpoint's step, and a power loss must not take lines
        that the checkpoint counts as logged (``flush`` alone survives a killed process, not a power loss).
        The side logs the loop appends to (:data:`SIDE_LOGS`) are synced with it.
        """
        if self._file.closed:
            return
        self._file.flush()
        os.fsync(self._file.fileno())
        for name in SIDE_LOGS:  # appended to and closed by the loop each step: their bytes too
            fsync_path(self.path.parent / name)
        if not self._synced:  # the file's directory entry too, once (a new run's file is new)
            self._synced = True
            fsync_path(self.path.parent)

    def close(self) -> None:
        """Flush and close (a second call does nothing)."""
        if self._file.closed:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close()
        if self._mlflow is not None:
            self._mlflow.close()
        if self._trackio is not None:
            self._trackio.close()


class _WandbSink:
    """One W&B run per training run; offline mode writes ``<run>/wandb/offline-run-*`` and needs no
    network or API key (``wandb sync`` uploads it later).
    """

    def __init__(
        self, wandb: ModuleType, run_dir: Path, log: LogConfig, start_step: int, config: dict | None, name: str
    ) -> None:
        run_id = _run_id(run_dir / WANDB_ID_FILE, start_step, lambda: uuid.uuid4().hex[:12])
        env = {"WANDB_SILENT": "true"} | ({"WANDB_MODE": "offline"} if log.wandb_mode == "offline" else {})
        with _environ(env):
            self.run = wandb.init(
                project=log.wandb_project,
                dir=str(run_dir),
                mode=log.wandb_mode,
                config=config,
                name=name,
                id=run_id,
                resume="allow",
                settings=wandb.Settings(silent=True),
            )
        (run_dir / WANDB_ID_FILE).write_text(run_id + "\n")

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def close(self) -> None:
        self.run.finish()


class _MlflowSink:
    """One MLflow run per training run in experiment ``posttrain``; the default tracking URI is a file
    store in ``<run>/mlruns``. Uses ``MlflowClient`` (no global active run).
    """

    def __init__(
        self, mlflow: ModuleType, run_dir: Path, log: LogConfig, start_step: int, config: dict | None, name: str
    ) -> None:
        from mlflow.entities import Metric, Param, RunTag
        from mlflow.exceptions import MlflowException

        self._metric = Metric
        uri = log.mlflow_uri or (run_dir / "mlruns").as_uri()
        if uri.startswith("file:") or "://" not in uri:
            # MLflow >= 3.7 refuses the (maintenance-mode) file store unless asked for; it is our default
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.uri = uri
        self.client = client = mlflow.MlflowClient(tracking_uri=uri)
        exp = client.get_experiment_by_name(MLFLOW_EXPERIMENT)
        exp_id = exp.experiment_id if exp is not None else client.create_experiment(MLFLOW_EXPERIMENT)
        id_file = run_dir / MLFLOW_ID_FILE
        old = id_file.read_text().strip() if start_step and id_file.exists() else None
        run = None
        if old:
            try:
                run = client.get_run(old)
            except MlflowException:  # the store moved or was deleted: start a new run
                run = None
        if run is None:
            run = client.create_run(exp_id, run_name=name)
        else:
            run = self._continue(run, exp_id, start_step, name)
        self.run_id = run.info.run_id
        id_file.write_text(self.run_id + "\n")
        # params are immutable: log only the new keys; a value changed on resume goes to a tag
        logged = run.data.params
        flat = {mlflow_key(k): v[:MLFLOW_MAX_PARAM_VALUE] for k, v in _flatten(config or {}).items()}
        params = [Param(k, v) for k, v in flat.items() if k not in logged]
        tags = [RunTag(mlflow_key(f"resumed.{k}"), v) for k, v in flat.items() if k in logged and logged[k] != v]
        for i in range(0, len(params), MLFLOW_MAX_BATCH):
            client.log_batch(self.run_id, params=params[i : i + MLFLOW_MAX_BATCH])
        for i in range(0, len(tags), MLFLOW_MAX_BATCH):
            client.log_batch(self.run_id, tags=tags[i : i + MLFLOW_MAX_BATCH])

    def _continue(self, run: Any, exp_id: str, start_step: int, name: str) -> Any:
        """The run to go on logging into when resuming at ``start_step``: the same run, or, when it holds
        steps after ``start_step`` (a crash after logging them, or a resume from an earlier checkpoint)
        or a step twice, a new run holding its history up to ``start_step`` once. MLflow keeps every
        value logged at a step and has no way to remove one, so continuing the old run would show the
        re-run steps twice; the old run is kept, marked ``KILLED`` and tagged ``posttrain.superseded_by``.
        """
        old_id = run.info.run_id
        kept, rewind = _history_upto(self.client, run, start_step)
        if not rewind:
            self.client.update_run(old_id, status="RUNNING")
            return run
        tags = {"posttrain.continues": old_id, "posttrain.resumed_at_step": str(start_step)}
        new = self.client.create_run(exp_id, run_name=name, tags=tags)
        for i in range(0, len(kept), MLFLOW_MAX_BATCH):
            self.client.log_batch(new.info.run_id, metrics=kept[i : i + MLFLOW_MAX_BATCH])
        self.client.set_tag(old_id, "posttrain.superseded_by", new.info.run_id)
        self.client.set_terminated(old_id, "KILLED")
        return new

    def write(self, step: int, metrics: dict[str, float]) -> None:
        ts = int(time.time() * 1000)
        rows = [self._metric(mlflow_key(k), v, ts, step) for k, v in metrics.items()]
        for i in range(0, len(rows), MLFLOW_MAX_BATCH):
            self.client.log_batch(self.run_id, metrics=rows[i : i + MLFLOW_MAX_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id, "FINISHED")


def _history_upto(client: Any, run: Any, start_step: int) -> tuple[list, bool]:
    """The run's metric history up to ``start_step``, one value per (metric, step) (the last logged),
    and whether the run holds more than that (a step after ``start_step``, or a step logged twice).
    """
    kept, more = [], False
    for key in run.data.metrics:
        by_step: dict[int, Any] = {}
        for m in client.get_metric_history(run.info.run_id, key):
            more = more or m.step > start_step or m.step in by_step
            if m.step <= start_step and (m.step not in by_step or m.timestamp >= by_step[m.step].timestamp):
                by_step[m.step] = m
        kept += sorted(by_step.values(), key=lambda m: m.step)
    return kept, more


def mlflow_key(key: str) -> str:
    """Map a metric or param name to MLflow's allowed characters: ASCII alphanumerics, ``_ - . / space``.

    ``@`` becomes ``_at_`` ("eval/pass@1" -> "eval/pass_at_1"), any other disallowed character
    (``:`` too, which Windows rejects) becomes ``_``; empty, ``.`` and ``..`` path segments are
    dropped (MLflow rejects names that normalize to another path); at most 250 characters.
    """
    key = re.sub(r"[^A-Za-z0-9_\-. /]", "_", key.replace("@", "_at_"))
    key = "/".join(p for p in key.split("/") if p not in ("", ".", ".."))
    return (key or "_")[:MLFLOW_MAX_KEY]


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> ``{"train.lr": "0.001", "reward.0.name": "task", "train.betas": "[0.9, 0.99]"}``.

    Dicts and lists of dicts are flattened (list items by index); other values are JSON, strings as is.
    """
    out: dict[str, str] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flatten(v, key + "."))
        elif isinstance(v, list) and any(isinstance(x, dict) for x in v):
            out.update(_flatten({str(i): x for i, x in enumerate(v)}, key + "."))
        else:
            out[key] = v if isinstance(v, str) else json.dumps(v)
    return out


def _optional(module: str, key: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{key}=true needs the {module} package, which is not installed: pip install posttrain[{module}]"
        ) from None


def _run_id(path: Path, start_step: int, new: Callable[[], str]) -> str:
    """The id stored in ``path`` when resuming (``start_step > 0``), else a new one."""
    if start_step and path.exists():
        return path.read_text().strip() or new()
    return new()


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """Set environment variables for the duration of the block, then restore them."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def keep_steps(path: Path, start_step: int, one_per_step: bool = False) -> None:
    """On resume: keep only the lines of a per-step JSONL log (a ``"step"`` key) up to
    ``start_step``, so steps re-run after a crash (or after a resume from an earlier checkpoint)
    are not logged twice; a line cut short by the crash goes too. ``one_per_step`` (a log of one
    line a step, ``metrics.jsonl``): of a step found on several lines (a log written before this
    rule) only the last stays. Nothing to do when the file does not exist. The file is replaced
    atomically: a crash here leaves the old one.
    """
    if not path.exists():
        return
    for left in path.parent.glob(f"{path.name}.tmp-*"):  # a copy a kill cut short before its rename: stale
        left.unlink(missing_ok=True)
    text = path.read_text(errors="replace")  # a power loss can leave garbage bytes: those lines are dropped
    rows = [(s, line) for line in text.splitlines() if (s := _step(line)) <= start_step]
    last = {s: i for i, (s, _) in enumerate(rows)}
    kept = "".join(line + "\n" for i, (s, line) in enumerate(rows) if not one_per_step or last[s] == i)
    write_atomic(path, lambda tmp: tmp.write_text(kept))  # the cut copy is on disk before it replaces the original


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62


def _clean(v: float) -> float | None:
    return v if not isinstance(v, float) or math.isfinite(v) else None


def read_metrics(path: Path) -> list[dict]:
    """Read ``metrics.jsonl`` rows."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
