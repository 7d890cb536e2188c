"""The KL penalty in the reward (`algorithm.kl_reward_coef`): token_rewards = -beta * KL_t between the
sampler's and the reference's log-probs, fed to gae / reinforce_pp and to the critic's returns."""

import json
from pathlib import Path

import pytest
import torch

from posttrain.algorithms import kl
from posttrain.config import ConfigError, LearnSettings
from posttrain.learn.learner import Learner
from posttrain.learn.logprobs import completion_logprobs
from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer
from posttrain.prepare.providers import kl_reward_metrics, kl_token_rewards
from posttrain.rollout import HFEngine, SamplingParams
from posttrain.train.loop_state import Phases
from posttrain.train.rl import train


def test_kl_reward_metrics_by_hand():
    # two responses, coef 0.5: token rewards -0.5 * KL. Response 1: KL 0.2, 0.4 (mask 1, 1) -> token
    # mean 0.3, penalty sum -0.3. Response 2: KL 1.0, (padding) -> token mean 1.0, penalty -0.5.
    tok = torch.tensor([[[-0.1, -0.2], [-0.5, 7.0]]])
    mask = torch.tensor([[[1, 1], [1, 0]]])
    m = kl_reward_metrics(tok, mask, 0.5)
    assert m["kl_reward/kl"] == pytest.approx((0.3 + 1.0) / 2)
    assert m["kl_reward/penalty"] == pytest.approx((-0.3 - 0.5) / 2)
    assert kl_reward_metrics(None, mask, 0.5) == {}


@pytest.fixture(scope="module")
def sampled(tmp_path_factory):
    d = build_tiny(tmp_path_factory.mktemp("m") / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=1))
    model, tok = load_model(str(d)).eval(), load_tokenizer(str(d))
    prompts = [encode_chat(tok, "12+34="), encode_chat(tok, "7+5=")]
    rollouts = HFEngine(model, tok).generate(
        prompts, SamplingParams(max_new_tokens=6, temperature=0.8, n=3), seed=0
    )
    rows = [p for p in prompts for _ in range(3)]
    return model, tok, rows, rollouts, str(d)


def reference_logprobs(tiny_cfg, model, ref, tok, rows, rollouts):
    """The reference's log-probs of the sampled tokens as the loop reads them (the Learner's forward, at the
    sampling temperature 0.8, in micro-batches of at most 40 tokens)."""
    cfg = tiny_cfg("rollout.temperature=0.8", "train.micro_batch_tokens=40")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    learner = Learner(model, opt, None, Phases.from_config(cfg).learn, LearnSettings.of(cfg), tok.pad_token_id, ref)
    return learner.reference_logprobs(rows, rollouts)


def test_kl_token_rewards_are_minus_coef_k1_of_sampler_and_reference(sampled, tiny_cfg):
    model, tok, rows, rollouts, path = sampled
    ref = load_model(path).eval()
    with torch.no_grad():  # a reference that differs from the policy
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    mask = rollouts.loss_mask.float()
    ref_NT = reference_logprobs(tiny_cfg, model, ref, tok, rows, rollouts)
    got = kl_token_rewards(kl.k1, 0.5, rollouts.behaviour_logprobs, ref_NT, mask)
    ref_lp, _ = completion_logprobs(ref, rows, rollouts.token_ids, mask, pad_id=tok.pad_token_id, temperature=0.8)
    want = -0.5 * (rollouts.behaviour_logprobs - ref_lp) * mask  # r_t = -beta (log pi_old - log pi_ref), 0 on padding
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (got[mask == 0] == 0).all() and got[mask == 1].abs().max() > 1e-3


def test_no_penalty_when_the_reference_is_the_sampling_policy(sampled, tiny_cfg):
    # the sampler's log-probs and a teacher-forced forward of the same weights at the same temperature
    # agree token by token, so KL_t = 0: the alignment of the two log-prob tensors is right
    model, tok, rows, rollouts, _ = sampled
    ref_NT = reference_logprobs(tiny_cfg, model, model, tok, rows, rollouts)
    got = kl_token_rewards(kl.k1, 1.0, rollouts.behaviour_logprobs, ref_NT, rollouts.loss_mask.float())
    assert got.abs().max() < 1e-4


