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
