"""``posttrain replay``: a recorded step re-runs to the metrics the run logged, exactly (same machine),
without touching the run directory; what cannot be replayed is refused with what the run holds."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config import ConfigError
from posttrain.reporting.sinks import read_metrics
from posttrain.train.rl import train
from posttrain.trainers.replay import replay

RECORD = ["train.steps=3", "checkpoint.keep=5", "log.record_batches=true", "eval.prompts=4", "log.samples=0"]


def _same_step(logged: dict, replayed: dict) -> None:
    """Every key the step computes agrees exactly (timings and throughput are wall-clock)."""
    assert logged["loss"] != 0.0 and logged["optim/grad_norm"] > 0  # the policy moved: the comparison can fail
    assert replayed["loss"] == logged["loss"]
    assert replayed["optim/grad_norm"] == logged["optim/grad_norm"]
    keys = [k for k in logged if k in replayed and not k.startswith(("time/", "throughput/"))]
    assert len(keys) > 20
    assert {k: replayed[k] for k in keys} == {k: logged[k] for k in keys}
    missing = [k for k in logged if k not in replayed and not k.startswith(("diag/", "eval/"))]
    assert not missing, missing


def _tree(run: Path) -> dict[str, int]:
    return {p.relative_to(run).as_posix(): p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file()}


def test_replay_reproduces_the_logged_steps(tiny_cfg, quiet, length_reward, capsys) -> None:
    cfg = tiny_cfg(*length_reward, *RECORD, "checkpoint.every=1")
    train(cfg, console=quiet)
    run = Path(cfg.out)
    logged = read_metrics(run / "metrics.jsonl")
    before = _tree(run)
    out = replay(run, 2, rows=[0, 3], tokens=True, console=quiet)
    assert _tree(run) == before  # nothing of the run was written, moved or set aside
    _same_step(logged[1], out)
    table = out["tokens"]
    assert {r["row"] for r in table} <= {0, 3} and table
    for r in table:
        assert math.isclose(r["ratio"], math.exp(r["logp"] - r["logp_behaviour"]), rel_tol=1e-5)
        assert r["entropy"] > 0 and r["clipped"] in (0.0, 1.0)
        clipped = min(max(r["ratio"], 0.8), 1.2)  # ppo_clip's own eps_low = eps_high = 0.2
        assert math.isclose(r["loss"], max(-r["adv"] * r["ratio"], -r["adv"] * clipped), abs_tol=1e-6)

    capsys.readouterr()
    assert main(["replay", str(run), "--step", "3", "--rows", "1", "--tokens"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    _same_step(logged[2], last)


def test_replay_says_what_cannot_be_replayed(tiny_cfg, quiet, length_reward, tmp_path) -> None:
    cfg = tiny_cfg(*length_reward, *RECORD, "checkpoint.every=2")  # checkpoints of steps 2 and 3
    train(cfg, console=quiet)
    run = Path(cfg.out)
    with pytest.raises(ConfigError, match=r"checkpoint of step 1.*steps: \[2, 3\].*Replayable steps: \[1, 3\]"):
        replay(run, 2, console=quiet)
    with pytest.raises(ConfigError, match=r"no recorded batch for step 7 .*recorded steps: 1-3"):
        replay(run, 7, console=quiet)
    logged = read_metrics(run / "metrics.jsonl")
    _same_step(logged[0], replay(run, 1, console=quiet))  # step 1 starts from the run's start: no checkpoint

    plain = tmp_path / "plain"  # the same run as if trained without log.record_batches
    shutil.copytree(run, plain, ignore=shutil.ignore_patterns("batches"))
    toml = (plain / "config.toml").read_text()
    assert "record_batches = true" in toml
    (plain / "config.toml").write_text(toml.replace("record_batches = true", "record_batches = false"))
    with pytest.raises(ConfigError, match="not trained with log.record_batches = true"):
        replay(plain, 1, console=quiet)
    assert main(["replay", str(tmp_path / "nowhere"), "--step", "1"]) == 2


@pytest.mark.parametrize("setting", ["rollout.max_staleness=1", "model.lora.rank=4"])
def test_replay_async_and_lora(tiny_cfg, quiet, length_reward, setting) -> None:
    if "lora" in setting:
        pytest.importorskip("peft")
    cfg = tiny_cfg(*length_reward, *RECORD, "checkpoint.every=1", setting)
    train(cfg, console=quiet)
    logged = read_metrics(Path(cfg.out) / "metrics.jsonl")
    _same_step(logged[2], replay(cfg.out, 3, console=quiet))