def test_config_accepts_kl_reward_only_with_token_reward_estimators(tiny_cfg):
    with pytest.raises(ConfigError, match=r"takes no token rewards.*gae.*reinforce_pp"):
        tiny_cfg("algorithm.kl_reward_coef=0.1")  # grpo
    with pytest.raises(ConfigError, match="algorithm.kl_reward: unknown"):
        tiny_cfg('algorithm.advantage="reinforce_pp"', "algorithm.kl_reward_coef=0.1", 'algorithm.kl_reward="k9"')
    with pytest.raises(ConfigError, match="inputs the loop computes"):
        tiny_cfg('algorithm.advantage="reinforce_pp"', "algorithm.advantage_params={token_rewards=1.0}")
    cfg = tiny_cfg('algorithm.advantage="reinforce_pp"', "algorithm.kl_reward_coef=0.1")
    assert cfg.algorithm.kl_reward == "k1"  # PPO-RLHF's and REINFORCE++'s estimator by default


def test_loop_puts_the_penalty_in_the_estimators_token_rewards(tiny_cfg, quiet, advantage_calls, test_entries):
    seen = advantage_calls
    cfg = tiny_cfg("train.steps=3", "train.lr=3e-2", "checkpoint.every=0", "rollout.prompts_per_step=4",
                   "eval.prompts=4", 'reward=[{name="test_length"}]', 'algorithm.advantage="reinforce_pp"',
                   "algorithm.kl_reward_coef=0.2")
    train(cfg, console=quiet)
    rows = [json.loads(line) for line in (Path(cfg.out) / "metrics.jsonl").read_text().splitlines()]
    assert len(seen) == len(rows) == 3
    for kw in seen:
        tok, mask = kw["token_rewards"], kw["mask"]
        assert tok.shape == mask.shape and (tok[mask == 0] == 0).all()
    # step 1 samples from the reference itself: no penalty; the policy then moves away from it
    assert abs(rows[0]["kl_reward/kl"]) < 1e-4
    assert rows[2]["kl_reward/kl"] > 1e-3
    assert seen[2]["token_rewards"].abs().max() > 1e-4
    for r in rows:  # the penalty is -beta * KL summed over each response: negative once KL > 0
        assert r["kl_reward/penalty"] <= 1e-5


def test_ppo_with_kl_in_the_reward_trains_policy_and_critic(tiny_cfg, quiet, test_entries):
    cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", "rollout.prompts_per_step=4", "eval.prompts=4",
                   'reward=[{name="test_length"}]', 'algorithm.advantage="gae"', "algorithm.kl_reward_coef=0.05")
    summary = train(cfg, console=quiet)
    last = summary["last_metrics"]
    for key in ("kl_reward/kl", "kl_reward/penalty", "critic/value_loss", "loss"):
        assert key in last and last[key] == last[key]  # present and not NaN
    assert last["train/optimizer_steps"] > 0


def test_adaptive_kl_controller_in_the_loop_and_on_resume(tiny_cfg, quiet, tmp_path, test_entries):
    from posttrain.algorithms.kl import adaptive_kl_coef

    common = ("checkpoint.every=1", "train.lr=3e-2", 'reward=[{name="test_length"}]', "eval.prompts=4",
              'algorithm.advantage="reinforce_pp"', "algorithm.kl_reward_coef=0.2",
              "algorithm.kl_reward_target=0.001", "algorithm.kl_reward_horizon=64")
    train(tiny_cfg("train.steps=4", *common, out=str(tmp_path / "full")), console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()]
    coef, n = 0.2, 8 * 4  # tiny.toml: P = 8 prompts x G = 4 responses a step
    for r in rows:  # each step uses the coefficient the previous step's KL gave
        assert r["kl_reward/coef"] == pytest.approx(coef)
        coef = adaptive_kl_coef(coef, r["kl_reward/kl"], n, target=0.001, horizon=64)
    assert rows[-1]["kl_reward/coef"] > 0.2  # the KL ran above the tiny target, so beta grew
    train(tiny_cfg("train.steps=2", *common, out=str(tmp_path / "cut")), console=quiet)
    train(tiny_cfg("train.steps=4", *common, out=str(tmp_path / "cut")), console=quiet, resume=True)
    cut = [json.loads(x) for x in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [r["kl_reward/coef"] for r in cut] == [r["kl_reward/coef"] for r in rows]


def test_adaptive_controller_config_errors(tiny_cfg):
    with pytest.raises(ConfigError, match="starting kl_reward_coef"):
        tiny_cfg('algorithm.advantage="reinforce_pp"', "algorithm.kl_reward_target=0.1")
    with pytest.raises(ConfigError, match="kl_reward_horizon: 10 is below the 32 responses"):
        tiny_cfg('algorithm.advantage="reinforce_pp"', "algorithm.kl_reward_coef=0.1",
                 "algorithm.kl_reward_target=0.1", "algorithm.kl_reward_horizon=10")
