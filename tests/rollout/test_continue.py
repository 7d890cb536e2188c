"""rollout.on_new_weights = "continue": a batch cut by newer weights keeps every token it sampled, and its unfinished
rows go on from where they were cut with the newer weights (AReaL's partial rollouts;
posttrain/rollout/resubmit.py, posttrain/produce/pipeline.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.models import load_model
from posttrain.rollout import HFEngine, SamplingParams
from posttrain.rollout.resubmit import ResubmittingEngine

from .test_resubmit import SP, newer_weights, published_mid_batch, recomputed


class Recording(HFEngine):
    """The hf engine, noting the sampling parameters of every call."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[SamplingParams] = []

    def generate(self, prompts, sampling, seed=None, interrupt=None):
        self.calls.append(sampling)
        return super().generate(prompts, sampling, seed, interrupt=interrupt)


def cut_after(k, engine):
    """An interrupt that fires once ``k`` decode steps have run on the engine's first weights."""
    asked = []

    def newer() -> bool:
        asked.append(1)
        return len(asked) >= k and engine.version == 0

    return newer


def test_a_cut_row_keeps_its_tokens_and_goes_on_with_the_newer_weights(arith_tiny):
    d, tok, prompts = arith_tiny
    model = load_model(str(d)).eval()
    whole = HFEngine(model, tok).generate(prompts, SP, seed=3)  # the batch no newer weights interrupt
    new = newer_weights(model)
    inner = Recording(copy.deepcopy(model), tok)
    engine = ResubmittingEngine(inner, cut_after(4, inner), lambda: (new, 7), mode="continue")
    got = engine.generate(prompts, SP, seed=3)
    ended = [i for i in range(16) if int(whole.lengths[i]) <= 4 and bool(whole.finished[i])]
    cut = [i for i in range(16) if i not in ended]
    assert ended and cut  # seed 3: a mix (the tiny untrained model draws EOS about 1 in 30)
    for i in ended:  # as without the cut
        n = int(whole.lengths[i])
        assert torch.equal(got.token_ids[i, :n], whole.token_ids[i, :n]) and int(got.lengths[i]) == n
    for i in cut:  # the 4 tokens drawn before the cut are kept: the uninterrupted batch's own first 4
        assert torch.equal(got.token_ids[i, :4], whole.token_ids[i, :4])
    # the tails had the rest of the budget: 12 - 4 = 8 tokens at most, so no row is longer than 12
    assert inner.calls[1].max_new_tokens == 8 and inner.calls[1].n == 1
    assert int(got.lengths.max()) <= 12 and got.token_ids.shape[1] <= 12
    assert all(int(got.lengths[i]) == 12 or bool(got.finished[i]) for i in cut)
    # a continued row is as old as its first token; every token's log-prob is that of the policy that drew it
    assert got.policy_version.tolist() == [0] * 16
    newer_model = copy.deepcopy(model)
    newer_model.load_state_dict(new)
    mask = got.loss_mask > 0
    before, after = mask.clone(), mask.clone()
    before[cut, 4:] = False
    after[:, :4], after[ended] = False, False
    assert (recomputed(model, got) - got.behaviour_logprobs)[before].abs().max() < 1e-4
    assert (recomputed(newer_model, got) - got.behaviour_logprobs)[after].abs().max() < 1e-4
    assert bool(after.any())
    # texts are decoded from all of a row's tokens
    for i in cut:
        ids = [t for t in got.token_ids[i][mask[i]].tolist() if t != tok.eos_token_id]
        assert got.texts[i] == tok.decode(ids, skip_special_tokens=True)
    assert engine.pop_counts() == {"rollout/continued": float(len(cut)), "rollout/kept_tokens": 4.0 * len(cut)}
    assert engine.pop_counts()["rollout/continued"] == 0.0  # zeroed
    # by the policy that drew them: the ended rows and the cut rows' first 4 tokens version 0, the rest 7
    total = int(got.lengths.sum())
    old = sum(int(got.lengths[i]) for i in ended) + 4 * len(cut)
    assert engine.pop_token_versions() == {0: old, 7: total - old} and engine.pop_token_versions() == {}


