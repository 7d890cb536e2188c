"""``posttrain compare``: several recipes (or one recipe with several override sets) on the same
model, task, step budget and seeds, then one summary table and one report with the runs overlaid.

Layout: ``OUT/<label>/seed<S>/`` is an ordinary run directory (``posttrain train ... --out`` it),
with the train process's output in ``train.log`` and compare's record of its attempts in
``compare_attempts.jsonl``; ``OUT/summary.json``, ``OUT/summary.md`` and ``OUT/report.html``.

Each run is a separate process (``python -m posttrain.cli train``), at most ``parallel`` at once,
each with ``OMP_NUM_THREADS = cores // parallel`` unless that is already set. Running the same
compare again continues it: complete runs (``summary.json`` at the configured ``train.steps``) are
skipped, the others resume from their latest checkpoint, so raising ``train.steps`` extends every
run. A run directory whose saved config differs from the requested one (other than
``train.steps``) is refused rather than mixed. A run that fails is reported with the tail of its
log and the others go on. What the table's numbers are: :mod:`posttrain.compare.summary`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rich.console import Console
from rich.markup import escape

from posttrain.compare.summary import ATTEMPTS, aggregate, html_section, markdown_table, rich_table, run_stats
from posttrain.config import Config, ConfigError, load_config

LOG = "train.log"
LOCK = ".compare.lock"  # pids of the compare process running this run directory, and of its train process
TAIL_LINES = 15


@dataclass(frozen=True)
class Arm:
    """One compared configuration: a recipe plus overrides, under a directory-safe label."""

    label: str
    recipe: str | None
    overrides: tuple[str, ...] = ()


@dataclass
class RunOutcome:
    """What happened to one (label, seed) run in this invocation."""

    label: str
    seed: int
    run_dir: Path
    status: Literal["done", "skipped", "failed", "busy"]  # busy: another process is running it
    message: str = ""


@dataclass
class CompareResult:
    """The runs, the summary written to ``out/summary.json`` and the report (if written)."""

    out: Path
    runs: list[RunOutcome]
    summary: dict
    report: Path | None = None
    report_error: str | None = None
    groups: dict[str, list[Path]] = field(default_factory=dict)  # label -> its complete run directories
    failed: list[RunOutcome] = field(init=False)

    def __post_init__(self) -> None:
        self.failed = [r for r in self.runs if r.status == "failed"]

    @property
    def ok(self) -> bool:
        """Every run complete and the report written."""
        return all(r.status in ("done", "skipped") for r in self.runs) and self.report_error is None


def variant_label(variant: str) -> tuple[str | None, list[str]]:
    """Split ``"[label:] key=value ..."`` into an explicit label (or None) and its overrides."""
    words = shlex.split(variant)
    if words and words[0].endswith(":") and "=" not in words[0]:
        return words[0][:-1], words[1:]
    return None, words


def _sanitize(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=,+-]+", "_", text).strip("_.")[:80] or "run"


def make_arms(recipes: list[str] | None, recipe: str | None, variants: list[str] | None) -> list[Arm]:
    """The compared configurations: one per recipe, or one per variant of ``recipe``.

    A variant's label is its explicit ``label:`` prefix, else its overrides with only the last part
    of each key (``algorithm.advantage=rloo`` -> ``advantage=rloo``); an empty variant is the recipe
    itself, labelled by its stem. Repeated labels get ``-2``, ``-3``, ...
    """
    if variants:
        if recipes:
            if recipe is not None or len(recipes) > 1:
                raise ConfigError("compare: variants apply to one recipe; give one recipe or none (defaults)")
            recipe = recipes[0]
        stem = Path(recipe).stem if recipe else "defaults"
        arms = []
        for v in variants:
            label, overrides = variant_label(v)
            if label is None:
                short = [f"{o.partition('=')[0].split('.')[-1]}={o.partition('=')[2]}" for o in overrides]
                label = ",".join(short) if short else stem
            arms.append(Arm(_sanitize(label), recipe, tuple(overrides)))
    else:
        names = list(recipes or []) + ([recipe] if recipe else [])
        if not names:
            raise ConfigError("compare: nothing to compare; give recipes, or a recipe with variants")
        arms = [Arm(_sanitize(Path(r).stem), r) for r in names]
    seen: dict[str, int] = {}
    unique = []
    for arm in arms:
        seen[arm.label] = seen.get(arm.label, 0) + 1
        label = arm.label if seen[arm.label] == 1 else f"{arm.label}-{seen[arm.label]}"
        unique.append(Arm(label, arm.recipe, arm.overrides))
    return unique


def _flat(d: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict) and not k.endswith("params"):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def run_state(run: Path, cfg: Config) -> Literal["complete", "resume", "fresh"]:
    """Whether ``run`` is complete, to be resumed, or to be started; ConfigError when it holds
    another configuration (anything but ``train.steps`` differs) or more steps than configured.
    """
    if not (run / "config.toml").exists():
        return "fresh"
    saved = _flat(load_config(run / "config.toml").model_dump(mode="json"))
    wanted = _flat(cfg.model_dump(mode="json"))
    differ = sorted(k for k in saved.keys() | wanted.keys() if k != "train.steps" and saved.get(k) != wanted.get(k))
    if differ:
        shown = ", ".join(f"{k}: {saved.get(k)!r} -> {wanted.get(k)!r}" for k in differ[:5])
        raise ConfigError(
            f"{run} holds a run with another config ({shown}{', ...' if len(differ) > 5 else ''}); "
            "use another --out, or delete that run directory"
        )
    if not (run / "summary.json").exists():
        return "resume"
    steps = json.loads((run / "summary.json").read_text())["steps"]
    if steps > cfg.train.steps:
        raise ConfigError(f"{run} ran {steps} steps, more than train.steps={cfg.train.steps}; use another --out")
    return "complete" if steps == cfg.train.steps else "resume"


@dataclass
class _Job:
    arm: Arm
    seed: int
    run_dir: Path
    overrides: list[str]
    cfg: Config
    resume: bool = False

    def command(self) -> list[str]:
        cmd = [sys.executable, "-m", "posttrain.cli", "train"]
        cmd += [self.arm.recipe] if self.arm.recipe else []
        cmd += [*self.overrides, "--out", str(self.run_dir), "--seed", str(self.seed)]
        return cmd + (["--resume"] if self.resume else [])


def _log_tail(path: Path, n: int = TAIL_LINES) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-n:])


def _held(lock: Path) -> bool:
    try:
        pids = [int(x) for x in lock.read_text().split()]
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        pids = []
    if not pids:  # being written right now, or left half-written long ago
        return time.time() - lock.stat().st_mtime < 10 if lock.exists() else False
    for pid in pids:
        try:
            os.kill(pid, 0)
            return True
        except ProcessLookupError:
            continue
        except PermissionError:
            return True
    return False


def _lock(run: Path) -> bool:
    """Take ``run``'s lock for this process; False while a live process holds it (a stale one is taken over)."""
    lock = run / LOCK
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            if _held(lock):
                return False
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return True
    return False


