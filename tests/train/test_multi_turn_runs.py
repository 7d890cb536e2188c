"""A multi-turn run end to end on the tiny model: an environment task trains through the same loop,
only sampled tokens are trained, the episode metrics are logged, held-out evaluation runs episodes,
and a broken environment costs its episode, not the run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from posttrain.algorithms import advantages
from posttrain.config import ConfigError
from posttrain.config.base import ADVANTAGE_INPUTS, TURN_INPUTS
from posttrain.envs.base import ENVS, StepResult
from posttrain.tasks.base import Example, make_alphabet, sample_split
from posttrain.train import rl


@dataclass
class _DigitEpisode:
    secret: str
    boom: bool = False

    def reset(self):
        return [{"role": "user", "content": "guess"}]

    def step(self, action):
        if self.boom and int(self.secret) % 2:
            raise ValueError("a bug in the environment")
        if action.strip() == self.secret:
            return StepResult(reward=1.0, done=True, info={"success": 1.0})
        return StepResult(messages=({"role": "user", "content": "no"},), info={"format_errors": float(
            not action.strip().isdigit())})

    def state_key(self):
        return None


class _GuessDigit:
    """Guess a hidden digit; 'no' until right (4 turns)."""

    name, max_turns = "test_guess_digit", 4
    alphabet = make_alphabet("0123456789", "guess", "no")

    def __init__(self, boom: bool = False) -> None:
        self.boom = boom

    def examples(self, split, n, seed):
        def draw(rng):
            d = rng.randrange(10)
            return f"digit:{d}:{rng.randrange(10**6)}", Example("guess", str(d), str(d))
        return sample_split(split, n, seed, draw)

    def start(self, example):
        return _DigitEpisode(example.answer, self.boom)

    def demonstration(self, example, seed):
        return [{"role": "user", "content": "guess"}, {"role": "assistant", "content": example.answer}]


if "test_guess_digit" not in ENVS:
    ENVS.register("test_guess_digit")(_GuessDigit)


def _cfg(tiny_cfg, *extra):
    return tiny_cfg("task.name=env", 'task.env={name="test_guess_digit", max_tokens=24}', "task.params={}",
                    "rollout.max_new_tokens=3", "train.steps=2", "checkpoint.every=0", "eval.every=0",
                    "eval.prompts=8", *extra)


def test_an_environment_task_trains_only_sampled_tokens_and_logs_episodes(tiny_cfg, quiet, prepare_calls):
    cfg = _cfg(tiny_cfg, "log.samples_every=1", "log.samples=64")
    assert cfg.rollout.driver == "multi_turn"  # chosen for an environment task
    seen = prepare_calls
    summary = rl.train(cfg, console=quiet)
    batch, prep = seen[-1]
    rollouts = batch.rollouts
    context = (rollouts.attention_mask > 0) & (rollouts.loss_mask == 0)
    assert context.any()  # some episode took a second turn: the reply "no" is in its row ...
    assert not (prep.chosen.mask_NT[context] > 0).any()  # ... and never trained on
    assert (rollouts.turn_ids[rollouts.loss_mask > 0] >= 0).all() and (rollouts.turn_ids[context] == -1).all()
    assert batch.turns is not None and batch.turns.mask.shape == (8, 4, 4)
    # the episode reward is the environment's: 1 exactly for the solved ones
    assert torch.equal(batch.rewards_PG > 0.5, batch.correct_PG)
    rows = [json.loads(line) for line in (cfg_out(cfg) / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]
    for key in ("episode/turns_mean", "episode/success", "episode/end_reason/done", "episode/end_reason/max_turns",
                "tools/calls", "episode/format_errors", "adv/turn_nonzero_frac"):
        assert key in last, key
    assert 1.0 <= last["episode/turns_mean"] <= 4.0
    assert abs(sum(v for k, v in last.items() if k.startswith("episode/end_reason/")) - 1.0) < 1e-9
    assert last["response/length_mean"] <= 4 * 3  # sampled tokens only, at most 3 a turn
    samples = [json.loads(line) for line in (cfg_out(cfg) / "samples.jsonl").read_text().splitlines()]
    two_turns = [s for s in samples if len(s["transcript"]) >= 3]
    assert two_turns  # sampled, then the reply (context), then sampled again
    seg = two_turns[0]["transcript"]
    assert seg[0][1] and not seg[1][1] and seg[2][1] and seg[1][0] == "<|user|>no<|assistant|>"
    final = summary["final"]
    assert 0.0 <= final["pass@1"] <= 1.0 and final["turns_mean"] >= 1.0  # held-out episodes, greedy


def cfg_out(cfg):
    from pathlib import Path

    return Path(cfg.out)


def test_a_broken_environment_scores_its_episodes_none_and_the_run_goes_on(tiny_cfg, quiet, monkeypatch):
    cfg = _cfg(tiny_cfg, 'task.env={name="test_guess_digit", max_tokens=24, params={boom=true}}')
    rl.train(cfg, console=quiet)
    rows = [json.loads(line) for line in (cfg_out(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    errors = sum(r["reward/task/errors"] for r in rows)
    logged = (cfg_out(cfg) / "reward_failures.jsonl").read_text().splitlines()
    assert errors > 0 and len(logged) == errors  # every failed episode logged with its transcript
    first = json.loads(logged[0])
    assert first["status"] == "error" and "a bug in the environment" in first["message"]
    assert first["completion"].startswith("assistant: ")  # the transcript


def test_sft_on_an_environment_trains_on_its_expert_transcripts(tiny_cfg, quiet):
    from posttrain.trainers.sft import sft

    cfg = _cfg(tiny_cfg, "sft.steps=3", "sft.eval_every=3", "sft.demos=16", "sft.eval_prompts=8", "sft.batch_size=4")
    summary = sft(cfg, console=quiet)
    rows = [json.loads(line) for line in (cfg_out(cfg) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "sft/loss" in r] == [1, 2, 3]
    assert 0.0 <= summary["best_val"] <= 1.0  # greedy episodes on held-back problems


TURN_LEVEL = [n for n in advantages.names()
              if set(advantages.REGISTRY.required(n)) & set(TURN_INPUTS)
              and set(advantages.REGISTRY.required(n)) <= set(ADVANTAGE_INPUTS)]


@pytest.mark.parametrize("name", TURN_LEVEL)
def test_every_turn_level_estimator_the_loop_feeds_trains_on_episodes(name, tiny_cfg, quiet, prepare_calls):
    seen = prepare_calls
    cfg = _cfg(tiny_cfg, f"algorithm.advantage={name}", "rollout.max_new_tokens=2")
    rl.train(cfg, console=quiet)
    for batch, prep in seen:
        adv_NT = prep.adv.reshape(batch.rollouts.token_ids.shape)
        assert torch.isfinite(adv_NT).all()
        assert (adv_NT[batch.rollouts.turn_ids < 0] == 0).all()  # context and padding carry no advantage


def test_a_turn_level_estimator_on_a_single_turn_task_is_a_config_error(tiny_cfg):
    with pytest.raises(ConfigError, match="needs turn-level inputs"):
        tiny_cfg("algorithm.advantage=trloo")


def test_a_multi_turn_run_resumes_after_kill_9_exactly(tmp_path):
    # the built-in guess_number game from recipes/agent_guess.toml (the untrained tiny model: episodes of every
    # length and end reason), killed with SIGKILL after its step-3 checkpoint, resumed: the same metrics
    import os
    import signal
    import subprocess
    import sys
    import time

    def rows(run):
        return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]

    def strip_timing(r):
        return {k: v for k, v in r.items() if not k.startswith(("time/", "throughput/"))}

    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "recipes/agent_guess.toml"]
    common = ["--max-steps", "8", "log.progress=false", "checkpoint.every=3", "eval.every=0", "eval.prompts=8",
              "rollout.prompts_per_step=4"]
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    subprocess.run([*cmd, "--out", str(ref), *common], check=True, cwd=root, capture_output=True)
    proc = subprocess.Popen([*cmd, "--out", str(cut), *common], cwd=root, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    metrics = cut / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and len(metrics.read_text().splitlines()) >= 5):
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics.read_text().splitlines()) < 8, "the run finished before it could be killed"
    subprocess.run([*cmd, "--out", str(cut), "--resume", *common], check=True, cwd=root, capture_output=True)
    a, b = rows(ref), rows(cut)
    assert [r["step"] for r in b] == list(range(1, 9))
    assert any(r["episode/turns_mean"] > 1 for r in a)  # episodes of more than one turn were resumed over
    for x, y in zip(a, b, strict=True):
        assert strip_timing(x) == strip_timing(y)
