"""Batch selectors in the loop (algorithm.batch_selector): Shuffle-R1's pairs and shuffle, RoRecomp's
priority and compensation batches (its buffer is checkpointed: resume equals an uninterrupted run)."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config import ConfigError
from posttrain.prepare.selectors import SELECTORS, BatchSelector, UpdateBatch
from posttrain.rollout import Rollout
from posttrain.run.checkpoint import latest_checkpoint, load_trainer_state
from posttrain.train.rl import train

TIMING = ("time/", "throughput/")


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def params_changed(run, step):
    before = AutoModelForCausalLM.from_pretrained(run / "base_model").state_dict()
    after = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / f"step_{step:06d}").state_dict()
    return any(not torch.equal(before[k], after[k]) for k in before)


def batch(lengths_PG, adv_PG):
    """A hand-made rollout batch: row i has lengths_PG.flatten()[i] tokens (token id 5 + i)."""
    P, G = lengths_PG.shape
    lengths = lengths_PG.flatten().tolist()
    T = max(lengths)
    mask = torch.tensor([[1.0] * n + [0.0] * (T - n) for n in lengths])
    tokens = torch.stack([torch.full((T,), 5 + i) for i in range(P * G)]) * mask.long()
    rollouts = Rollout.single_turn(
        prompt_ids=[[1, p] for p in range(P)], token_ids=tokens, mask=mask, behaviour_logprobs=-mask,
        finished=torch.ones(P * G, dtype=torch.bool), texts=[str(i) for i in range(P * G)], n=G,
    )
    row_prompts = [[1, p] for p in range(P) for _ in range(G)]
    inputs = {"rewards": torch.arange(P * G).float(), "group_ids": torch.arange(P).repeat_interleave(G)}
    return UpdateBatch(row_prompts, rollouts, mask, adv_PG.flatten(), inputs)


def test_shuffle_r1_trains_the_outermost_pair_of_each_group_in_order():
    # catalog L139: r = [1, 0.5, 0, 0.2] -> A = [1.3220, 0.1724, -0.9772, -0.5173]; order [0, 1, 3, 2];
    # pairs (0, 2) and (1, 3); prune 0.5 keeps (0, 2). Group 1: r = [0, 1, 0, 1] -> order [1, 3, 0, 2]
    # (ties keep their order), pairs (1, 2), (3, 0); keeps (1, 2) -> batch rows 5, 6.
    r = torch.tensor([[1.0, 0.5, 0.0, 0.2], [0.0, 1.0, 0.0, 1.0]])
    sel = BatchSelector("shuffle_r1", {**SELECTORS["shuffle_r1"], "replay_times": 1}, 2, 0)
    out = sel.select(batch(torch.full((2, 4), 3), r), r, step=0, state=None, pad_id=0)
    assert [m.tolist() for m in out.minibatches] == [[0, 2], [5, 6]]  # one pair a minibatch, in order
    assert out.metrics["selection/pairs"] == 2 and out.metrics["selection/unique_rows_frac"] == 0.5
    assert out.state is None  # stateless
    # ABS: 8 rounds of one pair each, drawn in proportion to the pair weights: both pairs can recur
    sel = BatchSelector("shuffle_r1", dict(SELECTORS["shuffle_r1"]), 1, 0)
    (plan,) = sel.select(batch(torch.full((2, 4), 3), r), r, step=0, state=None, pad_id=0).minibatches
    assert len(plan) == 16 and set(plan.tolist()) <= {0, 2, 5, 6}
    assert plan.view(-1, 2).tolist().count([0, 2]) + plan.view(-1, 2).tolist().count([5, 6]) == 8


def test_rorecomp_priority_then_compensation_from_the_buffer():
    # catalog L123: r = [1, 1, 0, 0], lengths [1, 3, 2, 4] (x100 in the catalog) -> priority rows 0
    # (short-correct) and 3 (long-wrong); rows 1 and 2 go to the compensation buffer.
    r = torch.tensor([[1.0, 1.0, 0.0, 0.0]])
    adv = torch.tensor([[0.866, 0.866, -0.866, -0.866]])
    sel = BatchSelector("rorecomp", {**SELECTORS["rorecomp"], "compensation_every": 2}, 1, 0)
    first = sel.select(batch(torch.tensor([[1, 3, 2, 4]]), adv), r, step=0, state=None, pad_id=0)
    assert [m.tolist() for m in first.minibatches] == [[0, 3]]  # step 0 is no compensation step
    assert first.state["items"] == [0, 1] and first.state["samples"][1]["tokens"] == [7, 7]  # row 2: 2 tokens
    assert first.metrics == {"selection/priority_frac": 0.5, "selection/compensation_rows": 0.0,
                             "selection/buffer_size": 2.0}
    second = sel.select(batch(torch.tensor([[1, 3, 2, 4]]), adv), r, step=1, state=first.state, pad_id=0)
    # step 1 compensates: 2 rows (the priority batch's size) drawn from the buffer as it was, appended
    assert [m.tolist() for m in second.minibatches] == [[0, 3], [4, 5]]
    assert sorted(second.adv_N[4:].tolist()) == pytest.approx([-0.866, 0.866])  # their stored advantages
    assert second.rollouts.token_ids.shape == (6, 4) and second.mask_NT[4:].sum() == 3 + 2
    assert second.row_inputs["group_ids"][4:].tolist() == [1, 1]  # one earlier group, not this step's 0
    assert second.state["items"] == [2, 3] and sorted(second.state["samples"]) == [2, 3]


def test_selector_config_errors_name_key_value_and_choices(tiny_cfg):
    with pytest.raises(ConfigError, match=r"batch_selector.*'shufle'.*choices"):
        tiny_cfg('algorithm.batch_selector="shufle"')
    with pytest.raises(ConfigError, match=r"no parameter\(s\) \['prune'\]; accepted"):
        tiny_cfg('algorithm.batch_selector="shuffle_r1"', "algorithm.batch_selector_params={prune=0.2}")
    with pytest.raises(ConfigError, match=r"weight: must be one of"):
        tiny_cfg('algorithm.batch_selector="shuffle_r1"', 'algorithm.batch_selector_params={weight="min"}')
    with pytest.raises(ConfigError, match=r"group_size=2"):
        tiny_cfg('algorithm.batch_selector="shuffle_r1"', "rollout.group_size=2")
    with pytest.raises(ConfigError, match=r"compensation_every: must be >= 0"):
        tiny_cfg('algorithm.batch_selector="rorecomp"', "algorithm.batch_selector_params={compensation_every=-1}")


def test_shuffle_r1_in_the_loop(tiny_cfg, quiet, tmp_path, test_entries):
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", 'reward=[{name="test_length"}]', "train.lr=1e-2",
                   'algorithm.batch_selector="shuffle_r1"', "train.minibatches=2")
    train(cfg, console=quiet)
    for r in rows(tmp_path / "run"):
        assert r["selection/pairs"] == 8  # P = 8 groups x K = int((4 // 2) * 0.5) = 1 pair
        assert r["selection/train_rows"] == 16  # 8 rounds x 1 pair x 2 rows
        assert r["selection/unique_rows_frac"] <= 0.5  # at most the 16 paired rows of 32
        assert r["train/optimizer_steps"] == 2 and r["loss"] == r["loss"] and r["train/nonfinite"] == 0
    assert params_changed(tmp_path / "run", 2)


RORECOMP = ('reward=[{name="test_length"}]', 'algorithm.batch_selector="rorecomp"',
            "algorithm.batch_selector_params={correct_above=3.0, compensation_every=2}")


def test_rorecomp_in_the_loop_and_resume_continues_the_buffer(tiny_cfg, quiet, tmp_path, test_entries):
    common = (*RORECOMP, "checkpoint.every=1")
    train(tiny_cfg("train.steps=4", *common, out=str(tmp_path / "full")), console=quiet)
    train(tiny_cfg("train.steps=2", *common, out=str(tmp_path / "cut")), console=quiet)
    train(tiny_cfg("train.steps=4", *common, out=str(tmp_path / "cut")), console=quiet, resume=True)
    full = rows(tmp_path / "full")
    assert [r["selection/compensation_rows"] > 0 for r in full] == [False, True, False, True]
    assert all(0 < r["selection/priority_frac"] < 1 and r["loss"] == r["loss"] for r in full)
    assert [r["train/optimizer_steps"] for r in full] == [1, 2, 1, 2]  # the compensation batch is one more
    assert params_changed(tmp_path / "full", 4)
    a = load_trainer_state(latest_checkpoint(tmp_path / "full" / "checkpoints"))["loop"]
    b = load_trainer_state(latest_checkpoint(tmp_path / "cut" / "checkpoints"))["loop"]
    assert a["entry_states"]["batch_selector"]["items"] and a["entry_states"] == b["entry_states"]
    strip = [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in full]
    assert strip == [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows(tmp_path / "cut")]
