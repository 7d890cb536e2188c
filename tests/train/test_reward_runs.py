"""The sandboxed code reward and the math reward inside the training loop."""

from __future__ import annotations

import json

from rich.console import Console

from posttrain.train.rl import train


def test_code_reward_in_the_loop_reports_its_isolation(tiny_cfg, tmp_path):
    console = Console(record=True, width=200)
    cfg = tiny_cfg('task.name="pycode"', "task.params={}", "train.steps=1", "checkpoint.every=0",
                   "rollout.max_new_tokens=24", "model.tiny.max_positions=64", "eval.prompts=4",
                   'reward=[{name="code", params={timeout_s=2.0, together=true}}]')
    train(cfg, console=console)
    assert "reward 'code': sandbox isolation" in console.export_text()
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/code/errors"] == 0 and row["reward/code/timeouts"] == 0
    assert 0.0 <= row["reward/code/mean"] <= 1.0


def test_math_reward_on_boxed_arithmetic_in_the_loop(tiny_cfg, tmp_path, quiet):
    cfg = tiny_cfg('task.params={digits=2, ops="+", reverse=true, boxed=true}', "train.steps=1",
                   "checkpoint.every=0", "rollout.max_new_tokens=12", "eval.prompts=4", 'reward=[{name="math"}]')
    train(cfg, console=quiet)
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["reward/math/errors"] == 0 and row["reward/math/timeouts"] == 0
