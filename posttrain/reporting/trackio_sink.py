"""Trackio sink (``log.trackio``): Hugging Face's local-first tracker, the one TRL logs to.

Trackio keeps one SQLite database per project, ``<TRACKIO_DIR>/<project>.db``; ``TRACKIO_DIR`` is read
once, when ``trackio`` is first imported (default ``$HF_HOME/trackio``, ``~/.cache/huggingface/trackio``),
so set it in the environment, not from here. ``trackio show --project posttrain`` serves the dashboard.

The sink is local only, whatever the environment says: ``TRACKIO_SPACE_ID``, ``TRACKIO_SERVER_URL``,
``TRACKIO_BUCKET_ID``, ``TRACKIO_DATASET_ID`` and ``TRACKIO_WEBHOOK_URL`` are hidden from ``trackio.init``
(they would send the metrics to a Space, a server or a webhook), the Hub is offline during ``init``
(trackio asks the Hub who the user is when an HF token is set), no dashboard is launched
(``embed=False``) and no system-metrics thread is started (``auto_log_cpu/gpu=False``).

Trackio is an extra: when it fails (an unwritable ``TRACKIO_DIR``, an exception from ``init``, ``log`` or
``finish``) the run goes on, with one ``RuntimeWarning``, and ``metrics.jsonl`` still has every step.
Trackio also catches most of its own errors and reports each kind once as a ``UserWarning``.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

TRACKIO_ID_FILE = "trackio_run_id"
# environment variables that make trackio.init log somewhere else than the local database
REMOTE_ENV = (
    "TRACKIO_SPACE_ID",
    "TRACKIO_SERVER_URL",
    "TRACKIO_BUCKET_ID",
    "TRACKIO_DATASET_ID",
    "TRACKIO_WEBHOOK_URL",
)


class TrackioSink:
    """One trackio run per training run, named like the run directory, in project ``log.trackio_project``.

    ``start_step == 0`` starts a new trackio run (even where one of the same name exists: trackio keeps
    both, ``trackio_run_id`` names ours). On resume the run in ``run_dir/trackio_run_id`` goes on, unless
    it holds steps after ``start_step`` or a step twice (a crash after logging them, or a resume from
    an earlier checkpoint; trackio keeps every value logged at a step and cannot remove one) or is no
    longer the newest run of its name (``trackio.init`` resumes by name, and another run directory of
    the same name started since): then a new run of that name takes over its history up to
    ``start_step`` (one value a step, the last) and the old run is renamed ``<name>.superseded-<id8>``
    and kept, as the MLflow sink does.
    """

    def __init__(
        self,
        trackio: ModuleType,
        run_dir: Path,
        project: str,
        start_step: int,
        config: dict[str, Any] | None,
        name: str,
    ) -> None:
        self._trackio = trackio
        self.run: Any = None
        self._failed = False
        try:
            with _local_only(), _quiet():
                self.run = self._open(run_dir, project, start_step, config, name)
        except Exception as error:  # noqa: BLE001 - any trackio failure must not stop training
            self._fail("start its run", error)

    def _open(self, run_dir: Path, project: str, start_step: int, config: dict | None, name: str) -> Any:
        from trackio.sqlite_storage import SQLiteStorage

        id_file = run_dir / TRACKIO_ID_FILE
        old_id = id_file.read_text().strip() if start_step and id_file.exists() else ""
        logs = SQLiteStorage.get_logs(project, run_id=old_id) if old_id else []
        kept, dropped = _history_upto(logs, start_step)
        # trackio resumes the newest run of a name: another run directory of the same name may own it now
        newest = SQLiteStorage.get_latest_run_record_by_name(project, name) if old_id else None
        goes_on = bool(old_id) and not dropped and newest is not None and newest["id"] == old_id
        if logs and not goes_on:
            SQLiteStorage.rename_run(project, name, f"{name}.superseded-{old_id[:8]}", run_id=old_id)
        self.run = run = self._trackio.init(
            project=project,
            name=name,
            config=config,
            resume="allow" if goes_on else "never",
            embed=False,
            auto_log_cpu=False,
            auto_log_gpu=False,
        )
        for step, metrics in () if goes_on else kept:
            run.log(metrics, step=step)
        id_file.write_text(run.id + "\n")
        return run

    def write(self, step: int, metrics: dict[str, float]) -> None:
        """Log the (finite, float) metrics of ``step``; after a failure, nothing."""
        if self.run is None:
            return
        try:
            self.run.log(metrics, step=step)
        except Exception as error:  # noqa: BLE001
            self._fail(f"log step {step}", error)

    def close(self) -> None:
        """Finish the run (trackio's writer thread flushes to the database); a second call does nothing."""
        run, self.run = self.run, None
        if run is None:
            return
        try:
            self._finish(run)
        except Exception as error:  # noqa: BLE001
            self._fail("finish its run", error)

    def _finish(self, run: Any) -> None:
        try:
            with _quiet():
                run.finish()
        finally:
            # trackio finishes its current run again at exit (and prints); ours is done
            current = getattr(getattr(self._trackio, "context_vars", None), "current_run", None)
            if current is not None and current.get() is run:
                current.set(None)

    def _fail(self, what: str, error: Exception) -> None:
        """Warn (once: the sink logs nothing more after its first failure) and go on without trackio."""
        run, self.run = self.run, None
        if run is not None:
            with contextlib.suppress(Exception):
                self._finish(run)  # stop its writer thread; a failure here adds nothing to say
        if self._failed:
            return
        self._failed = True
        warnings.warn(
            f"log.trackio: trackio failed to {what} ({type(error).__name__}: {error}); training goes on "
            "without trackio (metrics.jsonl has every step)",
            RuntimeWarning,
            stacklevel=3,
        )


def _history_upto(logs: list[dict[str, Any]], start_step: int) -> tuple[list[tuple[int, dict]], int]:
    """The rows of trackio's ``get_logs`` up to ``start_step``, one a step (the last logged, in step
    order), and how many rows that leaves out (a step after ``start_step``, or a step logged twice).
    """
    by_step: dict[int, dict] = {}
    for row in logs:  # trackio returns them in the order logged
        if row["step"] <= start_step:
            by_step[row["step"]] = {k: v for k, v in row.items() if k not in ("step", "timestamp")}
    return sorted(by_step.items()), len(logs) - len(by_step)


@contextlib.contextmanager
def _local_only() -> Iterator[None]:
    """Keep ``trackio.init`` off the network: hide :data:`REMOTE_ENV` and put the Hub client offline
    (``huggingface_hub`` reads ``HF_HUB_OFFLINE`` once, at import, hence the module flag).
    """
    import huggingface_hub.constants as hub

    hidden = {k: os.environ.pop(k) for k in REMOTE_ENV if k in os.environ}
    offline, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = offline
        os.environ.update(hidden)


def _quiet() -> contextlib.AbstractContextManager:
    """Trackio prints its banner and "Run finished" lines to stdout, through our progress bar."""
    return contextlib.redirect_stdout(io.StringIO())