def _claim(job: _Job) -> RunOutcome | None:
    """Lock the job's run directory and re-read its state (another compare may have run it since the
    plan); None when the job should start, else the outcome without running it.
    """
    label, seed, run = job.arm.label, job.seed, job.run_dir
    run.mkdir(parents=True, exist_ok=True)
    if not _lock(run):
        return RunOutcome(label, seed, run, "busy", f"another process holds {run / LOCK}")
    try:
        state = run_state(run, job.cfg)
    except ConfigError as e:
        (run / LOCK).unlink(missing_ok=True)
        return RunOutcome(label, seed, run, "failed", str(e))
    if state == "complete":
        (run / LOCK).unlink(missing_ok=True)
        return RunOutcome(label, seed, run, "skipped", "completed by another process")
    if state == "resume":
        (run / "summary.json").unlink(missing_ok=True)  # stale: it ends at fewer steps
    job.resume = state == "resume"
    return None


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _execute(jobs: list[_Job], parallel: int, console: Console) -> list[RunOutcome]:
    """Run the jobs as train processes, at most ``parallel`` at once; a failure does not stop the others."""
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, _cores() // parallel))
    pending, running, outcomes = deque(jobs), {}, []

    def finish(proc: subprocess.Popen, rc: int) -> None:
        job, t0, log = running.pop(proc)
        log.close()
        (job.run_dir / LOCK).unlink(missing_ok=True)
        elapsed = time.perf_counter() - t0
        with (job.run_dir / ATTEMPTS).open("a") as f:
            f.write(json.dumps({"resume": job.resume, "rc": rc, "elapsed_s": elapsed}) + "\n")
        name = f"{job.arm.label}/seed{job.seed}"
        if rc == 0 and (job.run_dir / "summary.json").exists():
            console.print(f"[green]done[/] {name} in {elapsed:.0f}s")
            outcomes.append(RunOutcome(job.arm.label, job.seed, job.run_dir, "done"))
            return
        tail = _log_tail(job.run_dir / LOG)
        console.print(f"[bold red]failed[/] {name} (exit code {rc}); last lines of {job.run_dir / LOG}:")
        console.print(escape(tail), highlight=False, soft_wrap=True)
        outcomes.append(RunOutcome(job.arm.label, job.seed, job.run_dir, "failed", f"exit code {rc}:\n{tail}"))

    try:
        while pending or running:
            while pending and len(running) < parallel:
                job = pending.popleft()
                if (outcome := _claim(job)) is not None:
                    console.print(f"{outcome.status} {job.arm.label}/seed{job.seed}: {outcome.message}")
                    outcomes.append(outcome)
                    continue
                log = (job.run_dir / LOG).open("a")
                log.write(f"\n$ {shlex.join(job.command())}\n")
                log.flush()
                proc = subprocess.Popen(
                    job.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
                )
                running[proc] = (job, time.perf_counter(), log)
                (job.run_dir / LOCK).write_text(f"{os.getpid()} {proc.pid}")
                verb = "resuming" if job.resume else "started"
                console.print(f"{verb} {job.arm.label}/seed{job.seed} -> {job.run_dir}", highlight=False)
            for proc in list(running):
                if (rc := proc.poll()) is not None:
                    finish(proc, rc)
            time.sleep(0.2)
    except KeyboardInterrupt:
        # each train process checkpoints on SIGINT and exits; the next compare resumes from there
        for proc in running:
            proc.send_signal(signal.SIGINT)
        for proc in list(running):
            try:
                rc = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            finish(proc, rc)
        raise
    return outcomes