def test_the_continuation_keeps_the_rows_min_new_tokens(arith_tiny):
    d, tok, prompts = arith_tiny
    model = load_model(str(d)).eval()
    inner = Recording(model, tok)
    engine = ResubmittingEngine(inner, cut_after(3, inner), lambda: (model.state_dict(), 1), mode="continue")
    got = engine.generate(prompts[:2], SamplingParams(max_new_tokens=12, n=2, min_new_tokens=6), seed=0)
    # cut after 3 tokens: the tails may not end before 6 - 3 = 3 more, and take at most 12 - 3 = 9
    assert [(c.min_new_tokens, c.max_new_tokens) for c in inner.calls[1:]] == [(3, 9)]
    assert int(got.lengths.min()) >= 7  # EOS (counted) is never among the first 6 tokens


def test_a_row_cut_twice_is_continued_twice(arith_tiny):
    d, tok, prompts = arith_tiny
    model = load_model(str(d)).eval()
    inner = Recording(model, tok)
    versions = iter([(model.state_dict(), 1), (model.state_dict(), 2)])
    asked = []

    def newer() -> bool:  # newer weights after the 2nd decode step of each of the first two calls
        asked.append(1)
        return len(inner.calls) <= 2 and len(asked) % 2 == 0

    engine = ResubmittingEngine(inner, newer, lambda: next(versions), mode="continue")
    got = engine.generate(prompts[:2], SP, seed=0)
    assert [c.max_new_tokens for c in inner.calls] == [12, 10, 8]  # cut at 2, then at 2 + 2 = 4
    counts = engine.pop_counts()  # all 8 rows continued after 2 tokens; those still running, again after 4
    again = counts["rollout/continued"] - 8
    assert again > 0 and counts["rollout/kept_tokens"] == 2.0 * 8 + 4.0 * again
    # version 0 drew the first 2 tokens of every row, version 1 the next 2 of the rows cut again (the rest of the
    # others), version 2 the rest of those
    tv = engine.pop_token_versions()
    assert tv[0] == 16 and tv[1] >= 2 * again and sum(tv.values()) == int(got.lengths.sum()) and tv[2] > 0
    assert int(got.lengths.max()) <= 12 and got.policy_version.tolist() == [0] * 8


# --- in the pipeline: weights published while the producer decodes batch 1 ---


def test_the_pipeline_continues_cut_rows_with_the_weights_the_learner_publishes(arith_tiny):
    d, tok, prompts = arith_tiny
    model = load_model(str(d)).eval()
    v1 = newer_weights(model, 0.1)
    whole = HFEngine(copy.deepcopy(model), tok).generate(prompts, SP, seed=1)

    (b0, m0), (b1, m1) = published_mid_batch(model, tok, prompts, v1, "continue")
    assert m0["offpolicy/staleness_max"] == 0.0 and m0["rollout/continued"] == 0.0
    # batch 1 was cut after its first token: every row that had not ended goes on with step 1's weights,
    # but keeps its first token (step 0's), so every row stays one step old
    r = b1.rollouts
    assert m1["rollout/continued"] == m1["rollout/kept_tokens"] == 16 - int((r.lengths == 1).sum())
    assert m1["offpolicy/staleness_max"] == m1["offpolicy/staleness_mean"] == 1.0
    # per token, only the first token of each row is a step old
    assert m1["offpolicy/token_staleness_mean"] == pytest.approx(16 / int(r.lengths.sum()))
    assert m0["offpolicy/token_staleness_mean"] == 0.0
    assert torch.equal(r.token_ids[:, 0], whole.token_ids[:, 0])  # the first token: step 0's weights, seed 1
    later = r.loss_mask.bool().clone()
    later[:, 0] = False
    newer_model = copy.deepcopy(model)
    newer_model.load_state_dict(v1)
    assert (recomputed(newer_model, r) - r.behaviour_logprobs)[later].abs().max() < 1e-4
