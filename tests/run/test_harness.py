"""The run harness shared by train, sft and dpo: eval/checkpoint cadence, early stops, Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from posttrain.cli import main
from posttrain.run.harness import Loop, StopRun, run_loop


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def counting_loop(run: Path, total: int, *, stop_at: int | None = None, raise_at: int | None = None, **kw) -> tuple:
    """A loop over a counter: each step returns {"x": step}; checkpoints are directories named by step."""
    state = {"step": 0, "evals": [], "saved": []}

    def step() -> dict[str, float]:
        if raise_at is not None and state["step"] + 1 == raise_at:
            raise StopRun("ran dry")
        state["step"] += 1
        return {"x": float(state["step"])}

    def checkpoint() -> Path:
        state["saved"].append(state["step"])
        path = run / "checkpoints" / f"step_{state['step']:06d}"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def evaluate() -> dict[str, float]:
        state["evals"].append(state["step"])
        return {"eval/x": float(state["step"])}

    stop = (lambda m: "target" if m["x"] >= stop_at else None) if stop_at else None
    loop = Loop("sft", total, lambda: state["step"], step, checkpoint, evaluate=evaluate, stop=stop, **kw)
    return loop, state


def test_eval_and_checkpoint_cadence(tiny_cfg, quiet, tmp_path):
    cfg = tiny_cfg("checkpoint.every=4")
    run = tmp_path / "run"
    run.mkdir()
    loop, state = counting_loop(run, 7, eval_every=3, eval_last=True)
    ended = run_loop(cfg, SimpleNamespace(run=run), loop, quiet)
    assert state["evals"] == [3, 6, 7]  # every 3 steps, and after the last planned step
    assert state["saved"] == [4, 7]  # checkpoint.every=4, then the final one
    assert (ended.steps, ended.reason, ended.checkpoint.name) == (7, "max steps", "step_000007")
    logged = rows(run)
    assert [r["step"] for r in logged] == list(range(1, 8))
    assert [r["step"] for r in logged if "eval/x" in r] == [3, 6, 7]


def test_stop_after_a_logged_step_and_stoprun_before_one(tiny_cfg, quiet, tmp_path):
    cfg = tiny_cfg("checkpoint.every=0")
    run = tmp_path / "a"
    run.mkdir()
    loop, _ = counting_loop(run, 10, stop_at=4)
    ended = run_loop(cfg, SimpleNamespace(run=run), loop, quiet)
    assert (ended.steps, ended.reason) == (4, "target") and len(rows(run)) == 4  # step 4 is logged, then stop
    run = tmp_path / "b"
    run.mkdir()
    loop, _ = counting_loop(run, 10, raise_at=3)
    ended = run_loop(cfg, SimpleNamespace(run=run), loop, quiet)
    assert (ended.steps, ended.reason) == (2, "ran dry") and len(rows(run)) == 2  # nothing of step 3 is logged
    assert ended.checkpoint.name == "step_000002"


def _sigint_in_update(monkeypatch, module: str, name: str, at: int, times: int = 1) -> None:
    """Send this process ``times`` real SIGINTs from inside the ``at``-th call of ``module.name`` (mid-step)."""
    import importlib

    mod = importlib.import_module(module)
    real = getattr(mod, name)
    calls = {"n": 0}

    def wrapped(*a, **k):
        calls["n"] += 1
        if calls["n"] == at:
            for _ in range(times):
                os.kill(os.getpid(), signal.SIGINT)
        return real(*a, **k)

    monkeypatch.setattr(mod, name, wrapped)


def test_ctrl_c_finishes_the_step_then_saves_and_resume_equals_uninterrupted(tmp_path, monkeypatch, capsys):
    common = ["recipes/tiny.toml", "log.progress=false", "checkpoint.every=0", "--max-steps", "5"]
    assert main(["train", *common, "--out", str(tmp_path / "ref")]) == 0
    cut = tmp_path / "cut"
    with monkeypatch.context() as m:
        _sigint_in_update(m, "posttrain.learn.learner", "policy_update", at=3)  # Ctrl-C inside step 3's update
        assert main(["train", *common, "--out", str(cut)]) == 130
    out = capsys.readouterr().out
    assert "finishing this step" in out and f"posttrain train {cut / 'config.toml'} --resume --out {cut}" in out
    assert sorted(p.name for p in (cut / "checkpoints").glob("step_*")) == ["step_000003"]  # step 3 completed
    assert [r["step"] for r in rows(cut)] == [1, 2, 3]
    assert main(["train", "--resume", "--out", str(cut), "log.progress=false", "--max-steps", "5"]) == 0
    a = load_file(str(tmp_path / "ref" / "checkpoints" / "step_000005" / "model.safetensors"))
    b = load_file(str(cut / "checkpoints" / "step_000005" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)  # the interrupted run, resumed, is the same run


def test_a_second_ctrl_c_stops_at_once_and_saves_nothing_of_the_step(tmp_path, monkeypatch, capsys):
    _sigint_in_update(monkeypatch, "posttrain.learn.learner", "policy_update", at=3, times=2)
    out = tmp_path / "r"
    assert main(["train", "recipes/tiny.toml", "--out", str(out), "log.progress=false", "checkpoint.every=1"]) == 130
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*"))[-1] == "step_000002"
    assert "stopped inside a step; the last checkpoint is" in capsys.readouterr().out


def test_interrupt_inside_a_step_saves_nothing_of_it(tmp_path, monkeypatch, capsys):
    # a KeyboardInterrupt raised mid-step (a second Ctrl-C) may leave the model half-updated: not saved
    import posttrain.learn.learner as learner

    real, calls = learner.policy_update, {"n": 0}

    def interrupting(*a, **k):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(learner, "policy_update", interrupting)
    out = tmp_path / "r"
    assert main(["train", "recipes/tiny.toml", "--out", str(out), "log.progress=false", "checkpoint.every=1"]) == 130
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*"))[-1] == "step_000002"
    text = capsys.readouterr().out
    assert "stopped inside a step; the last checkpoint is" in text and "step_000002" in text and "--resume" in text


def test_sft_ctrl_c_saves_and_names_the_sft_command(tmp_path, monkeypatch, capsys):
    import posttrain.trainers.sft as sft_mod

    _sigint_in_update(monkeypatch, "posttrain.trainers.sft", "completion_terms", at=2)
    out = tmp_path / "s"
    code = main(["sft", "recipes/tiny.toml", "--out", str(out), "log.progress=false", "checkpoint.every=0",
                 "sft.eval_every=100"])
    assert code == 130 and sft_mod.completion_terms is not None
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_000002"]
    assert f"posttrain sft {out / 'config.toml'} --resume --out {out}" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["sft", "dpo"])
def test_sft_and_dpo_summaries_share_the_harness_fields(tmp_path, kind, quiet):
    steps = {"sft": "sft.steps=3", "dpo": "dpo.steps=2"}[kind]
    out = tmp_path / kind
    assert main([kind, "recipes/tiny.toml", "--out", str(out), "log.progress=false", steps]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert {"steps", "stopped", "wall_s", "checkpoint", "run_dir"} <= set(summary)
    assert (out / "plots" / f"{kind}.png").exists()
