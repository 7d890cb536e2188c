"""PPO's critic: value alignment, loading, the loop with `advantage = "gae"`, and exact resume."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from posttrain.config import ConfigError
from posttrain.learn.critic import completion_values, load_value_model
from posttrain.models import TinySpec, build_tiny, load_tokenizer
from posttrain.rewards import REGISTRY as REWARDS
from posttrain.run.checkpoint import CheckpointError, load_trainer_state
from posttrain.train.rl import train

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def rows(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


class TokenIdCritic(torch.nn.Module):
    """A stub value model whose output at each position is the input token id there: V is known."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids, attention_mask, position_ids, use_cache):
        return type("Out", (), {"logits": (input_ids.float() * self.w)[..., None]})()


def test_values_are_read_where_the_policy_predicts_each_response_token():
    # V(s_t) is the value of prompt + y_<t: read at the last prompt token for t = 0, at y_{t-1} after.
    # With V(position) = the token id there:
    #   row 0: prompt [5, 6, 7], response [8, 9, 10]      -> V = [7, 8, 9]
    #   row 1: prompt [4] (left-padded with 0s), [11, 12] -> V = [4, 11, 12] (the last one is masked)
    prompts = [[5, 6, 7], [4]]
    ids = torch.tensor([[8, 9, 10], [11, 12, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    v = completion_values(TokenIdCritic(), prompts, ids, mask, pad_id=0)
    assert v.tolist() == [[7.0, 8.0, 9.0], [4.0, 11.0, 12.0]]


@pytest.fixture
def tiny_dir(tmp_path):
    return build_tiny(tmp_path / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=2, seed=1))


def test_values_equal_a_forward_on_each_prefix(tiny_dir):
    critic, _ = load_value_model(str(tiny_dir))
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))  # a head that says something
        critic.score.bias.fill_(0.3)
    tok = load_tokenizer(str(tiny_dir))
    prompts = [tok("12+3=")["input_ids"], tok("7+45=")["input_ids"][1:]]  # different lengths: left padding
    ids = torch.tensor([tok("51")["input_ids"][-2:] + [tok.eos_token_id], tok("9")["input_ids"][-1:] + [0, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    with torch.no_grad():
        v = completion_values(critic, prompts, ids, mask, pad_id=tok.pad_token_id)
        for i in range(2):
            for t in range(int(mask[i].sum())):
                prefix = torch.tensor([prompts[i] + ids[i, :t].tolist()])
                expect = critic(input_ids=prefix).logits[0, -1, 0]  # V of the state before token t
                torch.testing.assert_close(v[i, t], expect, atol=1e-5, rtol=1e-5)


def test_critic_loads_from_the_policy_with_a_zero_head_and_keeps_a_saved_or_rm_head(tiny_dir, tmp_path):
    rng = torch.get_rng_state()
    critic, note = load_value_model(str(tiny_dir))
    assert torch.equal(rng, torch.get_rng_state()), "loading the critic moved the run's RNG"
    assert "new (zeros)" in note
    assert critic.score.weight.abs().sum() == 0 and critic.score.bias.abs().sum() == 0
    policy = AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert torch.equal(critic.model.embed_tokens.weight, policy.model.embed_tokens.weight)
    with torch.no_grad():
        critic.score.weight.fill_(0.5)
    critic.save_pretrained(tmp_path / "saved")
    again, note = load_value_model(str(tmp_path / "saved"))
    assert torch.equal(again.score.weight, critic.score.weight) and "its value head" in note
    # a reward model (LlamaForSequenceClassification, score without bias): its score weight is kept
    rm_dir = build_tiny(tmp_path / "rm", TinySpec(hidden_size=32, intermediate_size=64, num_layers=2), head="reward")
    rm_critic, _ = load_value_model(str(rm_dir))
    assert torch.equal(rm_critic.score.weight, load_file(rm_dir / "model.safetensors")["score.weight"])
    assert rm_critic.score.bias.abs().sum() == 0


def _gae(tiny_cfg, *overrides):
    return tiny_cfg(
        "algorithm.advantage=gae",
        "checkpoint.every=0",
        "rollout.prompts_per_step=4",
        'reward=[{name="test_step_reward"}]',
        *overrides,
    )


def test_gae_run_trains_policy_and_critic(tiny_cfg, quiet, tmp_path, test_entries):
    train(_gae(tiny_cfg, "train.steps=3", "train.lr=1e-2", "critic.lr=1e-2", "train.minibatches=2"), console=quiet)
    run = tmp_path / "run"
    r = rows(run)
    for key in (
        "critic/value_loss",
        "critic/vf_clipfrac",
        "critic/values_mean",
        "critic/explained_variance",
        "critic/grad_norm",
    ):
        assert key in r[-1], key
    assert all(x["loss"] == x["loss"] and x["critic/value_loss"] == x["critic/value_loss"] for x in r)
    assert r[0]["critic/values_mean"] == 0.0  # the new head starts at zero
    assert r[-1]["critic/values_mean"] != 0.0
    assert all(x["train/optimizer_steps"] == 2 and x["critic/nonfinite"] == 0 for x in r)
    ckpt = run / "checkpoints" / "step_000003"
    base = load_file(run / "base_model" / "model.safetensors")
    policy = load_file(ckpt / "model.safetensors")
    critic = load_file(ckpt / "critic" / "model.safetensors")
    assert any(not torch.equal(base[k], policy[k]) for k in base)  # the policy moved
    assert any(not torch.equal(base[k], critic[k]) for k in base if k in critic)  # so did the critic's backbone
    assert critic["score.weight"].abs().sum() > 0
    assert "critic" in load_trainer_state(ckpt)["extra_optimizers"]


def test_value_loss_falls_with_fixed_rewards_and_warmup_freezes_the_policy(
    tiny_cfg, quiet, tmp_path, test_entries, monkeypatch
):
    # A fixed reward function (1 when the completion starts with a digit, ~3/4 of the random tiny
    # model's samples) and a frozen policy (critic.warmup_steps >= steps): the critic regresses a
    # stationary target. Its loss starts at 0.5 E[R^2] (V = 0) and falls towards 0.5 Var[R] as it
    # learns the mean; the random tiny backbone's features barely differ between positions, so
    # explaining more than the mean takes far longer than this test (see docs/ppo.md).
    monkeypatch.setitem(
        REWARDS._entries, "test_starts_with_digit", lambda prompt, completion, **_: float(completion[:1].isdigit())
    )
    cfg = _gae(
        tiny_cfg,
        "train.steps=10",
        "critic.warmup_steps=10",
        "critic.lr=1e-2",
        "rollout.prompts_per_step=8",
        'reward=[{name="test_starts_with_digit"}]',
    )
    train(cfg, console=quiet)
    run = tmp_path / "run"
    r = rows(run)
    loss = [x["critic/value_loss"] for x in r]
    assert sum(loss[-4:]) / 4 < 0.5 * loss[0], loss
    assert r[0]["critic/explained_variance"] == pytest.approx(0.0, abs=1e-6)  # V = 0 explains nothing
    assert all(x["train/optimizer_steps"] == 0 and "loss" not in x for x in r)
    base = load_file(run / "base_model" / "model.safetensors")
    after = load_file(run / "checkpoints" / "step_000010" / "model.safetensors")
    assert all(torch.equal(base[k], after[k]) for k in base)  # the policy waited


def test_resuming_a_run_without_a_critic_as_gae_is_a_config_error(tiny_cfg, quiet):
    train(tiny_cfg("train.steps=1", "checkpoint.every=1"), console=quiet)
    with pytest.raises(ConfigError, match="holds no critic/"):
        train(tiny_cfg("train.steps=2", "algorithm.advantage=gae"), resume=True, console=quiet)


def test_critic_files_are_in_the_manifest(tiny_cfg, quiet, tmp_path, test_entries):
    train(_gae(tiny_cfg, "train.steps=1"), console=quiet)
    ckpt = tmp_path / "run" / "checkpoints" / "step_000001"
    manifest = json.loads((ckpt / "manifest.json").read_text())
    assert "critic/model.safetensors" in manifest and "critic/config.json" in manifest
    with (ckpt / "critic" / "model.safetensors").open("r+b") as f:
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    with pytest.raises(CheckpointError, match="critic/model.safetensors"):
        load_trainer_state(ckpt)


def test_ppo_resume_after_kill_9_equals_uninterrupted(tmp_path):
    # recipes/ppo.toml with a reward that varies (the random tiny model never solves the task):
    # completions that start with a digit score 1. kill -9 after the step-2 checkpoint, resume.
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    common = [
        "--max-steps", "6", "log.progress=false", "log.tensorboard=false", "log.plot_groups=false",
        "checkpoint.every=2", "rollout.prompts_per_step=4", "train.minibatches=2", "eval.prompts=8",
        'reward=[{name="format",params={pattern="[0-9].*"}}]',
    ]
    cmd = [sys.executable, "-m", "posttrain.cli", "train", "recipes/ppo.toml"]
    subprocess.run([*cmd, "--out", str(ref), *common], check=True, cwd=ROOT, capture_output=True)
    proc = subprocess.Popen(
        [*cmd, "--out", str(cut), *common], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    metrics = cut / "metrics.jsonl"
    deadline = time.time() + 120
    while time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert len(metrics.read_text().splitlines()) < 6, "the run finished before it could be killed"
    subprocess.run([*cmd, "--out", str(cut), "--resume", *common], check=True, cwd=ROOT, capture_output=True)
    a, b = rows(ref), rows(cut)
    assert [r["step"] for r in b] == list(range(1, 7))
    assert a[-1]["critic/values_mean"] != 0.0 and a[-1]["critic/value_loss"] > 0  # the critic was learning
    for x, y in zip(a, b, strict=True):
        drop = ("time/", "throughput/")
        assert {k: v for k, v in x.items() if not k.startswith(drop)} == {
            k: v for k, v in y.items() if not k.startswith(drop)
        }
    final_ref = load_file(ref / "checkpoints" / "step_000006" / "critic" / "model.safetensors")
    final_cut = load_file(cut / "checkpoints" / "step_000006" / "critic" / "model.safetensors")
    assert all(torch.equal(final_ref[k], final_cut[k]) for k in final_ref)
