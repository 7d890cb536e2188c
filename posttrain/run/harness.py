"""One run harness for ``posttrain train``, ``sft`` and ``dpo``: what every run does around its steps.

A trainer opens its run (:func:`~posttrain.run.setup.open_run`), sets up its own state, and hands
the harness a :class:`Loop`: how to take one step, how to checkpoint, how to evaluate. The harness
owns everything else, the same way for the three commands:

- the metric sinks (``metrics.jsonl``, TensorBoard, W&B, MLflow), cut back to the resumed step;
- the progress bar with the trainer's key metrics;
- the evaluation cadence (every ``eval_every`` steps, and after the last planned step when the
  trainer asks) and the checkpoint cadence (``checkpoint.every``, and always at the end, unless the
  last step's periodic checkpoint is that one); ``metrics.jsonl`` is fsynced before each checkpoint;
- stopping early: a step may raise :class:`StopRun` (nothing of that step is logged), and
  ``Loop.stop`` may give a reason after a logged step (a target reached, a time budget spent);
- Ctrl-C: the first one lets the running step finish, then the harness checkpoints, prints the
  command that resumes the run and re-raises ``KeyboardInterrupt`` (the CLI exits 130). A second
  Ctrl-C stops at once; so does a ``KeyboardInterrupt`` raised inside a step. The half-done step is
  then not saved (a checkpoint of a partly updated model would not resume exactly) and the message
  names the last checkpoint instead;
- the end: final checkpoint, sinks closed, the LoRA merged export, plots, ``summary.json`` (``steps``,
  ``stopped``, ``wall_s``, ``checkpoint``, ``run_dir`` plus the trainer's own fields) and the
  closing table.
"""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console

from posttrain.config import Config
from posttrain.reporting.plots import plot_metrics
from posttrain.reporting.progress import fmt_metrics, make_progress, summary_table
from posttrain.reporting.sinks import MetricSinks, read_metrics
from posttrain.run.checkpoint import latest_checkpoint
from posttrain.run.setup import OpenedRun


