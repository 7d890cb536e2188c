"""rollout.max_staleness: the producer thread samples step i's batch with the policy of step i - S, and the
pipeline hands the learner's weights to the engines, sync or async alike (posttrain/produce/pipeline.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from posttrain.errors import ConfigError
from posttrain.models.load import encode_chat
from posttrain.produce.pipeline import RolloutPipeline
from posttrain.rollout import HFEngine, SamplingParams
from posttrain.seeds import derive_seed
from posttrain.train.rl import train

ROOT = Path(__file__).resolve().parents[2]


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def strip_timing(r: dict) -> dict:
    return {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}


# --- the pipeline's schedule, with a recording engine and collect (no model) ---


@dataclass
class _Batch:
    step: int
    version: int  # the engine's weights when the batch was made
    consumed: int = 2


class _Engine:
    def __init__(self) -> None:
        self.model = torch.nn.Linear(1, 1)
        self.version = -1
        self.synced: list[int] = []  # the versions it was handed, in order

    def sync(self, weights, version) -> None:
        self.version = version
        self.synced.append(version)


class _Learner:
    """The learner's side of the hand-off (``WeightsSource``): its weights as each engine takes them."""

    def __init__(self) -> None:
        self.asked: list[object] = []  # the engines it gave weights for

    def weights_for(self, engine):
        self.asked.append(engine)
        return {"w": torch.zeros(1)}


@dataclass
class _Ctx:
    engine: object
    tokenizer: object = None


def _pipeline(S: int, total: int, seen: list, fail_at: int | None = None) -> RolloutPipeline:
    def collect(ctx, step, cursor, shapers, driver):
        if step == fail_at:
            raise ValueError("boom")
        seen.append((step, cursor, ctx.engine.version, threading.current_thread().name))
        return _Batch(step, ctx.engine.version)

    return RolloutPipeline.build(collect, _Ctx(_Engine()), S, total, lambda m, tok: _Engine())


@pytest.mark.parametrize("S", [1, 2])
def test_batch_i_is_sampled_with_the_weights_of_step_i_minus_s(S):
    # the learner publishes version 10 * step after each step; batch i must have been made with version
    # 10 * max(0, i - S), never fresher, never older, and the producer is never more than S + 1 batches ahead
    seen: list = []
    pipe = _pipeline(S, 6, seen)
    pipe.start(0, 0, b"", _Learner(), 0)
    try:
        for step in range(6):
            batch, m = pipe.take(step, 2 * step, None, None)
            assert batch.step == step and batch.version == 10 * max(0, step - S)
            assert m["offpolicy/staleness_max"] == min(step, S)
            assert len(pipe._ready) <= S  # what is left after taking this one
            pipe.publish(step + 1, {"w": torch.zeros(1)}, 10 * (step + 1))
    finally:
        pipe.close()
    assert [s[1] for s in seen] == [2 * i for i in range(6)]  # the data cursor advances batch by batch
    assert {s[3] for s in seen} == {"posttrain-producer"}


def test_zero_staleness_collects_in_the_callers_thread_with_the_runs_engine():
    seen: list = []
    pipe = _pipeline(0, 3, seen)
    engine = pipe.ctx.engine
    pipe.start(0, 0, b"", _Learner(), 0)  # the run's engine takes the starting weights (version 0) at once
    batch, m = pipe.take(0, 5, None, None)
    assert m == {} and seen == [(0, 5, 0, threading.current_thread().name)] and pipe.ctx.engine is engine


def test_synchronous_hand_off_gives_the_runs_engine_each_new_policy_once():
    pipe, learner = _pipeline(0, 4, []), _Learner()
    engine = pipe.engine
    pipe.start(3, 0, b"", _Learner(), 7)  # resumed at step 3, policy version 7
    pipe.after_update(learner, 4, 8)  # one optimizer step: the next batch samples version 8
    assert engine.synced == [7, 8] and learner.asked == [engine]
    pipe.after_update(learner, 5, 8)  # a step without an optimizer step: the engine already holds version 8
    assert engine.synced == [7, 8] and learner.asked == [engine]
    assert pipe.for_eval(learner, 8) is engine and engine.synced == [7, 8]  # it evaluates what it holds
    assert pipe.take(5, 0, None, None)[0].version == 8


