"""Per-prompt pass rates logged by the loop, 1-shot RLVR's historical-variance ranking
(`posttrain rank-prompts`), and training on the ranked prompts (task.dataset.train_prompts)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.config import load_config
from posttrain.data import DataError, DatasetSpec, load_task
from posttrain.train.prompt_stats import PromptStatsLog, history_from_log, rank_prompts
from posttrain.train.rl import train


def write_stats(path, rows):
    path.write_text("".join(json.dumps({"step": s, "prompt": p, "correct": c, "n": n}) + "\n" for s, p, c, n in rows))
    return path


def test_rank_prompts_by_hand(tmp_path):
    rows = []
    for step, c in enumerate([0, 4, 0, 4], 1):  # A: rates 0, 1, 0, 1 -> population std 0.5
        rows.append((step, "A", c, 4))
    for step in range(1, 5):  # B: 1, 1, 1, 1 -> 0
        rows.append((step, "B", 4, 4))
    for step, c in enumerate([0, 0, 4, 4, 4], 1):  # C: 0, 0, 1, 1, 1 -> mean .6, var .24, std .489898
        rows.append((step, "C", c, 4))
    # E drawn twice in step 1 (1/4 and 3/4: pooled 4/8 = .5), then 0/4 at step 2 -> .5, 0 -> std .25
    rows += [(1, "E", 1, 4), (1, "E", 3, 4), (2, "E", 0, 4)]
    rows.append((3, "D", 2, 4))  # one appearance: no spread to measure, left out
    path = write_stats(tmp_path / "prompt_stats.jsonl", rows)
    ranked = rank_prompts(path)
    assert [r["prompt"] for r in ranked] == ["A", "C", "E", "B"]
    assert [r["score"] for r in ranked] == pytest.approx([0.5, 0.489898, 0.25, 0.0], abs=1e-6)
    assert ranked[2]["rates"] == [0.5, 0.0] and ranked[2]["appearances"] == 2
    assert [r["prompt"] for r in rank_prompts(path, top=2)] == ["A", "C"]
    assert [r["prompt"] for r in rank_prompts(path, min_appearances=1)][-2:] == ["B", "D"]  # ties: first seen
    h = history_from_log(path)
    assert h.attempts["E"] == 12 and h.successes["E"] == 4


def test_a_broken_line_names_the_file_and_line(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"step": 1, "prompt": "A", "correct": 1, "n": 2}\n{"step": 2}\n')
    with pytest.raises(ValueError, match="s.jsonl line 2"):
        rank_prompts(path)


def test_resume_keeps_only_the_steps_already_done(tmp_path):
    write_stats(tmp_path / "prompt_stats.jsonl", [(1, "A", 1, 2), (2, "A", 2, 2), (3, "A", 0, 2)])
    with open(tmp_path / "prompt_stats.jsonl", "a") as f:
        f.write('{"step": 3, "prom')  # cut short by the crash
    log = PromptStatsLog(tmp_path, start_step=2)  # step 3 is re-run after the crash
    log.close()
    steps = [json.loads(x)["step"] for x in (tmp_path / "prompt_stats.jsonl").read_text().splitlines()]
    assert steps == [1, 2]


def write_sums(path, n):
    with open(path, "w") as f:  # GSM8K-style records: the final answer after "####"
        for i in range(n):
            a, b = i % 10, i // 10
            f.write(json.dumps({"question": f"{a}+{b}=", "answer": f"#### {a + b}"}) + "\n")
    return path


@pytest.fixture
def data_cfg(tmp_path):
    data = write_sums(tmp_path / "train.jsonl", 12)

    def make(*overrides, out="run"):
        return load_config(
            None,
            [
                f'out="{tmp_path / out}"', "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
                'task.name="dataset"', f'task.dataset={{path="{data}", preset="gsm8k", test_fraction=0.2}}',
                "model.tiny={hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, max_positions=64}",
                "rollout.group_size=4", "rollout.prompts_per_step=4", "rollout.max_new_tokens=8",
                'reward=[{name="math"}]', "checkpoint.every=0", "eval.prompts=4", "scoring.workers=0", *overrides,
            ],
        )

    return make


def test_loop_logs_each_groups_pass_rate_and_the_ranking_trains_one_prompt(data_cfg, quiet, tmp_path, capsys):
    cfg = data_cfg("train.steps=5")
    train(cfg, console=quiet)
    run = Path(cfg.out)
    rows = [json.loads(x) for x in (run / "prompt_stats.jsonl").read_text().splitlines()]
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [s for s in range(1, 6) for _ in range(4)]  # P = 4 lines a step
    for m in metrics:  # each step's accuracy is the mean of its groups' pass rates (G = 4, all valid)
        rates = [r["correct"] / r["n"] for r in rows if r["step"] == m["step"]]
        assert m["accuracy"] == pytest.approx(sum(rates) / len(rates))
        assert all(r["n"] == 4 for r in rows)
    # ~9 training prompts drawn 20 times: some recur, so there is a ranking
    out = tmp_path / "top.jsonl"
    assert main(["rank-prompts", str(run), "--top", "1", "--out", str(out)]) == 0
    assert "train_prompts" in capsys.readouterr().out
    (top,) = [json.loads(x) for x in out.read_text().splitlines()]
    assert top["appearances"] >= 2
    assert top == rank_prompts(run / "prompt_stats.jsonl", top=1)[0]
    # 1-shot RLVR: the next run trains on that prompt only; its test split is the same as before
    one = data_cfg("train.steps=1", f'task.dataset.train_prompts="{out}"', out="one")
    train(one, console=quiet)
    lines = (tmp_path / "one" / "prompt_stats.jsonl").read_text().splitlines()
    assert {json.loads(x)["prompt"] for x in lines} == {top["prompt"]}


def test_rank_prompts_without_recurring_prompts_says_why(tmp_path, capsys):
    write_stats(tmp_path / "prompt_stats.jsonl", [(1, "A", 1, 2), (2, "B", 2, 2)])
    assert main(["rank-prompts", str(tmp_path)]) == 2
    assert "recur" in capsys.readouterr().out
    assert main(["rank-prompts", str(tmp_path / "nowhere")]) == 2


def test_train_prompts_keeps_only_those_training_examples(tmp_path):
    data = write_sums(tmp_path / "d.jsonl", 40)
    spec = {"path": str(data), "preset": "gsm8k", "test_fraction": 0.2}
    full = load_task(DatasetSpec(**spec))
    chosen = full.pools["train"][3].prompt
    (tmp_path / "keep.jsonl").write_text(json.dumps({"prompt": chosen, "score": 0.5}) + "\n")
    task = load_task(DatasetSpec(**spec, train_prompts=str(tmp_path / "keep.jsonl")))
    assert {ex.prompt for ex in task.examples("train", 8, seed=0)} == {chosen}  # repeated, as 1-shot RLVR
    assert [ex.prompt for ex in task.pools["test"]] == [ex.prompt for ex in full.pools["test"]]
    assert task.counts["train_prompts_kept"] == 1
    held_out = full.pools["test"][0].prompt
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": held_out}) + "\n")
    with pytest.raises(DataError, match="none of the 1 prompts"):
        load_task(DatasetSpec(**spec, train_prompts=str(tmp_path / "bad.jsonl")))


def test_dataset_prompts_are_drawn_epoch_by_epoch(data_cfg, quiet, tmp_path):
    # every training prompt once per epoch, in a fresh order each epoch; data/epoch counts the pass
    cfg = data_cfg("train.steps=1")
    task = load_task(cfg.task.dataset)
    k = len(task.pools["train"])
    per_step = 2
    steps = k  # two epochs of k prompts, 2 prompts a step
    cfg = data_cfg(f"train.steps={steps}", f"rollout.prompts_per_step={per_step}")
    train(cfg, console=quiet)
    rows = [json.loads(x) for x in (Path(cfg.out) / "prompt_stats.jsonl").read_text().splitlines()]
    drawn = [r["prompt"] for r in rows]
    pool = sorted(ex.prompt for ex in task.pools["train"])
    assert sorted(drawn[:k]) == pool and sorted(drawn[k:]) == pool and drawn[:k] != drawn[k:]
    metrics = [json.loads(x) for x in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert [m["data/epoch"] for m in metrics] == pytest.approx([(i + 1) * per_step / k for i in range(steps)])
