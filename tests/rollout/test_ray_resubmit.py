"""rollout.on_new_weights = "resubmit" on Ray rollout workers (cluster.backend = "ray"): an interrupt stops every
worker after its current decode step, the rows each part left running come back flagged cut whatever
width the part stopped at, and ResubmittingEngine samples them again on the workers with the newer
weights; the config takes ray + resubmit with the hf and vllm engines.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import pickle

import pytest
import torch

from posttrain.errors import ConfigError
from posttrain.learn.logprobs import completion_logprobs
from posttrain.models import load_model
from posttrain.rollout import HFEngine, SamplingParams, concat_rollouts
from posttrain.rollout.batch import Rollout
from posttrain.rollout.resubmit import ResubmittingEngine, cut_rows

HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="ray not installed (pip install 'posttrain[ray]')")

SHORT = SamplingParams(max_new_tokens=8, temperature=1.0, n=2)
LONG = SamplingParams(max_new_tokens=24, temperature=1.0, n=2)


@pytest.fixture(scope="module")
def workers(arith_tiny):
    """Two rollout workers over the tiny model (one Ray for the module), and that model."""
    from posttrain.rollout.ray_engine import RayEngine

    d, tok, _ = arith_tiny
    model = load_model(str(d)).eval()
    # a local Ray of 6 logical CPUs: the other tests' actors find room while these two live
    engine = RayEngine(model, tok, workers=2, reserve_cpus=6)
    try:
        yield engine, model
    finally:
        engine.close()


def recomputed(model, r):
    """Log-probs of ``r``'s tokens under ``model``, [N, T]."""
    with torch.no_grad():
        return completion_logprobs(model, r.row_prompts, r.token_ids, r.attention_mask, pad_id=0)[0]


def assert_cut_or_whole(got, full, cut):
    """Each row of ``got`` is ``full``'s (same seed, not interrupted): its first tokens when it was cut,
    all of it otherwise.
    """
    for i in range(got.token_ids.shape[0]):
        n = int(got.lengths[i])
        assert torch.equal(got.token_ids[i, :n], full.token_ids[i, :n]), i
        if i in cut:
            assert not bool(got.finished[i]) and n < int(full.lengths[i]), i
        else:
            assert n == int(full.lengths[i]) and bool(got.finished[i]) == bool(full.finished[i]), i


def test_joined_parts_of_different_widths_keep_their_cut_rows(arith_tiny):
    # an hf part cut after 2 tokens and one that ran to max_new_tokens (its unfinished rows truncated, not
    # cut), joined: the cut rows are narrower than the batch and the truncated ones as wide as it, so only
    # a per-row flag tells them apart
    d, tok, prompts = arith_tiny
    engine = HFEngine(load_model(str(d)).eval(), tok)
    asked = []

    def second_token() -> bool:
        asked.append(1)
        return len(asked) >= 2

    cut_part = engine.generate(prompts[:2], SHORT, seed=1, interrupt=second_token)
    whole_part = engine.generate(prompts[2:], SHORT, seed=2, interrupt=lambda: False)
    assert cut_part.token_ids.shape[1] == 2 and whole_part.token_ids.shape[1] == SHORT.max_new_tokens
    running = [i for i in range(4) if not bool(cut_part.finished[i])]
    truncated = [4 + i for i in range(4) if not bool(whole_part.finished[i])]
    assert running and truncated and cut_rows(cut_part) == running and cut_rows(whole_part) == []
    both = concat_rollouts([cut_part, whole_part], engine.pad_id)
    assert cut_rows(both) == running
    assert both.select_groups([1, 0]).cut.tolist() == both.cut[[2, 3, 0, 1]].tolist()
    # a Rollout pickled before the flag existed (a checkpoint's batches made ahead) loads with no row cut
    old = dict(both.__dict__)
    del old["cut"]
    loaded = Rollout.__new__(Rollout)
    loaded.__setstate__(old)
    assert cut_rows(loaded) == [] and pickle.loads(pickle.dumps(both)).cut.tolist() == both.cut.tolist()


