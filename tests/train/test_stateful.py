"""Stateful registry entries keep their state across steps and checkpoints (ha_dw, capo, traac_length,
AEnt's entropy coefficient)."""

from __future__ import annotations

import json

import pytest

from posttrain.config import ConfigError
from posttrain.run.checkpoint import latest_checkpoint, load_trainer_state
from posttrain.train.rl import train

TIMING = ("time/", "throughput/")


def final_loop_state(run):
    return load_trainer_state(latest_checkpoint(run / "checkpoints"))["loop"]


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_ha_dw_anchor_follows_the_batch_accuracy(tiny_cfg, quiet, tmp_path):
    # the window anchor (the authors'): the mean of the last 2 batch accuracies
    cfg = tiny_cfg("train.steps=3", "checkpoint.every=0", 'algorithm.advantage="ha_dw"',
                   "algorithm.advantage_params={window=2}", out=str(tmp_path / "window"))
    train(cfg, console=quiet)
    acc = [r["accuracy"] for r in rows(tmp_path / "window")]  # the task reward is the accuracy here
    state = final_loop_state(tmp_path / "window")["entry_states"]["advantage"]
    assert list(state["recent"]) == pytest.approx(acc[-2:])
    assert state["anchor"] == pytest.approx(sum(acc[-2:]) / 2)
    # the Kalman form: C+ = (1 - eta) C- + eta * accuracy, from the default anchor 0.5
    cfg = tiny_cfg("train.steps=3", "checkpoint.every=0", 'algorithm.advantage="ha_dw"',
                   'algorithm.advantage_params={anchor="kalman", eta=0.1}', out=str(tmp_path / "kalman"))
    train(cfg, console=quiet)
    anchor = 0.5
    for r in rows(tmp_path / "kalman"):
        anchor = 0.9 * anchor + 0.1 * r["accuracy"]
    assert final_loop_state(tmp_path / "kalman")["entry_states"]["advantage"]["anchor"] == pytest.approx(anchor)


def test_capo_counts_steps_and_traac_keeps_a_window_of_lengths(tiny_cfg, quiet, tmp_path, test_entries):
    cfg = tiny_cfg("train.steps=3", "checkpoint.every=0", 'algorithm.advantage="capo"',
                   "algorithm.advantage_params={switch_step=2}", 'reward=[{name="test_length"}]',
                   'algorithm.shapers=[{name="traac_length", params={window=2}}]')
    train(cfg, console=quiet)
    states = final_loop_state(tmp_path / "run")["entry_states"]
    assert states["advantage"] == {"step": 3}
    # every response is "correct" (length reward > 0.5), every group easy: one tuple per step, last 2 kept
    assert len(states["shaper0"]["easy"]) == 2 and states["shaper0"]["hard"] == ()


# a band above the tiny policy's clamped entropy (~2.6): AEnt's coefficient rises every step, by
# an amount that depends on that step's entropy (so a resumed run must continue the same history)
AENT = ('algorithm.entropy="aent"', "algorithm.entropy_params={coef=1e-3, entropy_low=5.0, entropy_high=6.0, "
        "coef_lr=1e-4}")


def test_aent_coefficient_follows_its_rule_and_is_logged(tiny_cfg, quiet, tmp_path):
    train(tiny_cfg("train.steps=3", "checkpoint.every=0", "eval.prompts=4", *AENT), console=quiet)
    coef = 1e-3  # the recipe's starting coef; each step: coef - lr (min(0, H - low) + max(0, H - high))
    for step, r in enumerate(rows(tmp_path / "run")):
        h = r["entropy/regularized"]  # the batch's token-mean clamped entropy, what the rule is fed
        assert r["entropy/coef"] == pytest.approx(coef) and 0 < h < r["policy/entropy"]
        if step > 0:  # AReaL leaves global step 0 alone (warmup_steps = 0)
            coef = min(max(coef - 1e-4 * (min(0.0, h - 5.0) + max(0.0, h - 6.0)), 1e-5), 1e-2)
    assert coef > 1.4e-3
    assert final_loop_state(tmp_path / "run")["entry_states"]["entropy"] == {"coef": pytest.approx(coef), "step": 3}


