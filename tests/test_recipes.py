"""Every preset under recipes/ loads, combines only registry parts, and trains for a few steps (finite losses)."""

import json
import math
from pathlib import Path

import pytest

from posttrain.config import ConfigError, load_config, read_recipe
from posttrain.train.rl import train

RECIPES = sorted((Path(__file__).resolve().parents[1] / "recipes").glob("*.toml"))
# Recipes on a real model (a 135M download, not the tiny model): tests/models/test_smollm2.py trains them.
# The last three: their own tests train them on tiny (agent_verifiers: tests/produce/test_verifiers_agent.py,
# with the verifiers extra).
REAL = {"smollm2_math", "reasoning_gym", "textarena_guess", "agent_verifiers"}
# The DPO-family loss presets differ from dpo.toml only in [dpo], which the RL loop does not read:
# tests/test_recipe_claims.py runs each through `posttrain dpo`.
DPO_LOSSES = {p.stem for p in RECIPES if p.stem.startswith("dpo_")}


def test_there_are_presets():
    names = {p.stem for p in RECIPES}
    assert {"tiny", "grpo", "dr_grpo", "dapo", "rloo", "gspo", "cispo"} <= names


@pytest.mark.parametrize("recipe", [p for p in RECIPES if p.stem not in REAL | DPO_LOSSES], ids=lambda p: p.stem)
def test_preset_trains_a_few_steps(recipe, tmp_path, quiet):
    cfg = load_config(
        recipe,
        [
            f'out="{tmp_path / "run"}"',
            "train.steps=2",
            "log.progress=false",
            "log.tensorboard=false",
            "log.plot_groups=false",
            "checkpoint.every=0",
            "eval.prompts=8",
        ],
    )
    summary = train(cfg, console=quiet)
    assert summary["steps"] == 2
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/nonfinite"] == 0 and (r.get("loss") is None or math.isfinite(r["loss"])) for r in rows)


def test_base_is_merged_and_cycles_are_caught(tmp_path):
    (tmp_path / "a.toml").write_text('base = "b.toml"\nseed = 3\n')
    (tmp_path / "b.toml").write_text('base = "a.toml"\n')
    with pytest.raises(ConfigError, match="includes itself"):
        read_recipe(tmp_path / "a.toml")
    (tmp_path / "b.toml").write_text("seed = 1\n[train]\nlr = 0.5\nsteps = 7\n")
    (tmp_path / "c.toml").write_text('base = "b.toml"\n[train]\nsteps = 9\n')
    assert read_recipe(tmp_path / "c.toml") == {"seed": 1, "train": {"lr": 0.5, "steps": 9}}
