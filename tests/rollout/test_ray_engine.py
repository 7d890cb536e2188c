"""Rollout workers on Ray (cluster.backend = "ray"): a run trains with them and its engine samples the
learner's policy after every sync; the split is complete and seeded; a dead worker is dropped and
sampling goes on; an unreachable address and a missing ray are clear errors.
"""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.errors import ConfigError
from posttrain.rollout import SamplingParams

HAS_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAS_RAY, reason="ray not installed (pip install 'posttrain[ray]')")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from posttrain.models.tiny import TinySpec, build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny") / "model", TinySpec())


@pytest.mark.skipif(HAS_RAY, reason="checks the message shown where ray is missing")
def test_without_ray_the_error_says_how_to_install_it(tiny_cfg, quiet):
    from posttrain.train.rl import train

    with pytest.raises(ConfigError, match="posttrain\\[ray\\]"):
        train(tiny_cfg("cluster.backend=ray", "train.steps=1"), console=quiet)


def test_a_worker_refuses_weights_its_plain_model_does_not_have(tiny_model_dir):
    # a LoRA policy's adapter tensors are not a plain model's: a worker that ignored them would keep sampling
    # its old policy while reporting the new version (what an asynchronous LoRA run once published)
    from posttrain.rollout.ray_engine import EngineWorker

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    threads = torch.get_num_threads()
    worker = EngineWorker(model.config, model.state_dict(), tok)
    assert torch.get_num_threads() == threads  # built in this process, it leaves the thread count alone
    w = {k: v + 0.5 for k, v in model.state_dict().items()}
    assert worker.sync(w, 3) > 0 and worker.engine.version == 3
    assert torch.equal(worker.model.model.norm.weight, w["model.norm.weight"])  # plain weights land
    lora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(4, 64)}
    with pytest.raises(ValueError, match=r"not a plain model's.*lora_A"):
        worker.sync(lora, 4)
    assert worker.engine.version == 3


@needs_ray
def test_an_asynchronous_lora_run_on_ray_workers_syncs_the_merged_policy(tiny_cfg, quiet, tmp_path):
    # the producer's engine is the workers: the learner publishes its merged weights (Learner.weights_for), which
    # they load (an adapter's tensors would be refused, above); the samples' versions trail the learner's by one
    from posttrain.train.rl import train

    train(tiny_cfg("cluster.backend=ray", "cluster.rollout_workers=1", "rollout.max_staleness=1", "model.lora.rank=4",
                   "train.steps=3", "checkpoint.every=0", "eval.every=0", "eval.prompts=4", "train.lr=5e-2"),
          console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["offpolicy/staleness_max"] for r in rows] == [0, 1, 1]
    assert rows[-1]["policy/rollout_version"] > 0


@needs_ray
def test_an_unreachable_address_is_refused_at_once():
    from posttrain.rollout.ray_engine import check_address

    with pytest.raises(ConfigError, match=r"cluster.address = '127.0.0.1:1': cannot reach it"):
        check_address("127.0.0.1:1", timeout_s=2)
    check_address("")  # a local Ray: nothing to check
    check_address("auto")


@needs_ray
def test_workers_split_the_prompts_and_the_draw_is_a_function_of_the_seed(tiny_model_dir):
    from posttrain.rollout import HFEngine, concat_rollouts
    from posttrain.rollout.ray_engine import RayEngine, worker_seed

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RayEngine(model, tok, workers=2)
    try:
        assert len(set(engine.pids)) == 2  # two processes
        prompts = [tok.encode(t) for t in ("1+1=", "2+2=", "3+3=")]
        sp = SamplingParams(max_new_tokens=6, temperature=1.0, n=2)
        a, b, c = engine.generate(prompts, sp, seed=7), engine.generate(prompts, sp, seed=7), engine.generate(
            prompts, sp, seed=8)
        assert a.token_ids.shape[0] == 6 and a.prompt_ids == prompts  # 3 prompts x n = 2, in order
        assert torch.equal(a.token_ids, b.token_ids) and not torch.equal(a.token_ids, c.token_ids)
        # after a sync each worker samples exactly what a local hf engine over the new weights samples
        # for its part (prompts 0-1 on worker 0, prompt 2 on worker 1) with its derived seed
        gen = torch.Generator().manual_seed(0)
        moved = {k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items()}
        engine.sync(moved, 5)
        z = engine.generate(prompts, sp, seed=7)
        local = copy.deepcopy(model)
        local.load_state_dict(moved)
        parts = [HFEngine(local, tok).generate(ps, sp, seed=worker_seed(7, k))
                 for k, ps in enumerate((prompts[:2], prompts[2:]))]
        want = concat_rollouts(parts, engine.pad_id)
        assert engine.version == 5 and torch.equal(z.token_ids, want.token_ids)
        assert not torch.equal(z.token_ids, a.token_ids)
    finally:
        engine.close()


