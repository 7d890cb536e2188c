import json

from posttrain.trainers.sft import sft


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


def test_validation_prompts_are_held_out_of_the_demonstration_pool():
    from posttrain.tasks import make_task
    from posttrain.trainers.sft import held_back

    task = make_task("arithmetic", digits=2, ops="+", reverse=True)
    pool = task.examples("train", 500, seed=1)
    drawn = task.examples("train", 200, seed=2)
    seen = {ex.prompt for ex in pool}
    assert sum(ex.prompt in seen for ex in drawn) > 5  # 2-digit sums: the plain draw repeats pool prompts
    val, note = held_back(task, pool, 200, seed=2)
    assert len(val) == 200 and not {ex.prompt for ex in val} & seen and note is None
    # the drawn order is kept, pool prompts skipped: a pool-free draw is unchanged
    assert [ex.prompt for ex in val[:20]] == [ex.prompt for ex in drawn if ex.prompt not in seen][:20]
    assert held_back(task, [], 50, seed=2) == (task.examples("train", 50, seed=2), None)
    # a pool that covers the task's training problems leaves none to hold back: the plain draw, and a note
    tiny = make_task("arithmetic", digits=1, ops="+", reverse=True)
    val, note = held_back(tiny, tiny.examples("train", 2000, seed=1), 20, seed=2)
    assert val == tiny.examples("train", 20, seed=2) and "problems SFT trains on" in note
