"""RL-PLUS in the loop: the "external_mix" driver puts each example's demonstration in its group, the
"grpo_onpolicy_stats" estimator and the "rl_plus" loss read which rows are external, and the config refuses
what cannot run with external rows."""

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from posttrain.config import ConfigError, ProduceSettings, load_config
from posttrain.models.load import encode_chat
from posttrain.models.tiny import build_char_tokenizer
from posttrain.produce.drivers import DRIVERS, ProduceContext
from posttrain.produce.drivers.external_mix import demonstration_rollout, mix_groups
from posttrain.rollout import Rollout, SamplingParams
from posttrain.tasks import ArithmeticTask
from posttrain.train.rl import train

RL_PLUS = Path(__file__).resolve().parents[2] / "recipes" / "rl_plus.toml"
TASK = ArithmeticTask(digits=2, ops="+", reverse=True)  # tiny.toml's task


class WrongEngine:
    """Every completion is the one token "0" (wrong for every 2-digit sum), log-prob -0.5."""

    pad_id = 0
    version = 3

    def __init__(self, tok):
        self.tok = tok

    def generate(self, prompts, sampling, seed=None):
        n = sampling.n
        zero = self.tok("0", add_special_tokens=False)["input_ids"][0]
        tokens = torch.tensor([[zero, self.tok.eos_token_id] for _ in prompts for _ in range(n)])
        ones = torch.ones(len(tokens), 2)
        done = torch.ones(len(tokens), dtype=torch.bool)
        return Rollout.single_turn(prompts, tokens, ones, -0.5 * ones, done, ["0"] * len(tokens), n,
                                   policy_version=self.version)


def test_demonstrations_are_tokenized_as_completions():
    tok = build_char_tokenizer(TASK.alphabet)
    exs = TASK.examples("train", 2, seed=0)  # demonstrations "09", "301"
    exs.append(type(exs[0])(exs[0].prompt, exs[0].answer, ""))  # no demonstration
    ids = [encode_chat(tok, ex.prompt) for ex in exs]
    eos = tok.eos_token_id
    ro = demonstration_rollout(tok, ids, exs, 2, max_new_tokens=3, pad_id=0, version=7)
    d0 = tok("09", add_special_tokens=False)["input_ids"]
    d1 = tok("301", add_special_tokens=False)["input_ids"]
    assert ro.n == 2 and ro.token_ids.shape == (6, 3)
    assert ro.token_ids[0].tolist() == [*d0, eos] == ro.token_ids[1].tolist()
    assert ro.token_ids[2].tolist() == d1  # cut at max_new_tokens: no EOS, unfinished
    assert ro.loss_mask.sum(-1).tolist() == [3, 3, 3, 3, 0, 0]
    assert ro.finished.tolist() == [True, True, False, False, False, False]
    assert ro.texts == ["09", "09", "301", "301", "", ""]
    assert (ro.behaviour_logprobs == 0).all() and ro.policy_version.tolist() == [7] * 6


def test_mix_groups_appends_each_groups_external_rows():
    tok = build_char_tokenizer(TASK.alphabet)
    exs = TASK.examples("train", 2, seed=0)
    ids = [encode_chat(tok, ex.prompt) for ex in exs]
    own = WrongEngine(tok).generate(ids, SamplingParams(n=3, max_new_tokens=2))
    ext = demonstration_rollout(tok, ids, exs, 1, max_new_tokens=6, pad_id=0, version=3)
    mixed = mix_groups(own, ext, pad_id=0)
    assert mixed.n == 4 and mixed.token_ids.shape == (8, 4)  # "301" + EOS is the widest row
    assert mixed.texts == ["0", "0", "0", "09", "0", "0", "0", "301"]
    assert mixed.behaviour_logprobs[:, 0].tolist() == [-0.5, -0.5, -0.5, 0.0] * 2
    assert mixed.loss_mask.sum(-1).tolist() == [2, 2, 2, 3, 2, 2, 2, 4]
    assert mixed.turn_ids[3].tolist() == [0, 0, 0, -1] and mixed.prompt_ids == ids


