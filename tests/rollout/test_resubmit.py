"""rollout.on_new_weights = "resubmit": a batch cut by newer weights keeps its ended rows and samples its
unfinished ones again with the newer weights (posttrain/rollout/resubmit.py, posttrain/produce/pipeline.py).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.learn.logprobs import completion_logprobs
from posttrain.models import load_model
from posttrain.produce.pipeline import RolloutPipeline
from posttrain.rollout import HFEngine, SamplingParams
from posttrain.rollout.resubmit import ResubmittingEngine

SP = SamplingParams(max_new_tokens=12, n=4)


def newer_weights(model, scale=0.5):
    """The model's weights moved by seeded noise: another policy."""
    g = torch.Generator().manual_seed(1)
    return {k: v + scale * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}


def recomputed(model, r):
    """Log-probs of ``r``'s tokens under ``model``, [N, T]."""
    with torch.no_grad():
        return completion_logprobs(model, r.row_prompts, r.token_ids, r.attention_mask, pad_id=0)[0]


def test_a_cut_batch_keeps_its_ended_rows_and_samples_the_others_again_with_the_newer_weights(arith_tiny):
    d, tok, prompts = arith_tiny
    model = load_model(str(d)).eval()
    plain = HFEngine(model, tok)
    whole = plain.generate(prompts, SP, seed=3)  # the batch no newer weights interrupt
    new = newer_weights(model)
    asked = []

    def newer() -> bool:  # asked after each token that leaves rows running: newer weights come with the 4th
        asked.append(1)
        return len(asked) >= 4 and inner.version == 0

    inner = HFEngine(copy.deepcopy(model), tok)
    engine = ResubmittingEngine(inner, newer, lambda: (new, 7))
    got = engine.generate(prompts, SP, seed=3)
    # the cut came after 4 tokens; the rows that had ended by then keep theirs, the same as without the cut
    ended = [i for i in range(16) if int(whole.lengths[i]) <= 4 and bool(whole.finished[i])]
    cut = [i for i in range(16) if i not in ended]
    assert ended and cut  # seed 3: a mix (the tiny untrained model draws EOS about 1 in 30)
    for i in ended:
        n = int(whole.lengths[i])
        assert torch.equal(got.token_ids[i, :n], whole.token_ids[i, :n]) and int(got.lengths[i]) == n
        assert int(got.policy_version[i]) == 0
    assert all(int(got.policy_version[i]) == 7 for i in cut)
    # every row is one policy's: the ended rows' log-probs are the old model's, the resampled ones the new's
    newer_model = copy.deepcopy(model)
    newer_model.load_state_dict(new)
    mask = got.loss_mask > 0
    for rows, m in ((ended, model), (cut, newer_model)):
        diff = (recomputed(m, got) - got.behaviour_logprobs)[rows][mask[rows]]
        assert diff.abs().max() < 1e-4
    counts = engine.pop_counts()
    assert counts == {"rollout/resubmitted": float(len(cut)), "rollout/dropped_tokens": 4.0 * len(cut)}
    assert engine.pop_counts()["rollout/resubmitted"] == 0.0  # zeroed


def test_without_newer_weights_the_batch_is_the_engines_own(arith_tiny):
    d, tok, prompts = arith_tiny
    model = load_model(str(d)).eval()
    whole = HFEngine(model, tok).generate(prompts, SP, seed=5)
    got = ResubmittingEngine(HFEngine(model, tok), lambda: False, lambda: pytest.fail("no take")).generate(
        prompts, SP, seed=5)
    assert torch.equal(got.token_ids, whole.token_ids) and got.texts == whole.texts


def test_an_engine_that_cannot_stop_mid_batch_is_refused():
    class Plain:
        pad_id = 0

    with pytest.raises(ValueError, match="cannot"):
        ResubmittingEngine(Plain(), lambda: False, lambda: ({}, 0))


# --- in the pipeline: weights published while the producer decodes batch 1 ---


@dataclass
class Batch:
    rollouts: object
    consumed: int = 1


@dataclass
class Ctx:
    engine: object
    tokenizer: object = None


def published_mid_batch(model, tok, prompts, v1, partial):
    """Batches 0 and 1 of an S = 1 pipeline (with their metrics) whose learner publishes weights ``v1`` as
    version 10 while the producer decodes batch 1 (sampled with step 0's weights).
    """

    def collect(ctx, step, cursor, shapers, driver):
        if step == 1:
            pipe.publish(1, v1, 10)
        return Batch(ctx.engine.generate(prompts, SP, seed=step))

    pipe = RolloutPipeline.build(collect, Ctx(HFEngine(model, tok)), 1, 3,
                                 lambda m, t: HFEngine(m, tok), on_new_weights=partial)
    pipe.start(0, 0, b"", SimpleNamespace(weights_for=lambda engine: model.state_dict()), 0)  # the learner
    try:
        return pipe.take(0, 0, None, None), pipe.take(1, 0, None, None)
    finally:
        pipe.close()


def test_the_pipeline_resamples_with_the_weights_the_learner_publishes_mid_batch(arith_tiny):
    d, tok, prompts = arith_tiny
    model = load_model(str(d)).eval()
    v1 = newer_weights(model, 0.1)

    (b0, m0), (b1, m1) = published_mid_batch(model, tok, prompts, v1, "resubmit")
    assert m0["offpolicy/staleness_max"] == 0.0 and m0["rollout/resubmitted"] == 0.0
    # batch 1 started with step 0's weights (lag 1); its rows cut at the publish were sampled with step 1's
    versions = b1.rollouts.policy_version
    resampled = int((versions == 10).sum())
    assert resampled == m1["rollout/resubmitted"] > 0
    assert m1["offpolicy/staleness_mean"] == pytest.approx((16 - resampled) / 16)
    assert m1["offpolicy/staleness_max"] == (1.0 if resampled < 16 else 0.0)
    # per token: the kept rows' tokens are a step old, the resampled rows' none
    kept = versions != 10
    lengths = b1.rollouts.lengths
    assert m1["offpolicy/token_staleness_mean"] == pytest.approx(float(lengths[kept].sum() / lengths.sum()))


@pytest.mark.parametrize("partial", ["resubmit", "continue"])
@pytest.mark.parametrize(("overrides", "match"), [
    ([], "max_staleness > 0 as well"),
    (["rollout.max_staleness=1", "task.name=env", "task.params={}", 'task.env={name="guess_number", max_tokens=24}'],
     "does not run with the multi_turn driver"),
])
def test_resubmit_or_continue_where_it_cannot_act_is_refused(tiny_cfg, partial, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_cfg(f"rollout.on_new_weights={partial}", *overrides)


@pytest.mark.parametrize(("partial", "cut", "tokens"), [("resubmit", "rollout/resubmitted", "rollout/dropped_tokens"),
                                                        ("continue", "rollout/continued", "rollout/kept_tokens")])
def test_an_async_run_that_cuts_rows_trains_within_its_staleness_bound(tiny_cfg, quiet, tmp_path, length_reward,
                                                                        partial, cut, tokens):
    import json

    from posttrain.train.rl import train

    train(tiny_cfg("rollout.max_staleness=1", f"rollout.on_new_weights={partial}", "train.steps=6", "eval.every=0",
                   "eval.prompts=4", *length_reward), console=quiet)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 6
    for r in rows:  # whatever the timing cut, no row is older than one step (nor any token)
        assert 0.0 <= r["offpolicy/staleness_mean"] <= r["offpolicy/staleness_max"] <= 1.0
        assert 0.0 <= r["offpolicy/token_staleness_mean"] <= 1.0
        assert r[tokens] >= r[cut] >= 0.0
