"""Run directories for the report tests, built once per session.

Two real tiny runs (GRPO and RLOO, 3 steps, held-out eval every 2 steps), a second "seed" of each
made by copying it with shifted metrics (so a group has a visible spread without a third and fourth
training run), and one hand-written run whose files hold exact content: a completion with a
``<script>`` tag, verbalized confidences in ``eval.json``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from posttrain.config import load_config
from posttrain.reporting.report import write_report
from posttrain.train.rl import train

TINY = Path(__file__).resolve().parents[2] / "recipes" / "tiny.toml"
SCRIPT = "<script>alert('x')</script> & done"


def _train(out: Path, *overrides: str) -> Path:
    cfg = load_config(
        TINY,
        [
            f'out="{out}"', "log.progress=false", "log.tensorboard=false", "train.steps=3",
            "eval.every=2", "eval.prompts=8", "eval.n=2", "eval.k=[1,2]", "eval.temperature=1.0",
            "log.samples_every=1", "checkpoint.every=0", *overrides,
        ],
    )  # fmt: skip
    train(cfg, console=Console(quiet=True))
    return out


def _shifted_copy(src: Path, dst: Path, shift: float) -> Path:
    """A second seed: same files, every metric and final value moved by ``shift``."""
    dst.mkdir()
    for name in ("config.toml", "samples.jsonl"):
        shutil.copy(src / name, dst / name)
    rows = [json.loads(line) for line in (src / "metrics.jsonl").read_text().splitlines()]
    moved = [{k: v + shift if isinstance(v, float) and k != "step" else v for k, v in r.items()} for r in rows]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in moved))
    summary = json.loads((src / "summary.json").read_text())
    summary["final"] = {k: min(v + shift, 1.0) for k, v in summary["final"].items()}
    (dst / "summary.json").write_text(json.dumps(summary))
    return dst


def write_hand_run(run: Path) -> Path:
    """A run directory with exact, hand-written content (no training)."""
    run.mkdir(parents=True)
    (run / "config.toml").write_text('seed = 7\n[algorithm]\nadvantage = "grpo"\nloss = "ppo_clip"\n')
    metrics = [
        {"step": s, "reward/mean": 0.1 * s, "accuracy": 0.05 * s, "time/step_s": 0.5, "policy/entropy": 2.0 - 0.1 * s}
        for s in range(1, 5)
    ]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in metrics))
    samples = [
        {"step": 1, "prompt": "1+1=", "answer": "2", "completion": "2", "reward": 1.0, "advantage": 0.5},
        {"step": 2, "prompt": "a < b & c", "answer": "x", "completion": SCRIPT, "reward": -1.0, "advantage": -1.5},
        {"step": 3, "prompt": "2+2=", "answer": "4", "completion": "5", "reward": 0.0, "advantage": 0.0},
        {"step": 4, "prompt": "3+3=", "answer": "6", "completion": "6", "reward": 1.0, "advantage": 0.25},
    ]
    (run / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in samples))
    (run / "summary.json").write_text(json.dumps({"steps": 4, "wall_s": 2.0, "final": {"pass@1": 0.5, "pass@4": 0.9}}))
    problems = [
        {"prompt": "p1", "answer": "1", "completions": ["a", "b"], "answers": ["1", "2"], "correct": [True, False],
         "confidence": [0.9, 0.3]},
        {"prompt": "p2", "answer": "2", "completions": ["c", "d"], "answers": ["2", None], "correct": [True, False],
         "confidence": [0.75, None]},
    ]  # fmt: skip
    metrics_eval = {"pass@1": 0.5, "pass@2": 1.0, "maj@1": 0.5, "maj@2": 0.5, "ece": 0.2}
    (run / "eval.json").write_text(json.dumps({"metrics": metrics_eval, "problems": problems, "n": 2, "k": [1, 2]}))
    return run


@pytest.fixture(scope="session")
def report_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Path]]:
    """``{"grpo": [seed0, seed1], "rloo": [seed0, seed1], "hand": [run]}``."""
    root = tmp_path_factory.mktemp("runs")
    grpo = _train(root / "grpo-s0")
    rloo = _train(root / "rloo-s0", "algorithm.advantage=rloo", "seed=1")
    return {
        "grpo": [grpo, _shifted_copy(grpo, root / "grpo-s1", 0.25)],
        "rloo": [rloo, _shifted_copy(rloo, root / "rloo-s1", 0.5)],
        "hand": [write_hand_run(root / "hand")],
    }


@pytest.fixture(scope="session")
def group_report(report_runs: dict[str, list[Path]], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The report over the hand run plus two groups of two seeds (the ``posttrain compare`` case)."""
    out = tmp_path_factory.mktemp("report") / "report.html"
    groups = {"grpo": report_runs["grpo"], "rloo": report_runs["rloo"]}
    return write_report(report_runs["hand"], out, groups=groups, title="test report")