@needs_ray
def test_a_dead_worker_is_dropped_and_sampling_goes_on(tiny_model_dir):
    import ray

    from posttrain.rollout.ray_engine import RayEngine

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RayEngine(model, tok, workers=2)
    try:
        prompts = [tok.encode(t) for t in ("1+1=", "2+2=", "3+3=")]
        sp = SamplingParams(max_new_tokens=4, temperature=1.0, n=2)
        ray.kill(engine.workers[1])
        with pytest.warns(RuntimeWarning, match="rollout worker 1 died.*1 worker"):
            out = engine.generate(prompts, sp, seed=3)
        assert out.token_ids.shape[0] == 6 and len(engine.workers) == 1
        ray.kill(engine.workers[0])
        with pytest.warns(RuntimeWarning), pytest.raises(RuntimeError, match="every rollout worker died"):
            engine.generate(prompts, sp, seed=3)
    finally:
        engine.close()


@needs_ray
@pytest.mark.slow
def test_a_run_trains_with_two_ray_rollout_workers(tiny_cfg, quiet, tmp_path, test_entries):
    # the length reward moves the policy every step; the learner recomputes pi_old and compares it with
    # the workers' log-probs: ratios of 1 mean each worker sampled the synced policy of that step
    from posttrain.train.rl import train

    cfg = tiny_cfg("cluster.backend=ray", "cluster.rollout_workers=2", "train.steps=3", "checkpoint.every=0",
                   "eval.every=0", "eval.prompts=4", 'reward=[{name="test_length"}]', "train.minibatches=2",
                   "train.lr=5e-2")
    train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    assert rows[-1]["policy/entropy"] != rows[0]["policy/entropy"]  # the policy moved
    for r in rows:
        assert abs(r["offpolicy/ratio_max"] - 1) < 1e-3 and r["reward/mean"] > 0


@needs_ray
@pytest.mark.slow
def test_an_asynchronous_run_samples_on_the_ray_workers_within_its_staleness(tiny_cfg, quiet, tmp_path, test_entries):
    # rollout.max_staleness = 1: the producer thread samples batch i on the workers with the weights of
    # learner step i - 1, so each batch is at most one version old, and the workers take the versions in
    # the order the local producer's engine does
    from posttrain.train.rl import train

    common = ("rollout.max_staleness=1", "train.steps=4", "checkpoint.every=0", "eval.every=0", "eval.prompts=4",
              'reward=[{name="test_length"}]', "train.lr=5e-2")
    train(tiny_cfg(*common, "cluster.backend=ray", "cluster.rollout_workers=2", out=str(tmp_path / "ray")),
          console=quiet)
    train(tiny_cfg(*common, out=str(tmp_path / "local")), console=quiet)
    ray_rows, local_rows = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                            for d in ("ray", "local"))
    assert [r["offpolicy/staleness_max"] for r in ray_rows] == [0, 1, 1, 1]
    assert [r["policy/rollout_version"] for r in ray_rows] == [r["policy/rollout_version"] for r in local_rows]
    assert ray_rows[-1]["policy/rollout_version"] > 0


@needs_ray
def test_a_worker_samples_with_the_runs_autocast(tiny_model_dir):
    # model.autocast reaches the workers' engines: a worker's draw equals a local bf16 hf engine's, token for token
    from posttrain.rollout import HFEngine
    from posttrain.rollout.ray_engine import RayEngine, worker_seed

    model, tok = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    engine = RayEngine(model, tok, workers=1, autocast="bfloat16")
    try:
        prompts = [tok.encode(t) for t in ("1+1=", "2+2=")]
        sp = SamplingParams(max_new_tokens=6, temperature=1.0, n=2)
        got = engine.generate(prompts, sp, seed=3)
        want = HFEngine(model, tok, autocast=torch.bfloat16).generate(prompts, sp, seed=worker_seed(3, 0))
        assert torch.equal(got.token_ids, want.token_ids)
        torch.testing.assert_close(got.behaviour_logprobs, want.behaviour_logprobs)
    finally:
        engine.close()