def test_asynchronous_hand_off_publishes_for_the_producer_and_evaluates_on_the_runs_engine():
    # S = 1: step i's weights sample batch i + 1 on the producer's engine; the run's own engine samples nothing,
    # so it takes the weights only when it evaluates, and only when they moved
    home, learner = _Engine(), _Learner()
    pipe = RolloutPipeline.build(lambda ctx, step, *a: _Batch(step, ctx.engine.version), _Ctx(home), 1, 4,
                                 lambda m, tok: _Engine())
    producer = pipe.engine
    pipe.start(0, 0, b"", _Learner(), 0)
    try:
        assert [pipe.take(s, 0, None, None)[0].version for s in (0, 1)] == [0, 0]  # batch 1: step 0's weights
        pipe.after_update(learner, 1, 10)  # published at once, though no batch is ready to take them yet
        pipe.after_update(learner, 2, 20)
        assert learner.asked == [producer, producer] and home.synced == []
        assert pipe.take(2, 0, None, None)[0].version == 10  # batch 2: step 1's weights
        assert pipe.for_eval(learner, 20) is home and home.synced == [20] and learner.asked[-1] is home
        assert pipe.for_eval(learner, 20) is home and home.synced == [20]  # it holds version 20: no second sync
    finally:
        pipe.close()
    assert producer is not home and producer.synced[:3] == [0, 0, 10]  # batches 0, 1 and 2


def test_a_checkpoint_holds_the_batches_made_with_older_weights_and_a_resume_continues_from_them():
    # at step 2 with S = 2 the batches of steps 2 and 3 were sampled with the weights of steps 0 and 1, which
    # the checkpoint does not hold: they are in its state; a resumed pipeline serves them, then samples step
    # 4's batch with the resumed weights (step 2), as the uninterrupted run did
    seen: list = []
    pipe = _pipeline(2, 6, seen)
    pipe.start(0, 0, b"", _Learner(), 0)
    for step in range(2):
        pipe.take(step, 0, None, None)
        pipe.publish(step + 1, {}, 10 * (step + 1))
    saved = pipe.checkpoint_state(2)
    pipe.close()
    seen2: list = []
    again = _pipeline(2, 6, seen2)
    again.start(2, 4, saved, _Learner(), 20)
    try:
        got = [again.take(s, 0, None, None)[0].version for s in (2, 3, 4)]
    finally:
        again.close()
    assert got == [0, 10, 20]
    assert seen2[0][:3] == (4, 8, 20)  # the first batch it makes: step 4, the cursor past the two kept ones


def test_a_failing_producer_surfaces_its_error_at_the_learners_next_take():
    pipe = _pipeline(1, 4, [], fail_at=1)
    pipe.start(0, 0, b"", _Learner(), 0)
    pipe.take(0, 0, None, None)
    pipe.publish(1, {}, 1)
    with pytest.raises(RuntimeError, match="producer failed.*boom"):
        pipe.take(1, 0, None, None)
    pipe.close()


class _ClosingEngine(_Engine):
    def __init__(self) -> None:
        super().__init__()
        self.closed = 0

    def close(self) -> None:
        self.closed += 1


