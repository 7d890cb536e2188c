"""RC-GRPO's driver (posttrain/produce/drivers/reward_conditioned.py): each sample slot of a group follows a
reward token that opens its response as context, and GRPO's advantages are then the usual ones."""

import pytest
import torch

from posttrain.algorithms import advantages
from posttrain.config import ConfigError, ProduceSettings
from posttrain.models.load import encode_chat
from posttrain.models.tiny import build_char_tokenizer
from posttrain.produce.drivers import DRIVERS, ProduceContext
from posttrain.produce.drivers.reward_conditioned import opened_by, slot_counts
from posttrain.rollout import Rollout, SamplingParams
from posttrain.rollout.batch import join_groups
from posttrain.run.setup import check_context
from posttrain.tasks import ArithmeticTask

TASK = ArithmeticTask(digits=2, ops="+", reverse=True)  # tiny.toml's task
HIGH, LOW = "+", "="  # two characters of the tiny alphabet


class ConditionedEngine:
    """A policy that learned the tokens: the right answer after HIGH or after a bare prompt, "0" (wrong) after
    LOW; log-prob -0.5 on every sampled token. Records the prompts it was given."""

    pad_id = 0
    version = 2

    def __init__(self, tok):
        self.tok, self.seen = tok, []

    def answer(self, prompt_ids):
        """The right answer to the question the ids spell ("51+57=": 15 + 75 = 90, written reversed "09")."""
        question = self.tok.decode(prompt_ids, skip_special_tokens=True)
        a, b = question[question.rindex("=") - 5: question.rindex("=")].split("+")
        return str(int(a[::-1]) + int(b[::-1]))[::-1]

    def generate(self, prompts, sampling, seed=None):
        self.seen.append([list(p) for p in prompts])
        hi, lo = (self.tok(t, add_special_tokens=False)["input_ids"] for t in (HIGH, LOW))
        rows, texts = [], []
        for p in prompts:
            ends = next((k for k in (hi, lo) if p[-len(k):] == k), [])
            text = "0" if ends == lo else self.answer(p[: len(p) - len(ends)])
            ids = self.tok(text, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            rows += [ids] * sampling.n
            texts += [text] * sampling.n
        width = max(map(len, rows))
        tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows])
        mask = torch.tensor([[1.0] * len(r) + [0.0] * (width - len(r)) for r in rows])
        return Rollout.single_turn(prompts, tokens, mask, -0.5 * mask, torch.ones(len(rows), dtype=torch.bool),
                                   texts, sampling.n, policy_version=self.version)


def _ctx(tiny_cfg, driver, *overrides):
    cfg = tiny_cfg(f"rollout.driver={driver}", "rollout.prompts_per_step=3", *overrides)
    tok = build_char_tokenizer(TASK.alphabet)
    engine = ConditionedEngine(tok)
    ctx = ProduceContext(TASK, tok, engine, SamplingParams(n=cfg.rollout.group_size, max_new_tokens=6),
                         [("task", {})], torch.tensor([1.0]), ProduceSettings.of(cfg))
    return ctx, tok, engine


def test_slot_counts_split_the_group_in_token_order():
    assert slot_counts(["H", "L"], None, 4) == [2, 2]
    assert slot_counts(["H", "L"], None, 5) == [3, 2]  # the first tokens take the remainder
    assert slot_counts(["H", "M", "L"], None, 4) == [2, 1, 1]
    assert slot_counts(["H", "L"], [1, 3], 4) == [1, 3]


def test_catalog_example_grpo_on_a_conditioned_group():
    # tokens [H, H, L, L] earn [1, 1, 0, 1]: mean 0.75, unbiased std sqrt(0.25) = 0.5
    # -> (1 - 0.75) / 0.5 = 0.5 and (0 - 0.75) / 0.5 = -1.5: [0.5, 0.5, -1.5, 0.5]
    adv = advantages.REGISTRY.get("grpo")(torch.tensor([[1.0, 1.0, 0.0, 1.0]]), std="unbiased", eps=0.0)
    assert torch.allclose(adv, torch.tensor([[0.5, 0.5, -1.5, 0.5]]))