def test_external_mix_driver_fills_the_last_row_of_each_group(tiny_cfg):
    cfg = load_config(RL_PLUS, ['out="unused"', "rollout.prompts_per_step=3"])
    tok = build_char_tokenizer(TASK.alphabet)
    G = cfg.rollout.group_size
    ctx = ProduceContext(task=TASK, tokenizer=tok, engine=WrongEngine(tok),
                         sampling=SamplingParams(n=G, max_new_tokens=cfg.rollout.max_new_tokens),
                         rewards=[("task", {})], weights_K=torch.tensor([2.0]),
                         settings=ProduceSettings.of(cfg))
    out, state = DRIVERS.get("external_mix")(ctx, None, 0, 0, 0)
    assert state is None and out.rollouts.n == G and out.consumed == 3
    assert out.external_PG.tolist() == [[False] * (G - 1) + [True]] * 3
    assert out.rewards_PGK[..., 0].tolist() == [[0.0] * (G - 1) + [2.0]] * 3  # scored, then weighted
    assert out.correct_PG[:, -1].all() and not out.correct_PG[:, :-1].any() and out.valid_PG.all()
    assert out.metrics["accuracy"] == 0.0  # the policy's own samples only
    assert out.metrics["external/accuracy"] == 1.0 and out.metrics["external/rows"] == 3.0
    assert [out.scored_texts[g * G + G - 1] for g in range(3)] == [ex.demonstration for ex in out.examples]
    assert out.gen_tokens == 3 * (G - 1) * 2  # sampled tokens only
    assert out.rollouts.policy_version.tolist() == [3] * (3 * G)


def test_config_refuses_external_readers_without_the_driver(tiny_cfg):
    with pytest.raises(ConfigError, match=r"algorithm.loss = 'rl_plus'.*rollout.driver = 'external_mix'"):
        tiny_cfg("algorithm.loss=rl_plus")
    with pytest.raises(ConfigError, match=r"algorithm.advantage = 'grpo_onpolicy_stats'.*only the driver"):
        tiny_cfg("algorithm.advantage=grpo_onpolicy_stats")
    ok = ['out="unused"']
    with pytest.raises(ConfigError, match=r"hint_reroll"):
        load_config(RL_PLUS, [*ok, "rollout.driver=hint_reroll", "rollout.driver_params={}"])
    with pytest.raises(ConfigError, match=r"no on-policy sample beside rollout.driver_params.n_external = 1"):
        load_config(RL_PLUS, [*ok, "rollout.group_size=1"])
    with pytest.raises(ConfigError, match=r"no sampler log-probs.*old_logprobs = 'behaviour'"):
        load_config(RL_PLUS, [*ok, "algorithm.old_logprobs=behaviour"])
    with pytest.raises(ConfigError, match=r"no sampler log-probs.*behaviour_correction = 'tis'"):
        load_config(RL_PLUS, [*ok, "algorithm.behaviour_correction=tis"])
    with pytest.raises(ConfigError, match=r"rorecomp"):
        load_config(RL_PLUS, [*ok, "algorithm.batch_selector=rorecomp"])
    with pytest.raises(ConfigError, match=r"n_external"):
        load_config(RL_PLUS, [*ok, "rollout.driver_params={n_external=0}"])
    # the driver alone runs with any estimator and loss (e.g. plain GRPO over the mixed group)
    assert load_config(RL_PLUS, [*ok, "algorithm.advantage=grpo", "algorithm.loss=ppo_clip",
                                 "algorithm.loss_params={}", "algorithm.advantage_params={}"]).rollout.driver == \
        "external_mix"


def test_rl_plus_trains_three_steps_on_the_tiny_recipe(tmp_path, quiet, prepare_calls):
    cfg = load_config(RL_PLUS, [f'out="{tmp_path / "run"}"', "train.steps=3", "log.progress=false",
                                "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=3",
                                "eval.every=0"])
    train(cfg, console=quiet)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["train/nonfinite"] == 0 and math.isfinite(r["loss"]) for r in rows)
    assert all(r["external/rows"] == cfg.rollout.prompts_per_step and r["external/accuracy"] == 1.0 for r in rows)
    # the sampler-vs-learner metrics read the policy's own samples only (the demonstrations' placeholder
    # behaviour log-probs of 0 would put the ratio pi_old / mu far from 1): on-policy, the hf engine samples
    # exactly the learner's policy
    assert all(abs(r["offpolicy/ratio_max"] - 1) < 1e-3 and r["offpolicy/mismatch_k3"] < 1e-6 for r in rows)
    for batch, prep in prepare_calls:
        P, G = batch.rewards_PG.shape
        ext = batch.external_PG
        assert ext.tolist() == [[False] * (G - 1) + [True]] * P
        assert prep.chosen.row_inputs["external"].tolist() == ext.reshape(-1).tolist()
        r = batch.rewards_PG
        on = r[:, :-1]
        sigma = on.std(1, keepdim=True)
        sigma = torch.where(sigma == 0, torch.ones_like(sigma), sigma)
        torch.testing.assert_close(prep.adv, (r - on.mean(1, keepdim=True)) / (sigma + 1e-6))
        assert (prep.adv[:, -1] > 0).all()  # the demonstration is correct and the untrained policy is not
        demo = [batch.rollouts.texts[p * G + G - 1] for p in range(P)]
        assert demo == [ex.demonstration for ex in batch.examples]
    before = AutoModelForCausalLM.from_pretrained(run / "base_model").state_dict()
    after = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000003").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
