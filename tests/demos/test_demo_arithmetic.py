import json

from posttrain.cli import main


def test_quick_demo_improves_its_reward(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    for key in ("baseline", "final", "control"):
        assert 0.0 <= s[key]["pass@1"] <= 1.0
    assert s["wall_s"] > 0
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == s["rl_steps"] == 150
    first = sum(r["reward/mean"] for r in rows[:20]) / 20
    last = sum(r["reward/mean"] for r in rows[-20:]) / 20
    assert last > first + 0.05, (first, last)  # RL raised the reward it optimizes
    assert (out / "plots" / "rl_curves.png").exists()


def test_agent_demo_runs_every_estimator_from_one_warm_up(tmp_path):
    out = tmp_path / "agent"
    assert main(["demo", "--agent", "--quick", "--max-steps", "3", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert set(s["runs"]) == {"grpo", "trloo", "gigpo"} and s["env"]["name"] == "guess_number"
    assert 0.0 <= s["baseline"]["pass@1"] <= 1.0 and s["baseline"]["turns_mean"] >= 1.0
    for name, r in s["runs"].items():
        assert r["steps"] == 3 and 0.0 <= r["final"]["pass@1"] <= 1.0
        rows = [json.loads(x) for x in (out / name / "metrics.jsonl").read_text().splitlines()]
        assert rows[0]["episode/turns_mean"] > 1.0  # the warm-up model plays several turns
        assert (out / "plots" / f"{name}.png").exists()