def test_aent_updater_parameters_are_accepted_and_typos_rejected(tiny_cfg):
    tiny_cfg(*AENT)
    with pytest.raises(ConfigError, match="entropy_lwo"):
        tiny_cfg('algorithm.entropy="aent"', "algorithm.entropy_params={entropy_lwo=5.0}")


@pytest.mark.parametrize("entry", [('algorithm.advantage="ha_dw"',), AENT], ids=["ha_dw", "aent"])
def test_resume_continues_the_same_history(entry, tiny_cfg, quiet, tmp_path):
    common = (*entry, "checkpoint.every=1")
    train(tiny_cfg("train.steps=4", *common, out=str(tmp_path / "full")), console=quiet)
    train(tiny_cfg("train.steps=2", *common, out=str(tmp_path / "cut")), console=quiet)
    train(tiny_cfg("train.steps=4", *common, out=str(tmp_path / "cut")), console=quiet, resume=True)
    a, b = final_loop_state(tmp_path / "full"), final_loop_state(tmp_path / "cut")
    assert a["entry_states"] == b["entry_states"] and a["step"] == b["step"] == 4
    strip = [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows(tmp_path / "full")]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows(tmp_path / "cut")]


def test_updater_parameters_are_accepted_and_typos_rejected(tiny_cfg):
    tiny_cfg('algorithm.advantage="a_grae"', "algorithm.advantage_params={momentum=0.8, alpha=0.5}")
    with pytest.raises(ConfigError, match="momentun"):
        tiny_cfg('algorithm.advantage="a_grae"', "algorithm.advantage_params={momentun=0.8}")
    with pytest.raises(ConfigError, match="no parameter"):
        tiny_cfg('algorithm.shapers=[{name="traac_length", params={windw=2}}]')


def test_remax_subtracts_the_greedy_responses_reward(tiny_cfg, quiet, tmp_path, test_entries):
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", 'algorithm.advantage="remax"',
                   'reward=[{name="test_length"}]', "log.samples_every=1", "log.samples=8")
    train(cfg, console=quiet)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    by_prompt = {}
    for s in samples:
        by_prompt.setdefault((s["step"], s["prompt"]), set()).add(round(s["reward"] - s["advantage"], 4))
    # r - A = b: one baseline per prompt, a length (the test reward), shared by the group
    assert all(len(b) == 1 for b in by_prompt.values())
    assert all(float(next(iter(b))).is_integer() for b in by_prompt.values())


def test_entropy_adv_gets_the_policys_token_entropies(tiny_cfg, quiet, tmp_path, test_entries):
    import math as _math

    import torch

    from posttrain.algorithms import advantages
    from posttrain.learn.logprobs import completion_logprobs
    from posttrain.models.load import load_model, load_tokenizer
    from posttrain.rollout import HFEngine, SamplingParams

    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", 'algorithm.advantage="entropy_adv"',
                   'reward=[{name="test_length"}]')
    train(cfg, console=quiet)
    assert all(_math.isfinite(r["adv/mean"]) for r in rows(tmp_path / "run"))

    path = str(tmp_path / "run" / "base_model")
    model, tok = load_model(path), load_tokenizer(path)
    prompts = [tok("12+34=")["input_ids"]] * 2
    rollouts = HFEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=5, n=2),
                                          seed=0)
    rows_p = [p for p in prompts for _ in range(2)]
    with torch.no_grad():  # the policy's token entropies, as Learner.token_entropies computes them
        h = completion_logprobs(model, rows_p, rollouts.token_ids, rollouts.attention_mask, pad_id=tok.pad_token_id,
                                with_entropy=True)[1] * rollouts.loss_mask.float()
    assert h.shape == rollouts.loss_mask.shape
    assert (h[rollouts.loss_mask == 0] == 0).all() and (h >= 0).all() and (h <= _math.log(len(tok)) + 1e-4).all()
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]]).view(1, 4)
    a = advantages.compute("entropy_adv", r, entropies=h.view(1, 4, -1), mask=rollouts.loss_mask.view(1, 4, -1))
    assert a.shape == (1, 4, rollouts.loss_mask.shape[1])  # token-level
