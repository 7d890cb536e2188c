import json

from posttrain.cli import main


def test_quick_demo_improves_on_its_sft_baseline(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--quick", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    for key in ("baseline", "final", "control"):
        assert 0.0 <= s[key]["pass@1"] <= 1.0
    assert s["wall_s"] > 0
    assert s["final"]["pass@1"] > s["baseline"]["pass@1"]
    rows = [json.loads(x) for x in (out / "rl" / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["reward/mean"] for r in rows[:5]) / 5
    last = sum(r["reward/mean"] for r in rows[-5:]) / 5
    assert last > first, (first, last)
    assert (out / "plots" / "rl_curves.png").exists()
