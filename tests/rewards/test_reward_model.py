"""Reward models: a tiny LlamaForSequenceClassification built, saved and loaded like a hub model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posttrain.models.load import ModelLoadError
from posttrain.models.tiny import PRINTABLE, TinySpec, build_tiny
from posttrain.rewards import REGISTRY, score, score_batch
from posttrain.rewards.reward_model import RewardModel
from posttrain.train.rl import train


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory):
    return str(build_tiny(tmp_path_factory.mktemp("rm"), TinySpec(alphabet=PRINTABLE, hidden_size=32,
                                                                  intermediate_size=64, num_layers=1,
                                                                  max_positions=64), head="reward"))


def test_batched_scores_equal_one_by_one_scores(rm_dir):
    rm = RewardModel(rm_dir, batch_size=4)
    prompts = ["12+34=", "1+1=", "999+1=", "5+5=", "7+8=", "10+20="]
    completions = ["46", "2", "0001", "01", "51", "03 long tail"]
    batched = rm.score(prompts, completions)
    single = [RewardModel(rm_dir, batch_size=1).score([p], [c])[0] for p, c in zip(prompts, completions, strict=True)]
    assert len(set(batched)) == len(batched)  # a random head still tells the pairs apart
    assert batched == pytest.approx(single, abs=1e-5)  # padding never changes a score


def test_the_score_is_read_at_the_last_real_token(rm_dir):
    rm = RewardModel(rm_dir)
    ids = rm.encode("1+1=", "2")
    with torch.no_grad():
        logits = rm.model(input_ids=torch.tensor([ids])).logits
    expected = float(logits[0, -1, 0]) if logits.dim() == 3 else float(logits[0, 0])
    assert rm.score(["1+1="], ["2"])[0] == pytest.approx(expected, abs=1e-6)


def test_reward_model_is_a_registered_batched_reward(rm_dir):
    direct = RewardModel(rm_dir).score(["1+1=", "2+2="], ["2", "4"])
    got = score("reward_model", ["1+1=", "2+2="], ["2", "4"], params={"path": rm_dir, "scale": 2.0})
    assert got == pytest.approx([2 * v for v in direct], abs=1e-6)


def test_a_failing_batched_reward_scores_the_batch_none_and_is_counted(monkeypatch):
    def broken(prompts, completions, **_):
        raise RuntimeError("cuda out of memory")

    broken.batched = True
    monkeypatch.setitem(REGISTRY._entries, "t_broken_rm", broken)
    report = score_batch([("t_broken_rm", {})], ["a", "b"], ["x", "y"], [{}, {}])
    assert report.values == [[None, None]]
    assert report.errors == [2]
    assert "cuda out of memory" in report.failures[0]["message"]


def test_clear_errors_for_a_missing_or_wrong_model(tmp_path, rm_dir):
    with pytest.raises(ModelLoadError):
        RewardModel(str(tmp_path / "nope"))
    policy = build_tiny(tmp_path / "policy", TinySpec(alphabet="0123", hidden_size=16, intermediate_size=32,
                                                      num_layers=1, max_positions=16))
    cfg = json.loads((policy / "config.json").read_text())
    cfg["num_labels"] = 3
    cfg["id2label"] = {str(i): str(i) for i in range(3)}
    cfg["label2id"] = {str(i): i for i in range(3)}
    (policy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="3 outputs"):
        RewardModel(str(policy))


def test_training_with_a_reward_model(tiny_cfg, quiet, tmp_path, rm_dir):
    reward = f'reward=[{{name="reward_model", params={{path="{rm_dir}"}}}}]'
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", reward)
    train(cfg, console=quiet)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    assert all(math.isfinite(r["reward/reward_model/mean"]) and r["reward/reward_model/errors"] == 0 for r in rows)
    assert rows[0]["reward/std"] > 0  # a real model's scores vary between completions


def test_par_shaping_centres_rewards_on_the_reference_responses(tiny_cfg, quiet, tmp_path, rm_dir):
    from posttrain.produce.collect import reference_rewards
    from posttrain.tasks import make_task

    task = make_task("arithmetic", digits=2, ops="+", reverse=True)
    examples = task.examples("train", 3, seed=0)
    ref = reference_rewards([("reward_model", {"path": rm_dir})], torch.tensor([2.0]), task, examples, None)
    direct = RewardModel(rm_dir).score([e.prompt for e in examples], [e.demonstration for e in examples])
    assert ref.shape == (3, 1) and ref[:, 0].tolist() == pytest.approx([2 * v for v in direct], abs=1e-5)

    reward = f'reward=[{{name="reward_model", params={{path="{rm_dir}"}}}}]'
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", reward,
                   'algorithm.shapers=[{name="par", params={k=1.0}}]')
    train(cfg, console=quiet)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 < r["reward/mean"] < 1.0 for r in rows)  # sigmoid(r - r_ref): bounded in (0, 1)


def test_a_missing_reward_model_names_its_own_parameter_not_model_path(tmp_path):
    from posttrain.models.load import ModelLoadError
    from posttrain.rewards.prm import ProcessRewardModel
    from posttrain.rewards.reward_model import RewardModel

    for cls, key in ((RewardModel, "reward_model's params.path"), (ProcessRewardModel, "prm's params.path")):
        with pytest.raises(ModelLoadError, match=f"^{key}: model path .* does not exist") as err:
            cls(str(tmp_path / "nowhere"))
        assert "model.path" not in str(err.value)
