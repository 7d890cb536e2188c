"""The Rollout batch and the engine's sync / policy version."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.tiny import TinySpec, build_tiny
from posttrain.rollout import Rollout, SamplingParams, concat_rollouts, make_engine
from posttrain.train.rl import train


def _rollout(P: int, n: int, T: int, version: int) -> Rollout:
    N = P * n
    mask = torch.ones(N, T)
    return Rollout.single_turn([[1, p] for p in range(P)], torch.full((N, T), 3), mask, -mask,
                               torch.ones(N, dtype=torch.bool), [str(i) for i in range(N)], n, policy_version=version)


def test_single_turn_masks_are_equal_but_separate_tensors():
    r = _rollout(2, 3, 4, version=5)
    assert torch.equal(r.attention_mask, r.loss_mask)
    r.loss_mask[0, 0] = 0  # a token attended to and not trained on (a tool output, later)
    assert r.attention_mask[0, 0] == 1
    assert r.policy_version.tolist() == [5] * 6
    assert r.group_ids.tolist() == [0, 0, 0, 1, 1, 1]
    assert r.row_prompts[4] == [1, 1]


def test_select_and_concat_keep_rows_together():
    a, b = _rollout(2, 2, 3, version=1), _rollout(1, 2, 5, version=2)
    both = concat_rollouts([a, b], pad_id=0)
    assert both.token_ids.shape == (6, 5) and both.loss_mask[:4, 3:].sum() == 0
    assert both.policy_version.tolist() == [1, 1, 1, 1, 2, 2]
    picked = both.select_groups([2, 0])
    assert picked.policy_version.tolist() == [2, 2, 1, 1] and picked.texts == ["0", "1", "0", "1"]


def test_shapes_are_checked():
    with pytest.raises(ValueError, match="disagree in shape"):
        Rollout([[1]], torch.zeros(1, 3), torch.ones(1, 3), torch.ones(1, 2), torch.zeros(1, 3),
                torch.ones(1, dtype=torch.bool), ["x"], 1)


def test_sync_copies_into_a_separate_engine_model_and_stamps_the_version(tmp_path):
    d = build_tiny(tmp_path / "m", TinySpec(alphabet="0123456789+="))
    tok = load_tokenizer(str(d))
    learner, other = load_model(str(d)), load_model(str(d))
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(0.1 * torch.randn_like(p))
    engine = make_engine("hf", other, tok)
    prompts = [tok("12+3=")["input_ids"]]
    sp = SamplingParams(max_new_tokens=5, n=2)
    before = engine.generate(prompts, sp, seed=0)
    assert before.policy_version.tolist() == [0, 0]
    engine.sync(learner.state_dict(), version=7)
    after = engine.generate(prompts, sp, seed=0)
    assert after.policy_version.tolist() == [7, 7]
    # the engine now samples the learner's policy: same draw as an engine over the learner itself
    own = make_engine("hf", learner, tok).generate(prompts, sp, seed=0)
    assert torch.equal(after.token_ids, own.token_ids)
    torch.testing.assert_close(after.behaviour_logprobs, own.behaviour_logprobs)
    with pytest.raises(KeyError, match="does not have"):
        engine.sync({"nope.weight": torch.zeros(1)}, version=8)


def test_unknown_engine_is_rejected():
    with pytest.raises(ValueError, match="rollout.engine"):
        make_engine("nope", None, None)


def test_the_loop_syncs_every_step(tiny_cfg, quiet):
    cfg = tiny_cfg("train.steps=3", "eval.every=0", "diagnostics.every=0", "checkpoint.every=0")
    train(cfg, console=quiet)
    rows = [json.loads(line) for line in open(cfg.out + "/metrics.jsonl")]
    assert [r["policy/rollout_version"] for r in rows] == [0.0, 1.0, 2.0]  # one optimizer step a step