def test_the_producers_engine_is_closed_once_also_when_close_comes_mid_batch():
    # close() waits 1 s for the producer; one still making a batch (Ray workers can take minutes) closes its own
    # engine when the batch ends, and an engine is never closed twice
    release, started = threading.Event(), threading.Event()

    def collect(ctx, step, cursor, shapers, driver):
        if step == 1:
            started.set()
            release.wait(30)
        return _Batch(step, ctx.engine.version)

    engine = _ClosingEngine()
    pipe = RolloutPipeline.build(collect, _Ctx(_Engine()), 1, 4, lambda m, tok: engine)
    pipe.start(0, 0, b"", _Learner(), 0)
    pipe.take(0, 0, None, None)
    pipe.publish(1, {}, 1)
    assert started.wait(10)
    pipe.close()  # the producer is inside batch 1
    assert engine.closed == 0 and pipe._thread.is_alive()
    release.set()
    pipe._thread.join(10)
    assert engine.closed == 1
    pipe.close()
    assert engine.closed == 1
    done = _ClosingEngine()  # a producer that ended with the run: close() closes its engine
    pipe = RolloutPipeline.build(lambda ctx, step, *a: _Batch(step, 0), _Ctx(_Engine()), 1, 1, lambda m, tok: done)
    pipe.start(0, 0, b"", _Learner(), 0)
    pipe.take(0, 0, None, None)
    pipe.close()
    assert done.closed == 1


# --- real runs on the tiny recipe ---


def test_an_async_run_trains_each_step_on_samples_of_the_policy_one_step_older(tiny_cfg, quiet, tmp_path,
                                                                                length_reward):
    # every step's batch (all its completions are in samples.jsonl) is exactly what the checkpoint of the step
    # before the previous one samples with the run's seed; the previous step's checkpoint samples other ones
    P, G = 4, 4
    cfg = tiny_cfg("rollout.max_staleness=1", "train.steps=5", "checkpoint.every=1", "checkpoint.keep=10",
                   f"rollout.prompts_per_step={P}", f"rollout.group_size={G}", f"log.samples={P * G}",
                   "log.samples_every=1", "eval.every=0", "eval.prompts=8", *length_reward)
    train(cfg, console=quiet)
    run = tmp_path / "run"
    metrics = rows(run)
    assert [r["offpolicy/staleness_max"] for r in metrics] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all(r["offpolicy/ratio_max"] > 1.001 for r in metrics[1:])  # pi_old (recomputed) is not the sampler
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    tok = AutoTokenizer.from_pretrained(run / "checkpoints" / "step_000001")
    sp = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, n=G)
    for step in (3, 4, 5):
        rows_s = [s for s in samples if s["step"] == step]
        prompts = [encode_chat(tok, rows_s[g * G]["prompt"], cfg.task.system_prompt) for g in range(P)]
        seed = derive_seed(cfg.seed, "sample", step - 1, 0)

        def sample_with(ckpt: int, prompts: list = prompts, seed: int = seed) -> list[str]:
            model = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / f"step_{ckpt:06d}")
            return HFEngine(model, tok).generate(prompts, sp, seed=seed).texts

        assert sample_with(step - 2) == [s["completion"] for s in rows_s]
        assert sample_with(step - 1) != [s["completion"] for s in rows_s]


def test_max_staleness_0_and_1_sample_step_1_alike_and_part_after(tiny_cfg, quiet, tmp_path, length_reward):
    common = ["train.steps=3", "checkpoint.every=0", "eval.every=0", "eval.prompts=8", *length_reward]
    train(tiny_cfg(*common, out=str(tmp_path / "s0")), console=quiet)
    train(tiny_cfg(*common, "rollout.max_staleness=1", out=str(tmp_path / "s1")), console=quiet)
    a, b = rows(tmp_path / "s0"), rows(tmp_path / "s1")
    pipeline_keys = {"offpolicy/staleness_mean", "offpolicy/staleness_max", "offpolicy/token_staleness_mean"}
    assert strip_timing(a[0]) == {k: v for k, v in strip_timing(b[0]).items() if k not in pipeline_keys}
    assert a[1]["reward/mean"] != b[1]["reward/mean"]  # step 2: S=1 samples the initial policy again
    # with rollout.on_new_weights = "finish" every token of a batch is as old as its rows: 0 at step 1, 1 after
    assert [r["offpolicy/token_staleness_mean"] for r in b] == [r["offpolicy/staleness_mean"] for r in b] == [0, 1, 1]
    assert "offpolicy/staleness_max" not in a[0]  # the synchronous loop reports no pipeline