def test_the_token_opens_each_row_as_context_never_trained_on():
    tok = build_char_tokenizer(TASK.alphabet)
    ids = tok(HIGH, add_special_tokens=False)["input_ids"]
    part = ConditionedEngine(tok).generate(
        [encode_chat(tok, ex.prompt) for ex in TASK.examples("train", 2, seed=0)], SamplingParams(n=2))
    opened = opened_by(part, ids)
    assert opened.token_ids[:, : len(ids)].tolist() == [ids] * 4
    assert opened.token_ids[:, len(ids):].tolist() == part.token_ids.tolist()
    assert (opened.attention_mask[:, : len(ids)] == 1).all() and (opened.loss_mask[:, : len(ids)] == 0).all()
    assert (opened.behaviour_logprobs[:, : len(ids)] == 0).all() and (opened.turn_ids[:, : len(ids)] == -1).all()
    assert opened.texts == part.texts and opened.loss_mask.sum() == part.loss_mask.sum()
    joined = join_groups([opened, opened], pad_id=0)
    assert joined.n == 4 and joined.texts[:4] == part.texts[:2] * 2  # group 0: part 0's rows, then part 1's


def test_groups_keep_a_spread_where_unconditioned_samples_all_agree(tiny_cfg):
    # what distinguishes RC-GRPO: the same policy, unconditioned, solves every prompt (all-zero GRPO advantage);
    # conditioned on [H, H, L, L] each group earns [1, 1, 0, 0] and every group keeps a signal
    plain, _, _ = _ctx(tiny_cfg, "single_turn")
    flat, _ = DRIVERS.get("single_turn")(plain, None, 0, 0, 0)
    assert flat.rewards_PGK[..., 0].tolist() == [[1.0] * 4] * 3
    ctx, tok, engine = _ctx(tiny_cfg, "reward_conditioned", f'rollout.driver_params={{tokens=["{HIGH}", "{LOW}"]}}')
    out, state = DRIVERS.get("reward_conditioned")(ctx, None, 0, 0, 0)
    assert state is None and out.rollouts.n == 4 and out.consumed == 3
    assert out.rewards_PGK[..., 0].tolist() == [[1.0, 1.0, 0.0, 0.0]] * 3
    adv = advantages.REGISTRY.get("grpo")(out.rewards_PGK.sum(-1))
    assert (adv.abs() > 0.5).all()
    assert out.metrics["selection/rc_reward_0"] == 1.0 and out.metrics["selection/rc_reward_1"] == 0.0
    hi, lo = (tok(t, add_special_tokens=False)["input_ids"] for t in (HIGH, LOW))
    assert [p[-len(hi):] for p in engine.seen[0]] == [hi] * 3 and [p[-len(lo):] for p in engine.seen[1]] == [lo] * 3
    assert out.prompt_ids == [p[: -len(hi)] for p in engine.seen[0]]  # the group trains on the bare prompt
    assert out.gen_tokens == int(out.rollouts.loss_mask.sum()) and out.rollouts.policy_version.tolist() == [2] * 12


def test_options_are_checked_with_the_key_named(tiny_cfg):
    with pytest.raises(ConfigError, match="counts"):
        tiny_cfg("rollout.driver=reward_conditioned", "rollout.driver_params={counts=[1, 1]}")  # G = 4
    with pytest.raises(ConfigError, match="distinct"):
        tiny_cfg("rollout.driver=reward_conditioned", 'rollout.driver_params={tokens=["a", "a"]}')
    with pytest.raises(ConfigError, match="group_size"):
        tiny_cfg("rollout.driver=reward_conditioned", "rollout.group_size=2",
                 'rollout.driver_params={tokens=["a", "b", "c"]}')
    tiny_cfg("rollout.driver=reward_conditioned", "rollout.driver_params={counts=[3, 1]}")


def test_a_reward_token_that_overflows_the_context_is_refused_at_set_up(tiny_cfg):
    tok = build_char_tokenizer(TASK.alphabet)
    cfg = tiny_cfg("rollout.driver=reward_conditioned", f'rollout.driver_params={{tokens=["{"+" * 40}", "="]}}')
    with pytest.raises(ConfigError, match="reward token"):
        check_context(cfg, TASK, tok, 48)