@needs_ray
def test_ray_parts_stopped_at_different_steps_come_back_with_their_cut_rows(arith_tiny, workers):
    # worker 1 is told to stop the next call before that call begins: it stops after its first token while
    # worker 0 (never told: the interrupt stays False) runs to max_new_tokens; rows 0-3 are worker 0's
    import ray

    from posttrain.rollout.ray_engine import CONTROL

    engine, _ = workers
    _, _, prompts = arith_tiny
    full = engine.generate(prompts, SHORT, seed=4)
    ray.get(engine.workers[1].stop.options(concurrency_group=CONTROL).remote(engine.calls + 1))
    got = engine.generate(prompts, SHORT, seed=4, interrupt=lambda: False)
    cut = cut_rows(got)
    assert cut and cut == [i for i in range(4, 8) if not bool(got.finished[i])]
    assert all(int(got.lengths[i]) == 1 for i in cut)
    assert any(not bool(got.finished[i]) for i in range(4))  # worker 0's truncated rows: unfinished, not cut
    assert_cut_or_whole(got, full, cut)
    # the stop named that call only: the next call runs whole
    again = engine.generate(prompts, SHORT, seed=4, interrupt=lambda: False)
    assert cut_rows(again) == [] and torch.equal(again.token_ids, full.token_ids)


@needs_ray
def test_an_interrupt_stops_every_ray_worker_mid_batch(arith_tiny, workers):
    engine, _ = workers
    _, _, prompts = arith_tiny
    asked = []

    def now() -> bool:
        asked.append(1)
        return True

    full = engine.generate(prompts, LONG, seed=5)
    got = engine.generate(prompts, LONG, seed=5, interrupt=now)
    cut = cut_rows(got)
    assert asked and cut  # stopped long before 24 tokens
    assert all(int(got.lengths[i]) < LONG.max_new_tokens for i in cut)
    assert_cut_or_whole(got, full, cut)  # the rows that had ended keep their tokens


@needs_ray
def test_resubmitting_on_ray_workers_samples_the_cut_rows_again_with_the_newer_weights(arith_tiny, workers):
    engine, model = workers
    _, _, prompts = arith_tiny
    engine.sync(model.state_dict(), 0)
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    # newer weights are there from the start: the first pass is stopped at once, its running rows redone
    resub = ResubmittingEngine(engine, lambda: engine.version == 0, lambda: (new, 7))
    got = resub.generate(prompts, LONG, seed=6)
    counts = resub.pop_counts()
    assert engine.version == 7 and cut_rows(got) == []
    redone = [i for i in range(8) if int(got.policy_version[i]) == 7]
    kept = [i for i in range(8) if int(got.policy_version[i]) == 0]
    assert redone and len(redone) + len(kept) == 8
    assert counts["rollout/resubmitted"] == len(redone) and counts["rollout/dropped_tokens"] >= len(redone)
    for i in range(8):  # every row complete: ended, or as long as max_new_tokens allows
        assert bool(got.finished[i]) or int(got.lengths[i]) == LONG.max_new_tokens
    # each row is one policy's: the kept rows' log-probs are the old weights', the redone rows' the new ones'
    newer_model = copy.deepcopy(model)
    newer_model.load_state_dict(new)
    mask = got.loss_mask > 0
    for rows, m in ((kept, model), (redone, newer_model)):
        if rows:
            assert (recomputed(m, got) - got.behaviour_logprobs)[rows][mask[rows]].abs().max() < 1e-4
    assert (recomputed(model, got) - got.behaviour_logprobs)[redone][mask[redone]].abs().max() > 1e-2


