"""Step (process) rewards: the arithmetic task's steps, the reference_steps scorer, padding and
errors, config checks, and the process-reward shapers (prm_clip, prm_delta) fed in the loop."""

import json
import math
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import shaping
from posttrain.config import ConfigError
from posttrain.rewards import steps
from posttrain.rewards.steps import StepRewardError, reference_steps, score_steps
from posttrain.tasks.arithmetic import ArithmeticTask
from posttrain.train.rl import train


@pytest.fixture
def task():
    return ArithmeticTask(digits=2, steps=True)  # reversed: 58+67 is written "85+76="


def test_arithmetic_steps_by_hand(task):
    ex = task.make_example(58, "+", 67)
    # column sums from the least-significant column: 8+7 = 15, 5+6+1 = 12
    assert task.reference_steps(ex) == ["15", "12"]
    assert ex.demonstration == "15,12>521"
    assert task.split_steps("15,12>521") == ["15", "12"]
    assert task.split_steps(" 15 , 13 >5") == ["15", "13"]
    assert task.split_steps("521") == []  # no marker: the whole text is the answer
    assert task.split_steps(">521") == []
    # 12*34 (reversed operands "21*43"): partial products 12*4 = 48, 12*3*10 = 360, written reversed
    m = ArithmeticTask(digits=2, ops="*", steps=True).make_example(12, "*", 34)
    assert ArithmeticTask(digits=2, ops="*", steps=True).reference_steps(m) == ["84", "063"]
    assert ArithmeticTask(digits=2).reference_steps(ex) == []  # no steps without steps=True


def test_reference_steps_scores_each_step_in_place(task):
    ex = task.make_example(58, "+", 67)
    kw = {"task": task, "example": ex}
    assert reference_steps(ex.prompt, "15,12>521", **kw) == [1.0, 1.0]
    assert reference_steps(ex.prompt, "15,13>531", **kw) == [1.0, 0.0]
    assert reference_steps(ex.prompt, "12,15>521", **kw) == [0.0, 0.0]  # right numbers, wrong places
    assert reference_steps(ex.prompt, "15,12,1>521", **kw) == [1.0, 1.0, 0.0]  # past the last step: 0
    assert reference_steps(ex.prompt, "521", **kw) == []
    with pytest.raises(StepRewardError, match="steps = true"):
        reference_steps(ex.prompt, "15,12>521", task=ArithmeticTask(digits=2), example=ex)


def test_score_steps_pads_and_counts_errors(task, monkeypatch):
    def flaky(prompt, completion, **_):
        if completion == "boom":
            raise RuntimeError("broken scorer")
        if completion == "nan":
            return [float("nan")]
        return [0.25] * len(completion)

    monkeypatch.setitem(steps.REGISTRY._entries, "test_flaky", flaky)
    values, mask, errors = score_steps("test_flaky", {}, ["p"] * 4, ["ab", "boom", "abc", "nan"], [{}] * 4)
    assert errors == 2  # the raise and the NaN: those responses get no steps
    assert mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 1, 1], [0, 0, 0]]
    assert values.tolist() == [[0.25, 0.25, 0.0], [0.0] * 3, [0.25] * 3, [0.0] * 3]
    values, mask, errors = score_steps("test_flaky", {}, ["p"], [""], [{}])
    assert values.shape == mask.shape == (1, 1) and mask.sum() == 0 and errors == 0  # K is at least 1


def test_config_ties_step_rewards_to_the_shapers_that_read_them(tiny_cfg):
    with pytest.raises(ConfigError, match=r"read step rewards.*algorithm.step_reward.*reference_steps"):
        tiny_cfg('algorithm.shapers=[{name="prm_clip"}]')
    with pytest.raises(ConfigError, match=r"no shaper reads step rewards.*prm_clip.*prm_delta"):
        tiny_cfg('algorithm.step_reward="reference_steps"')
    with pytest.raises(ConfigError, match="unknown step reward 'oracle'"):
        tiny_cfg('algorithm.shapers=[{name="prm_delta"}]', 'algorithm.step_reward="oracle"')


def test_a_task_without_steps_is_refused_before_training(tiny_cfg, quiet):
    cfg = tiny_cfg('algorithm.shapers=[{name="prm_clip"}]', 'algorithm.step_reward="reference_steps"')
    with pytest.raises(ConfigError, match="writes no steps"):
        train(cfg, console=quiet)  # tiny.toml's arithmetic task has steps = false


@pytest.mark.parametrize("shaper", ["prm_clip", "prm_delta"])
def test_loop_shapes_rewards_with_the_responses_step_scores(shaper, tiny_cfg, quiet, monkeypatch):
    seen = []
    compute = shaping.compute

    def spy(name, rewards, **kwargs):
        out = compute(name, rewards, **kwargs)
        seen.append((rewards, kwargs, out))
        return out

    monkeypatch.setattr(shaping, "compute", spy)
    params = "{eta=0.5}" if shaper == "prm_clip" else "{}"
    cfg = tiny_cfg("train.steps=1", "checkpoint.every=0", "rollout.prompts_per_step=4", "eval.prompts=4",
                   "task.params={digits=2, steps=true}", "rollout.max_new_tokens=12",
                   "log.samples=64", "log.samples_every=1",
                   f'algorithm.shapers=[{{name="{shaper}", params={params}}}]',
                   'algorithm.step_reward="reference_steps"')
    train(cfg, console=quiet)
    ((r_in, kw, r_out),) = seen
    P, G, K = kw["step_rewards"].shape
    assert (P, G) == r_in.shape and kw["step_mask"].shape == (P, G, K)
    # recompute every response's shaped reward from its text, by hand
    samples = [json.loads(x) for x in (Path(cfg.out) / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == P * G
    task = ArithmeticTask(digits=2, steps=True)
    n_steps = 0
    for i, s in enumerate(samples):
        p, g = divmod(i, G)
        a, b = s["prompt"].rstrip("=").split("+")
        ex = task.make_example(int(a[::-1]), "+", int(b[::-1]))
        assert ex.prompt == s["prompt"]
        sc = reference_steps(ex.prompt, s["completion"], task=task, example=ex)
        n_steps += len(sc)
        assert kw["step_mask"][p, g].sum() == len(sc)
        if shaper == "prm_clip":  # r + sum_k min(r_k - 0.5, 0)
            want = r_in[p, g] + sum(min(x - 0.5, 0.0) for x in sc)
        else:  # r + sum_{k<K} (r_k - r_{k+1}) = r + r_first - r_last
            want = r_in[p, g] + (sc[0] - sc[-1] if sc else 0.0)
        assert r_out[p, g].item() == pytest.approx(float(want), abs=1e-6)
    assert n_steps > 0  # the random tiny model writes some steps (',' and '>' are in its alphabet)
    metrics = json.loads((Path(cfg.out) / "metrics.jsonl").read_text().splitlines()[0])
    assert metrics["step_reward/steps_mean"] == pytest.approx(n_steps / (P * G))
    assert metrics["step_reward/errors"] == 0
    assert not math.isnan(metrics["step_reward/mean"])
    assert torch.isfinite(r_out).all()
