"""Sampled evaluation end to end: the metrics from known completions, a real tiny model, the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.cli import main
from posttrain.evaluation import evaluate_samples
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.tiny import TinySpec, build_tiny
from posttrain.rewards import RewardPool
from posttrain.rollout import HFEngine, Rollout
from posttrain.tasks import make_task


class ScriptedEngine:
    """A RolloutEngine that writes given texts (to check the metrics against hand arithmetic)."""

    def __init__(self, script):
        self.script = script  # prompt index -> list of n texts

    def generate(self, prompts, sampling, seed=None):
        texts = [t for i in range(len(prompts)) for t in self.script(i)[: sampling.n]]
        N = len(texts)
        return Rollout.single_turn(
            prompt_ids=prompts,
            token_ids=torch.zeros(N, 3, dtype=torch.long),
            mask=torch.ones(N, 3),
            behaviour_logprobs=torch.zeros(N, 3),
            finished=torch.tensor([not t.endswith("...") for t in texts]),
            texts=texts,
            n=sampling.n,
        )


@pytest.fixture
def task():
    return make_task("arithmetic", digits=2, ops="+", reverse=True)


@pytest.mark.parametrize("with_pool", [False, True])
def test_metrics_from_known_completions(task, with_pool):
    examples = task.examples("test", 3, seed=0)
    tok = load_tokenizer(str(build_tiny_tmp(task)))

    def script(i):
        ans = examples[i].answer
        # 2 of 4 right (confident), 2 wrong with the same wrong answer (unsure; one truncated)
        # (the task reads the digits after the last ">", here the tag's end)
        return [f"<confidence>0.9</confidence>{ans}", "<confidence>0.2</confidence>0",
                f"<confidence>0.9</confidence>{ans}", "<confidence>0.2</confidence>0..."]

    pool = RewardPool(2) if with_pool else None
    try:
        m = evaluate_samples(ScriptedEngine(script), tok, task, examples, n=4, ks=[1, 2, 4],
                             max_new_tokens=4, temperature=1.0, pool=pool).metrics
    finally:
        if pool:
            pool.close()
    assert m["pass@1"] == pytest.approx(0.5)
    assert m["pass@2"] == pytest.approx(1 - 1 / 6)  # 1 - C(2,2)/C(4,2)
    assert m["pass@4"] == pytest.approx(1.0)
    assert m["mean@4"] == pytest.approx(0.5)
    # maj@4: two votes for the right answer, two for "0": a tie, half credit
    assert m["maj@4"] == pytest.approx(0.5)
    assert m["maj@1"] == pytest.approx(0.5)
    assert m["truncation_rate"] == pytest.approx(0.25)
    assert m["confidence_rate"] == 1.0
    # Brier: half the samples (0.9 - 1)^2 = 0.01, half (0.2 - 0)^2 = 0.04 -> 0.025
    assert m["brier"] == pytest.approx(0.025)
    # ECE: bin 0.9 has accuracy 1 (gap 0.1), bin 0.2 accuracy 0 (gap 0.2), equal weights -> 0.15
    assert m["ece"] == pytest.approx(0.15)
    assert m["auroc"] == pytest.approx(1.0)


_TINY = {}


def build_tiny_tmp(task, tmp=None):
    import tempfile

    if task.alphabet not in _TINY:
        d = tempfile.mkdtemp()
        _TINY[task.alphabet] = build_tiny(d, TinySpec(alphabet=task.alphabet, hidden_size=32, intermediate_size=64,
                                                      num_layers=1, max_positions=32))
    return _TINY[task.alphabet]


def test_a_real_model_gives_consistent_estimates(task):
    path = str(build_tiny_tmp(task))
    engine = HFEngine(load_model(path), load_tokenizer(path))
    examples = task.examples("test", 8, seed=0)
    res = evaluate_samples(engine, engine.tokenizer, task, examples, n=8, ks=[1, 4, 8], max_new_tokens=4,
                           temperature=1.0)
    m = res.metrics
    assert m["pass@1"] == pytest.approx(m["mean@8"])
    assert m["pass@1"] <= m["pass@4"] <= m["pass@8"]
    assert len(res.problems) == 8 and all(len(p["completions"]) == 8 for p in res.problems)
    assert "ece" not in m and m["confidence_rate"] == 0.0  # a random model states no confidence
    greedy = evaluate_samples(engine, engine.tokenizer, task, examples, max_new_tokens=4).metrics
    again = evaluate_samples(engine, engine.tokenizer, task, examples, max_new_tokens=4).metrics
    assert greedy == again  # greedy pass@1 is deterministic


def test_bad_k_is_rejected(task):
    with pytest.raises(ValueError, match="every k must be in 1..n=2"):
        evaluate_samples(None, None, task, task.examples("test", 1, 0), n=2, ks=[4], max_new_tokens=2)


def test_eval_command_writes_json_and_prints_a_table(tmp_path, task, capsys):
    model = str(build_tiny_tmp(task))
    out = tmp_path / "e.json"
    rc = main(["eval", "--model", model, "--json", str(out), "--out", str(tmp_path),
               'task.params={digits=2, ops="+", reverse=true}', "eval.prompts=6", "eval.n=4", "eval.k=[1,2,4]",
               "eval.temperature=1.0", "rollout.max_new_tokens=4"])
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["prompts"] == 6 and report["n"] == 4
    assert set(report["metrics"]) >= {"pass@1", "pass@2", "pass@4", "maj@4", "mean@4"}
    assert len(report["problems"]) == 6
    assert "pass@4" in capsys.readouterr().out


def test_eval_command_needs_a_model(capsys):
    assert main(["eval"]) == 2
    assert "needs a trained model" in capsys.readouterr().out