def run_compare(
    recipes: list[str] | None,
    *,
    recipe: str | None = None,
    variants: list[str] | None = None,
    seeds: list[int],
    out: Path,
    common_overrides: list[str] | None = None,
    parallel: int = 1,
    target_accuracy: float | None = None,
    title: str | None = None,
    report: bool = True,
    console: Console | None = None,
) -> CompareResult:
    """Run every (arm, seed) that is not complete, then write the summary table and the report.

    ``recipes``: recipe files, one arm each (labelled by stem). Or ``recipe`` with ``variants``:
    strings of space-separated overrides (``"algorithm.advantage=rloo algorithm.loss=reinforce"``,
    optionally prefixed ``"label:"``), one arm each. ``common_overrides`` apply to every run first,
    then the arm's own. A bad config fails its arm before anything runs; the other arms go on.
    ``report=False`` skips ``report.html`` (the table is always written).
    """
    console = console or Console()
    if parallel < 1:
        raise ConfigError(f"compare: parallel must be >= 1, got {parallel}")
    seeds = list(dict.fromkeys(seeds))
    if not seeds:
        raise ConfigError("compare: give at least one seed")
    out = Path(out)
    common = list(common_overrides or [])
    arms = make_arms(recipes, recipe, variants)
    jobs, outcomes = [], []
    for arm in arms:
        for seed in seeds:
            run = out / arm.label / f"seed{seed}"
            overrides = [*common, *arm.overrides]
            try:
                cfg = load_config(arm.recipe, [*overrides, f"out={json.dumps(str(run))}", f"seed={seed}"])
                state = run_state(run, cfg)
            except ConfigError as e:
                console.print(f"[bold red]failed[/] {arm.label}/seed{seed}: {escape(str(e))}", soft_wrap=True)
                outcomes.append(RunOutcome(arm.label, seed, run, "failed", str(e)))
                continue
            if state == "complete":
                outcomes.append(RunOutcome(arm.label, seed, run, "skipped", "already complete"))
            else:
                jobs.append(_Job(arm, seed, run, overrides, cfg))
    skipped = sum(o.status == "skipped" for o in outcomes)
    console.print(
        f"[bold]posttrain compare[/]: {len(arms)} arms x {len(seeds)} seeds; {len(jobs)} to run, "
        f"{skipped} complete, {parallel} at a time -> {out}",
        highlight=False,
    )
    outcomes += _execute(jobs, parallel, console)
    order = {(a.label, s): i for i, (a, s) in enumerate((a, s) for a in arms for s in seeds)}
    outcomes.sort(key=lambda o: order[(o.label, o.seed)])
    result = _summarize(arms, seeds, outcomes, out, common, parallel, target_accuracy, title, console)
    if report:
        _report(result, title or result.summary["title"], console)
    return result