@needs_ray
def test_continuing_on_ray_workers_goes_on_from_the_cut_with_the_newer_weights(arith_tiny, workers):
    engine, model = workers
    _, _, prompts = arith_tiny
    engine.sync(model.state_dict(), 0)
    g = torch.Generator().manual_seed(1)
    new = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()}
    # newer weights are there from the start: each worker stops at once, and its running rows go on
    cont = ResubmittingEngine(engine, lambda: engine.version == 0, lambda: (new, 7), mode="continue")
    got = cont.generate(prompts, LONG, seed=6)
    counts = cont.pop_counts()
    assert engine.version == 7 and cut_rows(got) == [] and counts["rollout/continued"] > 0
    assert got.policy_version.tolist() == [0] * 8  # a row is as old as its first token
    for i in range(8):  # every row complete: ended, or as long as max_new_tokens allows
        assert bool(got.finished[i]) or int(got.lengths[i]) == LONG.max_new_tokens
    # each row is the old weights' up to where its worker stopped, the new weights' after it
    newer_model = copy.deepcopy(model)
    newer_model.load_state_dict(new)
    mask = got.loss_mask > 0
    old_ok = (recomputed(model, got) - got.behaviour_logprobs).abs() < 1e-4
    new_ok = (recomputed(newer_model, got) - got.behaviour_logprobs).abs() < 1e-4
    heads = 0
    for i in range(8):
        n = int(got.lengths[i])
        k = next((t for t in range(n) if not bool(old_ok[i, t])), n)  # the first token the old weights did not draw
        assert bool(new_ok[i, k:n].all()) and bool(mask[i, :n].all())
        heads += k if k < n else 0
    assert heads == counts["rollout/kept_tokens"]


@needs_ray
def test_a_worker_that_dies_during_an_interruptible_batch_is_dropped(arith_tiny):
    import ray

    from posttrain.rollout.ray_engine import RayEngine

    d, tok, prompts = arith_tiny
    engine = RayEngine(load_model(str(d)).eval(), tok, workers=2)
    try:
        ray.kill(engine.workers[1])
        with pytest.warns(RuntimeWarning, match="rollout worker 1 died.*1 worker"):
            out = engine.generate(prompts, SHORT, seed=3, interrupt=lambda: False)
        assert out.token_ids.shape[0] == 8 and len(engine.workers) == 1 and cut_rows(out) == []
    finally:
        engine.close()


# --- config ---


def test_resubmit_with_ray_workers_and_the_hf_engine_is_accepted(tiny_cfg):
    cfg = tiny_cfg("cluster.backend=ray", "rollout.max_staleness=1", "rollout.on_new_weights=resubmit")
    assert (cfg.cluster.backend, cfg.rollout.on_new_weights, cfg.rollout.engine) == ("ray", "resubmit", "hf")


@pytest.mark.parametrize("backend", ["ray", "local"])
def test_resubmit_with_the_vllm_engine_is_taken(tiny_cfg, monkeypatch, backend):
    # the vllm engine stops between scheduler steps, in this process or on a worker told by a StopBoard
    from posttrain.rollout import vllm_engine

    monkeypatch.setattr(vllm_engine, "vllm_available", lambda: True)  # the config, not the install
    cfg = tiny_cfg(f"cluster.backend={backend}", "rollout.max_staleness=1", "rollout.on_new_weights=resubmit",
                   'rollout.engine="vllm"')
    assert cfg.rollout.on_new_weights == "resubmit"


def test_resubmit_with_ray_workers_and_the_multi_turn_driver_is_refused(tiny_cfg):
    with pytest.raises(ConfigError, match="does not run with the multi_turn driver"):
        tiny_cfg("cluster.backend=ray", "rollout.max_staleness=1", "rollout.on_new_weights=resubmit", "task.name=env",
                 "task.params={}", 'task.env={name="guess_number", max_tokens=24}')


@needs_ray
@pytest.mark.slow
def test_a_resubmitting_async_run_trains_on_ray_workers_within_its_staleness_bound(tiny_cfg, quiet, tmp_path,
                                                                                   length_reward):
    from posttrain.train.rl import train

    train(tiny_cfg("cluster.backend=ray", "cluster.rollout_workers=2", "rollout.max_staleness=1",
                   "rollout.on_new_weights=resubmit", "train.steps=4", "checkpoint.every=0", "eval.every=0",
                   "eval.prompts=4", *length_reward), console=quiet)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 4
    for r in rows:  # whatever the timing resubmitted, no row is older than one step
        assert 0.0 <= r["offpolicy/staleness_mean"] <= r["offpolicy/staleness_max"] <= 1.0
        assert r["rollout/dropped_tokens"] >= r["rollout/resubmitted"] >= 0.0
    assert rows[-1]["policy/rollout_version"] > 0
