import json

from posttrain.train.sft import sft


def test_sft_loss_goes_down_and_checkpoint_is_written(tiny_cfg, quiet, tmp_path):
    cfg = tiny_cfg(
        "sft.steps=60",
        "sft.lr=3e-3",
        "sft.demos=200",
        "sft.eval_every=30",
        "sft.target_accuracy=1.0",
        "checkpoint.every=0",
    )
    summary = sft(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = sum(r["sft/loss"] for r in rows[:5]) / 5
    last = sum(r["sft/loss"] for r in rows[-5:]) / 5
    assert last < 0.75 * first, (first, last)
    assert summary["steps"] == 60
    assert (tmp_path / "run" / "checkpoints" / "step_000060" / "model.safetensors").exists()
    assert "sft/val_accuracy" in rows[29]


def test_sft_stops_at_time_budget(tiny_cfg, quiet):
    cfg = tiny_cfg("sft.steps=100000", "sft.target_accuracy=1.0", "checkpoint.every=0")
    summary = sft(cfg, max_seconds=1.0, use_target=False, console=quiet)
    assert summary["steps"] < 100000 and "time budget" in summary["stopped"]
