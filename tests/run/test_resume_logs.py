"""After a resume the per-step logs beside metrics.jsonl (samples.jsonl, reward_failures.jsonl) hold each step
once: a run that logged a step and died before its checkpoint re-runs that step, and its lines are not doubled.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from rich.console import Console

from posttrain.config import load_config
from posttrain.train.rl import train

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml"


def _cfg(out: Path, steps: int):
    return load_config(TINY, [f'out="{out}"', f"train.steps={steps}", "checkpoint.every=2", "checkpoint.keep=3",
                              "rollout.prompts_per_step=2", "log.progress=false", "log.tensorboard=false",
                              "log.plot_groups=false", "log.samples=2", "log.samples_every=1", "eval.prompts=4"])


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_step_logged_before_a_crash_is_logged_once_after_the_resume(tmp_path):
    ref, run = tmp_path / "ref", tmp_path / "run"
    train(_cfg(ref, 3), console=Console(quiet=True))
    assert _steps(ref / "samples.jsonl") == [1, 1, 2, 2, 3, 3]  # two samples a step
    # the same run, crashed after step 3 was logged but before its checkpoint: the step-2 checkpoint is the last
    shutil.copytree(ref, run)
    shutil.rmtree(run / "checkpoints" / "step_000003")
    (run / "checkpoints" / "latest").write_text("step_000002")
    train(_cfg(run, 3), resume=True, console=Console(quiet=True))
    assert _steps(run / "samples.jsonl") == [1, 1, 2, 2, 3, 3]  # step 3 re-ran: its lines once, not twice
    assert (run / "samples.jsonl").read_text() == (ref / "samples.jsonl").read_text()  # and the same samples