class StopRun(Exception):
    """Raised by a step: the run ends before this step, for ``reason`` (nothing of it is logged)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass
class Loop:
    """What a trainer hands the harness: its steps, and what the harness calls around them."""

    kind: str  # the command: "train", "sft" or "dpo" (progress label, resume command)
    total: int  # steps to run (the loop ends when ``position()`` reaches it)
    position: Callable[[], int]  # steps completed so far (the trainer's loop-state step)
    step: Callable[[], dict[str, float]]  # one step: advances the loop state, returns its metrics
    checkpoint: Callable[[], Path]  # save the run as it is now; returns the checkpoint directory
    progress_keys: list[tuple[str, str]] = field(default_factory=list)  # (metric, label) on the bar
    evaluate: Callable[[], dict[str, float]] | None = None  # metrics, already named (``eval/pass@1``)
    eval_every: int = 0  # evaluate after every this many steps (0: never during the loop)
    eval_last: bool = False  # also evaluate after the last planned step
    stop: Callable[[dict[str, float]], str | None] | None = None  # a reason to end after a logged step
    close: Callable[[], None] | None = None  # the trainer's own logs to close with the sinks


@dataclass
class Ended:
    """How a loop ended."""

    steps: int  # steps completed
    reason: str  # "max steps", or the reason a step or ``Loop.stop`` gave
    checkpoint: Path  # the final checkpoint
    metrics: dict[str, float]  # the last step's metrics ({} when no step ran)


class _DeferredInterrupt:
    """SIGINT handling while a loop runs: the first Ctrl-C is remembered and the step goes on; a
    second one raises ``KeyboardInterrupt`` at once. Only on the main thread (Python delivers
    signals there); elsewhere Ctrl-C keeps its default behaviour.
    """

    def __init__(self, console: Console) -> None:
        self.console = console
        self.requested = False
        self._old = None

    def __enter__(self) -> _DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self.console.print("\n[bold yellow]Ctrl-C[/]: finishing this step, then saving a checkpoint "
                           "(Ctrl-C again stops at once, without saving it)", highlight=False)

    def __exit__(self, *exc: object) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)


def run_loop(cfg: Config, opened: OpenedRun, loop: Loop, console: Console) -> Ended:
    """Run ``loop`` to its end (see the module doc); returns how it ended, with the final checkpoint."""
    start = loop.position()
    sinks = MetricSinks(opened.run, cfg.log, start_step=start, config=cfg.model_dump(mode="json"))
    if lost := _missing_steps(sinks.path, start):
        console.print(f"[bold yellow]warning[/]: {sinks.path} holds no line for steps {lost} (lost in a crash before "
                      "they reached the disk; the checkpoint has them trained)", soft_wrap=True, highlight=False)

    saved: dict[int, Path] = {}  # position -> the checkpoint this loop wrote there

    def checkpoint() -> Path:
        """metrics.jsonl synced first (the lines a checkpoint counts as logged are on disk before it is);
        a position saved already (the last step's periodic checkpoint, then the final one) is not written twice.
        """
        at = loop.position()
        if at not in saved or not saved[at].is_dir():
            sinks.sync()
            saved[at] = loop.checkpoint()
        return saved[at]

    def close_logs() -> None:
        sinks.close()
        if loop.close is not None:
            loop.close()

    progress = make_progress(console, loop.kind, cfg.log.progress)
    bar = progress.add_task(loop.kind, total=loop.total, completed=start, metrics="")
    metrics: dict[str, float] = {}
    reason = "max steps"
    interrupt = _DeferredInterrupt(console)
    between_steps = False  # True when the harness itself stops the loop after a complete step
    try:
        with interrupt, progress:
            while loop.position() < loop.total:
                try:
                    metrics = loop.step()
                except StopRun as stop:
                    reason = stop.reason
                    break
                step = loop.position()
                due = loop.eval_every and step % loop.eval_every == 0
                if loop.evaluate is not None and (due or (loop.eval_last and step == loop.total)):
                    metrics.update(loop.evaluate())
                sinks.write(step, metrics)
                if cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                    checkpoint()
                progress.update(bar, completed=step, metrics=fmt_metrics(metrics, loop.progress_keys))
                if interrupt.requested:
                    between_steps = True
                    raise KeyboardInterrupt
                if loop.stop is not None and (why := loop.stop(metrics)):
                    reason = why
                    break
    except KeyboardInterrupt:
        _interrupted(loop, checkpoint, opened.run, between_steps, close_logs, console)
        raise
    final = checkpoint()
    close_logs()
    return Ended(loop.position(), reason, final, metrics)


def _missing_steps(path: Path, start: int) -> str:
    """The steps up to ``start`` (the resumed checkpoint's) of which ``metrics.jsonl`` holds no line, as
    ``"3, 4"`` (empty when none is missing): a resume cannot log them again, so it says so.
    """
    if not start or not path.is_file():
        return ""
    logged = {r.get("step") for r in read_metrics(path) if isinstance(r, dict)}
    lost = [s for s in range(1, start + 1) if s not in logged]
    return ", ".join(map(str, lost[:10])) + (f" (and {len(lost) - 10} more)" if len(lost) > 10 else "")


def _interrupted(loop: Loop, checkpoint: Callable[[], Path], run: Path, between_steps: bool,
                 close_logs: Callable[[], None], console: Console) -> None:
    """Ctrl-C: save (between steps) or name the last checkpoint (mid-step), and say how to resume."""
    if between_steps:
        what = f"saved {checkpoint()}"
    else:  # cut inside a step: the model may be partly updated, so this state is not saved
        last = latest_checkpoint(run / "checkpoints")
        what = f"stopped inside a step; the last checkpoint is {last}" if last else "no checkpoint was saved yet"
    close_logs()
    console.print(f"\n[bold yellow]interrupted[/]: {what}. Resume with:\n"
                  f"  posttrain {loop.kind} {run / 'config.toml'} --resume --out {run}",
                  soft_wrap=True, highlight=False)


@dataclass
class Finish:
    """What a trainer adds to the end of its run."""

    title: str  # the closing table's title
    plot_keys: list[str]  # metrics plotted into ``RUN/plots/<kind>.png``
    summary: dict = field(default_factory=dict)  # the trainer's own ``summary.json`` fields
    rows: list[tuple[str, str]] = field(default_factory=list)  # its own rows of the closing table
    plot_title: str = ""


def finish_run(cfg: Config, opened: OpenedRun, loop: Loop, ended: Ended, finish: Finish, wall_s: float,
               console: Console) -> dict:
    """The LoRA merged export, plots, ``summary.json`` and the closing table; returns the summary."""
    run = opened.run
    merged = opened.export(cfg)  # model.lora.merge_on_export: last, it folds the adapter in place
    if merged is not None:
        console.print(f"merged model (base + adapter): {merged}")
    plot_metrics(read_metrics(run / "metrics.jsonl"), finish.plot_keys, run / "plots" / f"{loop.kind}.png",
                 title=finish.plot_title)
    summary = {"steps": ended.steps, "stopped": ended.reason, "wall_s": wall_s, **finish.summary,
               "checkpoint": str(ended.checkpoint), "run_dir": str(run)}
    (run / "summary.json").write_text(json.dumps(summary, indent=2))
    rows = [("steps", f"{ended.steps} ({ended.reason})"), *finish.rows, ("wall time", f"{wall_s:.1f} s"),
            ("checkpoint", str(ended.checkpoint))]
    console.print(summary_table(finish.title, rows))
    return summary
