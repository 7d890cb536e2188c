"""Metric sinks: ``metrics.jsonl`` (always) and TensorBoard event files (when enabled)."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricSinks:
    """Writes one JSON object per step to ``metrics.jsonl`` and scalars to TensorBoard.

    ``start_step`` is the number of steps already completed (0 for a new run). On resume the JSONL
    file keeps only steps up to ``start_step``, so a step re-run after a crash is not logged twice.
    """

    def __init__(self, run_dir: Path, tensorboard: bool, start_step: int = 0) -> None:
        self.path = run_dir / "metrics.jsonl"
        if self.path.exists():
            kept = [line for line in self.path.read_text().splitlines() if _step(line) <= start_step]
            self.path.write_text("".join(line + "\n" for line in kept))
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(
                str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None
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

    def close(self) -> None:
        """Flush and close."""
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _step(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError):
        return 1 << 62


def _clean(v: float) -> float | None:
    return v if not isinstance(v, float) or math.isfinite(v) else None


def read_metrics(path: Path) -> list[dict]:
    """Read ``metrics.jsonl`` rows."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
