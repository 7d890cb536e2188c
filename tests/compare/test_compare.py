"""posttrain compare: layout, summary values, skip / resume, failures, CLI parsing.

One module-scoped compare (tiny recipe, 2 steps, 2 arms, 2 seeds, 2 processes at a time) is shared by
the tests that need real runs; they run in file order (skip, then resume next to a failing arm).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from posttrain.compare import run as cmp
from posttrain.compare.args import add_compare_parser
from posttrain.compare.summary import run_stats
from posttrain.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "recipes" / "tiny.toml")
COMMON = [
    "train.steps=2",
    "eval.every=1",
    "eval.prompts=4",
    "eval.n=2",
    "eval.temperature=1.0",
    "eval.k=[1,2]",
    "log.tensorboard=false",
    "log.progress=false",
    "scoring.workers=0",
]
VARIANTS = ["", "rloo: algorithm.advantage=rloo"]
BROKEN = 'broken: model.path="/nonexistent/model"'  # valid config, fails when the model loads
SEEDS = [0, 1]


def _run(
    out: Path, variants: list[str], common: list[str] = COMMON, seeds: list[int] = SEEDS, report: bool = False
) -> cmp.CompareResult:
    return cmp.run_compare(
        None,
        recipe=TINY,
        variants=variants,
        seeds=seeds,
        out=out,
        common_overrides=common,
        parallel=2,
        target_accuracy=0.0,
        report=report,
        console=Console(quiet=True),
    )


@pytest.fixture(scope="module")
def compared(tmp_path_factory: pytest.TempPathFactory) -> cmp.CompareResult:
    return _run(tmp_path_factory.mktemp("compare"), VARIANTS, report=True)


def test_layout_and_outcomes(compared):
    out = compared.out
    status = {(r.label, r.seed): r.status for r in compared.runs}
    assert status == {
        ("tiny", 0): "done",
        ("tiny", 1): "done",
        ("rloo", 0): "done",
        ("rloo", 1): "done",
    }
    for label in ("tiny", "rloo"):
        for seed in SEEDS:
            run = out / label / f"seed{seed}"
            for name in ("config.toml", "metrics.jsonl", "summary.json", "train.log", "compare_attempts.jsonl"):
                assert (run / name).exists(), run / name
            assert f"seed = {seed}" in (run / "config.toml").read_text()
    assert 'advantage = "rloo"' in (out / "rloo" / "seed0" / "config.toml").read_text()
    assert (out / "summary.json").exists() and (out / "summary.md").exists()


def test_summary_matches_the_run_directories(compared):
    labels = compared.summary["labels"]
    for label in ("tiny", "rloo"):
        sums = [json.loads((compared.out / label / f"seed{s}" / "summary.json").read_text()) for s in SEEDS]
        p1 = [s["final"]["pass@1"] for s in sums]
        p2 = [s["final"]["pass@2"] for s in sums]
        a = labels[label]
        assert a["complete"] == 2 and a["k"] == 2
        assert a["pass@1"]["mean"] == pytest.approx(statistics.fmean(p1))
        assert a["pass@1"]["std"] == pytest.approx(statistics.stdev(p1))
        assert a["pass@K"]["mean"] == pytest.approx(statistics.fmean(p2))
        tokens = []
        for s in SEEDS:
            rows = [
                json.loads(x) for x in (compared.out / label / f"seed{s}" / "metrics.jsonl").read_text().splitlines()
            ]
            assert [r["step"] for r in rows] == [1, 2]
            # every completion is 1..max_new_tokens=6 tokens long, 8 prompts x 4 samples a step
            n = sum(round(r["throughput/gen_tokens_per_s"] * r["time/generate_s"]) for r in rows)
            assert 2 * 32 <= n <= 2 * 32 * 6
            tokens.append(n)
        assert a["tokens"]["mean"] == pytest.approx(statistics.fmean(tokens))
        # target 0.0: reached at the first periodic evaluation
        assert a["steps_to_target"]["mean"] == 1 and a["reached"] == 2 and a["target_metric"] == "eval/pass@1"
        assert a["wall_s"]["mean"] > 0
    md = (compared.out / "summary.md").read_text()
    assert "| tiny | 2/2 |" in md and "| rloo | 2/2 |" in md and "pass@2" in md


def test_report_is_written_or_its_absence_explained(compared):
    try:
        from posttrain.reporting.report import write_report  # noqa: F401
    except ImportError:
        assert "write_report" in compared.report_error
    else:
        assert compared.report == compared.out / "report.html" and compared.report.exists()
        html = compared.report.read_text()
        assert "tiny" in html and "rloo" in html and html.index('id="compare"') < html.index('id="runs"')


def test_second_invocation_skips_complete_runs(compared):
    before = {p: p.stat().st_mtime_ns for p in compared.out.glob("*/seed*/summary.json")}
    again = _run(compared.out, VARIANTS)
    assert {r.status for r in again.runs} == {"skipped"}
    assert {p: p.stat().st_mtime_ns for p in compared.out.glob("*/seed*/summary.json")} == before
    attempts = (compared.out / "tiny" / "seed0" / "compare_attempts.jsonl").read_text().splitlines()
    assert len(attempts) == 1
    assert again.summary["labels"]["tiny"] == compared.summary["labels"]["tiny"]


def test_raising_steps_resumes_while_a_failing_run_is_reported(compared):
    common = [c if c != "train.steps=2" else "train.steps=3" for c in COMMON]
    res = _run(compared.out, ["rloo: algorithm.advantage=rloo", BROKEN], common, seeds=[0])
    assert [(r.label, r.status) for r in res.runs] == [("rloo", "done"), ("broken", "failed")]
    # the failure: its log tail in the outcome and in summary.json; the other run completed
    assert "does not exist" in res.runs[1].message and not res.ok
    assert [f["label"] for f in json.loads((compared.out / "summary.json").read_text())["failed"]] == ["broken"]
    assert "| broken | 0/1 |" in (compared.out / "summary.md").read_text()
    run = compared.out / "rloo" / "seed0"
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert "resumed from" in (run / "train.log").read_text()
    attempts = [json.loads(x) for x in (run / "compare_attempts.jsonl").read_text().splitlines()]
    assert [a["resume"] for a in attempts] == [False, True]
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    # wall time counts both processes
    assert res.summary["labels"]["rloo"]["runs"]["0"]["wall_s"] == pytest.approx(sum(a["elapsed_s"] for a in attempts))


def test_a_run_directory_with_another_config_is_refused(compared):
    res = _run(compared.out, ["tiny: train.lr=0.5"])
    assert {r.status for r in res.runs} == {"failed"}
    assert "another config" in res.runs[0].message and "train.lr" in res.runs[0].message


def test_bad_config_fails_its_arm_before_anything_runs(tmp_path):
    res = _run(tmp_path, ["bad: algorithm.advantage=nope"], report=True)
    assert {r.status for r in res.runs} == {"failed"}
    assert "nope" in res.runs[0].message
    assert not (tmp_path / "bad").exists()
    assert res.report is None and res.report_error


def test_labels():
    arms = cmp.make_arms(None, "r/grpo.toml", ["", "algorithm.advantage=rloo algorithm.loss=reinforce", "x: a.b=1", ""])
    assert [a.label for a in arms] == ["grpo", "advantage=rloo,loss=reinforce", "x", "grpo-2"]
    assert arms[1].overrides == ("algorithm.advantage=rloo", "algorithm.loss=reinforce")
    assert [a.label for a in cmp.make_arms(["a/grpo.toml", "b/rloo.toml"], None, None)] == ["grpo", "rloo"]
    assert cmp.make_arms(None, None, ['p: model.path="/a b/c"'])[0].overrides == ("model.path=/a b/c",)
    with pytest.raises(ConfigError):
        cmp.make_arms(["a.toml", "b.toml"], None, ["x=1"])


def _summary(run: Path, rows: list[dict], final: dict, steps: int) -> Path:
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps({"steps": steps, "wall_s": 9.0, "final": final}))
    return run


def test_run_stats_by_hand(tmp_path):
    rows = [
        {"step": 1, "accuracy": 0.2, "throughput/gen_tokens_per_s": 50.0, "time/generate_s": 2.0, "time/step_s": 3.0},
        {
            "step": 2,
            "accuracy": 0.6,
            "eval/pass@1": 0.4,
            "throughput/gen_tokens_per_s": 30.0,
            "time/generate_s": 1.0,
            "time/step_s": 2.0,
        },
        {"step": 3, "accuracy": 0.7, "throughput/gen_tokens_per_s": 10.0, "time/generate_s": 0.5, "time/step_s": 1.0},
    ]
    run = _summary(tmp_path / "a", rows, {"pass@1": 0.55, "pass@4": 0.8, "pass@16": 0.9, "maj@4": 0.5}, 3)
    s = run_stats(run, 0.5)
    # tokens: 50*2 + 30*1 + 10*0.5 = 135; train time 3 + 2 + 1 = 6; no attempts file -> summary wall_s
    assert (s["tokens"], s["train_s"], s["wall_s"]) == (135, 6.0, 9.0)
    assert (s["k"], s["pass@K"], s["pass@1"]) == (16, 0.9, 0.55)
    # eval/pass@1 exists: 0.4 at step 2 misses 0.5, the final eval (0.55, counted at step 3) reaches it
    assert (s["steps_to_target"], s["target_metric"]) == (3, "eval/pass@1")
    assert run_stats(run, 0.6)["steps_to_target"] is None
    # no periodic eval: the training-batch accuracy (0.6 at step 2)
    no_eval = [{k: v for k, v in r.items() if k != "eval/pass@1"} for r in rows]
    s = run_stats(_summary(tmp_path / "b", no_eval, {"pass@1": 0.1}, 3), 0.5)
    assert (s["steps_to_target"], s["target_metric"], s["k"], s["pass@K"]) == (2, "accuracy", 1, 0.1)


def test_cli_parsing(monkeypatch):
    seen = {}

    def fake(recipes, **kw):
        seen.update(recipes=recipes, **kw)
        return cmp.CompareResult(Path("x"), [], {})

    monkeypatch.setattr(cmp, "run_compare", fake)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    add_compare_parser(sub)
    argv = [
        "compare",
        "recipes/grpo.toml",
        "recipes/rloo.toml",
        "train.steps=5",
        "--seeds",
        "0",
        "1",
        "2",
        "--out",
        "o",
        "--parallel",
        "2",
        "--target",
        "0.5",
    ]
    args, extra = parser.parse_known_args([*argv, "eval.every=5"])
    args.overrides += extra  # what posttrain.cli.main does with overrides placed after the options
    assert cmp.cli_compare(args, Console(quiet=True)) == 0
    assert seen["recipes"] == ["recipes/grpo.toml", "recipes/rloo.toml"]
    assert seen["common_overrides"] == ["train.steps=5", "eval.every=5"]
    assert (seen["seeds"], seen["parallel"], seen["target_accuracy"], seen["out"]) == ([0, 1, 2], 2, 0.5, Path("o"))
    assert seen["report"] is True
    args = parser.parse_args(
        ["compare", "recipes/tiny.toml", "--variant", "", "--variant", "rloo: a.b=1", "--no-report"]
    )
    cmp.cli_compare(args, Console(quiet=True))
    assert seen["variants"] == ["", "rloo: a.b=1"] and seen["recipes"] == ["recipes/tiny.toml"]
    assert seen["report"] is False


def test_a_run_held_by_another_process_is_left_alone(tmp_path):
    run = tmp_path / "tiny" / "seed0"
    run.mkdir(parents=True)
    (run / cmp.LOCK).write_text(str(os.getpid()))  # a live process holds it
    res = _run(tmp_path, [""], seeds=[0])
    assert [(r.label, r.status) for r in res.runs] == [("tiny", "busy")]
    assert not (run / "train.log").exists() and (run / cmp.LOCK).exists() and not res.ok
    assert json.loads((tmp_path / "summary.json").read_text())["busy"][0]["label"] == "tiny"


def test_a_stale_lock_is_taken_over(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / cmp.LOCK).write_text(f"{dead.pid}")
    assert cmp._lock(tmp_path)
    assert (tmp_path / cmp.LOCK).read_text() == str(os.getpid())
    assert not cmp._lock(tmp_path)  # now held (by this process)