def test_an_async_run_resumes_after_kill_9_exactly(tmp_path):
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "recipes/tiny.toml"]
    common = ["--max-steps", "8", "log.progress=false", "checkpoint.every=3", "rollout.max_staleness=2",
              "eval.every=0"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    subprocess.run([*cmd, "--out", str(ref), *common], check=True, cwd=ROOT, capture_output=True)
    proc = subprocess.Popen([*cmd, "--out", str(cut), *common], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = cut / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 4):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics.read_text().splitlines()) < 8, "the run finished before it could be killed"
    subprocess.run([*cmd, "--out", str(cut), "--resume", *common], check=True, cwd=ROOT, capture_output=True)
    a, b = rows(ref), rows(cut)
    assert [r["step"] for r in b] == list(range(1, 9))
    assert [r["offpolicy/staleness_max"] for r in a] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    for x, y in zip(a, b, strict=True):
        assert strip_timing(x) == strip_timing(y)


def test_an_async_multi_turn_run_trains(tmp_path, quiet):
    from posttrain.config import load_config

    cfg = load_config(ROOT / "recipes" / "agent_guess.toml", [
        f'out="{tmp_path / "run"}"', "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
        "train.steps=3", "rollout.prompts_per_step=2", "eval.every=0", "eval.prompts=4", "rollout.max_staleness=1",
    ])
    train(cfg, console=quiet)
    r = rows(tmp_path / "run")
    assert [x["offpolicy/staleness_max"] for x in r] == [0.0, 1.0, 1.0]
    assert all(x["episode/turns_mean"] >= 1 for x in r)


@pytest.mark.parametrize(("overrides", "match"), [
    (["rollout.driver=partial_states"], "'partial_states' cannot run ahead of the learner .its queue"),
    (['algorithm.shapers=[{name="traac_length"}]'], "traac_length"),
])
def test_what_cannot_run_ahead_of_the_learner_is_refused(tiny_cfg, overrides, match):
    with pytest.raises(ConfigError, match=match):
        tiny_cfg("rollout.max_staleness=1", *overrides)


def test_the_old_partial_key_names_its_new_place(tiny_cfg):
    # rollout.partial meant the fate of rows cut by newer weights; "partial" also named ReST's partial states
    # and the partial-credit reward, so the key is rollout.on_new_weights now
    with pytest.raises(ConfigError, match=r"'rollout.partial' has moved: use rollout.on_new_weights"):
        tiny_cfg("rollout.max_staleness=1", "rollout.partial=resubmit")
    assert tiny_cfg("rollout.max_staleness=1", "rollout.on_new_weights=resubmit").rollout.on_new_weights == "resubmit"


def test_remax_runs_ahead_with_its_greedy_baseline_sampled_by_the_batchs_policy(tiny_cfg, monkeypatch, quiet):
    # ReMax's baseline is the reward of each prompt's greedy response. It is sampled in produce (collect's
    # SAMPLED_INPUTS), by the engine that sampled the batch, so a producer running ahead samples it with the same
    # (older) policy as the batch's rows: the estimator needs no learner state and may run asynchronously.
    from posttrain.produce import collect

    seen = []
    real = collect.SAMPLED_INPUTS["baseline_rewards"]

    def spy(ctx, parts, batch):
        seen.append((set(batch.rollouts.policy_version.tolist()), ctx.engine.version))
        return real(ctx, parts, batch)

    monkeypatch.setitem(collect.SAMPLED_INPUTS, "baseline_rewards", spy)
    cfg = tiny_cfg("algorithm.advantage=remax", "rollout.max_staleness=1", "train.steps=3", "eval.every=0",
                   "checkpoint.every=0", 'reward=[{name="partial_answer"}]')  # partial credit: rewards that differ
    train(cfg, console=quiet)
    r = rows(Path(cfg.out))
    assert [x["offpolicy/staleness_max"] for x in r] == [0.0, 1.0, 1.0]  # it ran ahead of the learner
    assert len(seen) == 3 and all(versions == {engine} for versions, engine in seen)  # the batch's own policy
    assert all(x["adv/zero_frac"] < 1 for x in r)  # the baseline gave the samples an advantage