def _summarize(
    arms: list[Arm],
    seeds: list[int],
    outcomes: list[RunOutcome],
    out: Path,
    common: list[str],
    parallel: int,
    target: float | None,
    title: str | None,
    console: Console,
) -> CompareResult:
    """Per-arm numbers -> ``summary.json``, ``summary.md`` and the console table."""
    title = title or "posttrain compare: " + " vs ".join(a.label for a in arms)
    labels, groups = {}, {}
    for arm in arms:
        done = [o for o in outcomes if o.label == arm.label and o.status in ("done", "skipped")]
        per_seed = {o.seed: run_stats(o.run_dir, target) for o in done}
        labels[arm.label] = {"recipe": arm.recipe, "overrides": list(arm.overrides), **aggregate(per_seed, seeds)}
        if done:
            groups[arm.label] = [o.run_dir for o in done]
    summary = {
        "title": title,
        "common_overrides": common,
        "seeds": seeds,
        "parallel": parallel,
        "target": target,
        "labels": labels,
        "failed": [
            {"label": o.label, "seed": o.seed, "run_dir": str(o.run_dir), "message": o.message}
            for o in outcomes
            if o.status == "failed"
        ],
        "busy": [{"label": o.label, "seed": o.seed, "run_dir": str(o.run_dir)} for o in outcomes if o.status == "busy"],
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(markdown_table(summary, title))
    console.print(rich_table(summary, title))
    result = CompareResult(out, outcomes, summary, groups=groups)
    if result.failed:
        names = ", ".join(f"{o.label}/seed{o.seed}" for o in result.failed)
        console.print(f"[bold red]{len(result.failed)} run(s) failed[/]: {names} (details in {out / 'summary.json'})")
    if summary["busy"]:
        names = ", ".join(f"{b['label']}/seed{b['seed']}" for b in summary["busy"])
        console.print(f"[yellow]still running in another process[/]: {names}; run the same command again later")
    return result


def _report(result: CompareResult, title: str, console: Console) -> None:
    """``report.html``: the runs overlaid (each arm's seeds as one group), the table on top."""
    out, groups = result.out, result.groups
    run_dirs = [d for dirs in groups.values() for d in dirs]
    if not run_dirs:
        result.report_error = "no complete runs to report"
        return
    try:
        from posttrain.reporting.report import write_report
    except ImportError as e:
        result.report_error = f"report not written: posttrain.reporting.report.write_report is unavailable ({e})"
        console.print(f"[yellow]warning[/]: {escape(result.report_error)}", soft_wrap=True)
        return
    result.report = write_report(run_dirs, out / "report.html", groups=groups, title=title)
    # the comparison table goes first in the page, before the report's own sections
    html = result.report.read_text(encoding="utf-8")
    anchor = '<section id="runs"' if '<section id="runs"' in html else "</body>"
    result.report.write_text(html.replace(anchor, html_section(result.summary) + anchor, 1), encoding="utf-8")
    console.print(f"report: {result.report}; table: {out / 'summary.md'}", highlight=False)


def cli_compare(args: argparse.Namespace, console: Console) -> int:
    """Run ``posttrain compare`` from parsed arguments; 0 when every run completed and the report was written."""
    recipes = [x for x in args.overrides if x.endswith(".toml") or "=" not in x]
    common = [x for x in args.overrides if not (x.endswith(".toml") or "=" not in x)]
    result = run_compare(
        recipes,
        variants=args.variant or None,
        seeds=args.seeds,
        out=Path(args.out),
        common_overrides=common,
        parallel=args.parallel,
        target_accuracy=args.target,
        title=args.title,
        report=not args.no_report,
        console=console,
    )
    return 0 if result.ok else 1
