"""Recorded batches (``log.record_batches``): each step's produced batch, kept so that
``posttrain replay RUN --step N`` can re-run that step's prepare and update exactly.

The loop hands the :class:`BatchRecorder` what the produce phase handed prepare (the :class:`Batch`:
token ids, masks, rewards, behaviour log-probs, policy versions, ...), the pipeline's metrics for it,
the loop state the step started from (``entry_states`` of the stateful components, step, cursor,
version; not the pipeline's batches sampled ahead, which a checkpoint holds) and the global RNG state
at that moment (what prepare and the update draw from next). It goes to ``RUN/batches/step_N.pt``
(``N`` as ``metrics.jsonl`` counts steps, from 1), written into a temporary file, made durable and
renamed into place, so that a kill leaves the previous file or none, never half of one; a resumed run
that re-runs a step replaces its file.

Replaying reads the file back with :func:`load_record` and gives the loop a :class:`RecordedBatch` in
place of its rollout pipeline: the same ``take`` call hands prepare the recorded batch, with the RNG
put back where it was, so the loop's own step (``train/rl.py``'s ``_step``) runs unchanged.

Disk cost: the batch's tensors (a few ``[N, T]`` tensors of ``P * G`` rows), its prompts and texts,
and the RNG state (about 5 KB); the recorder measures the first file and prints bytes per step and
the total for the run's planned steps.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, is_dataclass
from pathlib import Path

import torch
from rich.console import Console
from torch import Tensor

from posttrain.durable import write_atomic
from posttrain.errors import ConfigError
from posttrain.produce.batch import Batch
from posttrain.run.checkpoint import rng_state, set_rng_state

BATCHES = "batches"  # RUN/batches/step_000003.pt
FORMAT = 1
_FILE = re.compile(r"step_(\d+)\.pt")


def batch_path(run: Path, step: int) -> Path:
    """Where step ``step``'s batch is recorded (``step`` counted from 1, as in ``metrics.jsonl``)."""
    return Path(run) / BATCHES / f"step_{step:06d}.pt"


def recorded_steps(run: Path) -> list[int]:
    """The steps with a recorded batch in ``RUN/batches``, ascending."""
    root = Path(run) / BATCHES
    if not root.is_dir():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _FILE.fullmatch(p.name)))


def _write_atomic(path: Path, payload: dict) -> int:
    """``torch.save`` into ``path.tmp-<pid>``, fsync, rename into place; returns the bytes written."""
    return write_atomic(path, lambda tmp: torch.save(payload, tmp))


class BatchRecorder:
    """Writes each step's batch beside the checkpoints; see the module docstring."""

    def __init__(self, run: Path, total_steps: int, console: Console) -> None:
        self.root = Path(run) / BATCHES
        self.total, self.console = total_steps, console
        self.measured = False

    @classmethod
    def for_run(cls, record: bool, run: Path, total_steps: int, console: Console) -> BatchRecorder | None:
        """A recorder when ``log.record_batches`` is on (``record``), else None (the loop records nothing)."""
        if not record:
            return None
        console.print(f"recording every step's batch into {Path(run) / BATCHES} (log.record_batches; for "
                      "`posttrain replay`); its size per step is printed after the first step")
        return cls(run, total_steps, console)

    def write(self, loop_state: object, batch: Batch, pipe_metrics: Mapping[str, float]) -> Path:
        """Record the batch of the step that starts from ``loop_state`` (a dataclass: ``step`` completed
        steps, its stateful components' ``entry_states``, ...), with the RNG state of this moment.
        """
        loop = asdict(loop_state) if is_dataclass(loop_state) else dict(loop_state)
        loop.pop("pipeline", None)  # batches sampled ahead: the checkpoint's, not this step's
        step = int(loop["step"]) + 1
        self.root.mkdir(parents=True, exist_ok=True)
        path = batch_path(self.root.parent, step)
        payload = {"record_format": FORMAT, "step": step, "loop": loop, "batch": batch,
                   "pipe_metrics": dict(pipe_metrics), "rng": rng_state()}
        size = _write_atomic(path, payload)
        if not self.measured:
            self.measured = True
            total = size * self.total / 2**20
            self.console.print(f"log.record_batches: {size / 2**10:.1f} KiB per step ({path.name}); about "
                               f"{total:.1f} MiB for {self.total} steps in {self.root}")
        return path


def load_record(run: Path, step: int) -> dict:
    """Step ``step``'s recorded batch, or a :class:`ConfigError` saying what the run holds instead."""
    run = Path(run)
    path = batch_path(run, step)
    if not path.is_file():
        steps = recorded_steps(run)
        if not steps:
            raise ConfigError(f"replay: {run} holds no recorded batches ({run / BATCHES} is missing or empty): "
                              "the run was not trained with log.record_batches = true")
        raise ConfigError(f"replay: no recorded batch for step {step} in {run / BATCHES} (recorded steps: "
                          f"{_ranges(steps)})")
    rec = torch.load(path, weights_only=False)
    if rec.get("record_format") != FORMAT or rec.get("step") != step:
        raise ConfigError(f"replay: {path} is not a batch record of step {step} (format {rec.get('record_format')}, "
                          f"step {rec.get('step')}; expected format {FORMAT})")
    return rec


def _ranges(steps: list[int]) -> str:
    """``[1, 2, 3, 7]`` -> ``"1-3, 7"``."""
    out: list[str] = []
    start = prev = steps[0]
    for s in [*steps[1:], None]:
        if s is not None and s == prev + 1:
            prev = s
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if s is not None:
            start = prev = s
    return ", ".join(out)


class RecordedBatch:
    """Stands where the loop's rollout pipeline stands, for one replayed step: ``take`` hands back the
    recorded batch and puts the RNG back as it was when the recorded run handed it to prepare; the
    hand-off after the update has no engine to feed (nothing samples after a replayed step).
    """

    def __init__(self, record: dict) -> None:
        self.record = record

    def take(self, step: int, cursor: int, shaper_states: list | None, driver_state: object) -> tuple[Batch, dict]:
        """The recorded batch of the step that starts after ``step`` completed steps, and its pipeline metrics."""
        want = self.record["loop"]["step"]
        if step != want:
            raise ValueError(f"replay: the loop asked for the batch after step {step}; the record is of the step "
                             f"after step {want}")
        set_rng_state(self.record["rng"])
        return self.record["batch"], dict(self.record["pipe_metrics"])

    def after_update(self, source: object, step: int, version: int) -> None:
        """No engine samples after a replayed step."""

    def close(self) -> None:
        """Nothing runs beside a replay."""


def rows_table(rows: list[int], columns: Mapping[str, Tensor], mask_NT: Tensor, tokens: list[list[str]]) -> list[dict]:
    """Per-token rows of ``columns`` (each ``[N, T]``) for batch rows ``rows``: the trained tokens only
    (``mask_NT`` > 0), each with its row, position and decoded token.
    """
    out = []
    for r in rows:
        for t in torch.nonzero(mask_NT[r] > 0).flatten().tolist():
            out.append({"row": r, "pos": t, "token": tokens[r][t],
                        **{k: float(v[r, t]) for k, v in columns.items()}})
    return out
