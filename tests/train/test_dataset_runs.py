"""Training and SFT on prompts from a data file (task.name = "dataset"), scored by the math reward."""

from __future__ import annotations

import json

import pytest

from posttrain.config import load_config
from posttrain.train.rl import train
from posttrain.trainers.sft import sft


def write_gsm8k(path, n, long_every=0):
    # GSM8K's record format: the final answer follows "####", thousands written with commas
    with open(path, "w") as f:
        for i in range(n):
            a, b = i % 10, i // 10
            q = f"{a}+{b}=" + ("?" * 60 if long_every and i % long_every == 0 else "")
            f.write(json.dumps({"question": q, "answer": f"{a}+{b}<<{a}+{b}={a + b}>>\n#### {a + b}"}) + "\n")


@pytest.fixture
def data_cfg(tmp_path):
    def make(*overrides, n=60, long_every=0):
        data = tmp_path / "train.jsonl"
        write_gsm8k(data, n, long_every)
        return load_config(
            None,
            [
                f'out="{tmp_path / "run"}"', "log.progress=false", "log.tensorboard=false",
                'task.name="dataset"', f'task.dataset={{path="{data}", preset="gsm8k", test_fraction=0.2}}',
                "model.tiny={hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, max_positions=96}",
                "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_new_tokens=24",
                'reward=[{name="math"}, {name="format", weight=0.0}]', "checkpoint.every=0", *overrides,
            ],
        )

    return make


def test_train_on_a_gsm8k_file_with_the_math_reward(data_cfg, quiet, tmp_path):
    cfg = data_cfg("train.steps=2", "eval.prompts=4")
    summary = train(cfg, console=quiet)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["reward/math/errors"] == 0 and r["reward/math/timeouts"] == 0
        assert "reward/format/mean" in r  # every component is kept, even at weight 0
    assert 0.0 <= summary["final"]["pass@1"] <= 1.0


def test_prompts_longer_than_the_context_are_dropped_and_counted(data_cfg, tmp_path):
    from rich.console import Console

    console = Console(record=True, width=200)
    cfg = data_cfg("train.steps=1", "eval.prompts=2", "model.tiny.max_positions=48", n=60, long_every=3)
    train(cfg, console=console)
    log = console.export_text()
    # 20 of the 60 prompts carry 60 extra characters: they cannot fit 48 positions
    assert "too_long_dropped" in log
    dropped = sum(int(x) for x in __import__("re").findall(r"_too_long_dropped (\d+)", log))
    assert dropped == 20


def test_sft_on_a_gsm8k_file_uses_its_demonstrations(data_cfg, quiet, tmp_path):
    cfg = data_cfg("sft.steps=3", "sft.demos=16", "sft.eval_prompts=4")
    out = sft(cfg, console=quiet)
    assert out["steps"] == 3
