"""Turn-PPO in the loop: the critic is read at each turn's first sampled token (``turn_values``) and fit
there on the turn-level GAE targets; the advantage of every token of turn k is A_k of ``turn_gae``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from posttrain.algorithms import advantages
from posttrain.config.learn import CriticConfig
from posttrain.envs.base import ENVS, StepResult
from posttrain.learn.critic import Critic
from posttrain.tasks.base import Example, make_alphabet, sample_split
from posttrain.train import rl


@dataclass
class _TwoTurnEpisode:
    turn: int = 0

    def reset(self):
        return [{"role": "user", "content": "go"}]

    def step(self, action):
        # 0.5 and "again" after the first turn; the second turn scores the share of digits in its action and ends
        self.turn += 1
        if self.turn == 1:
            return StepResult(reward=0.5, messages=({"role": "user", "content": "again"},))
        return StepResult(reward=sum(c.isdigit() for c in action) / max(len(action), 1), done=True)

    def state_key(self):
        return None


class _TwoTurns:
    """Two turns, the reward at the end: every episode has something for the critic to fit."""

    name, max_turns = "test_two_turns", 2
    alphabet = make_alphabet("0123456789", "go", "again")

    def examples(self, split, n, seed):
        return sample_split(split, n, seed, lambda rng: (f"two:{rng.randrange(10**6)}", Example("go", "0", "0")))

    def start(self, example):
        return _TwoTurnEpisode()

    def demonstration(self, example, seed):
        return [{"role": "user", "content": "go"}, {"role": "assistant", "content": "0"}]


if "test_two_turns" not in ENVS:
    ENVS.register("test_two_turns")(_TwoTurns)


def _cfg(tiny_cfg, *extra):
    return tiny_cfg("task.name=env", 'task.env={name="test_two_turns", max_tokens=24}', "task.params={}",
                    "rollout.max_new_tokens=3", "checkpoint.every=0", "eval.every=0", "eval.prompts=8", *extra)


def test_the_turn_level_critic_targets_are_turn_gae_returns_on_turn_starts():
    # one episode, 2 turns: r = [0, 1], V(s_0) = 0.2, V(s_1) = 0.5, terminal; gamma 0.9, lam 1:
    # delta_1 = 1 + 0 - 0.5 = 0.5 -> A_1 = 0.5; delta_0 = 0 + 0.9 * 0.5 - 0.2 = 0.25 -> A_0 = 0.25 + 0.9 * 0.5 = 0.7
    # targets A + V = [0.9, 1.0] (the discounted returns r_0 + 0.9 r_1 and r_1), on tokens 1 and 4
    critic = Critic(None, None, CriticConfig(), gamma=0.9, lam=1.0, note="", turn_level=True)
    turn_ids = torch.tensor([[[-1, 0, 0, -1, 1]]])
    inputs = {"turn_rewards": torch.tensor([[[0.0, 1.0]]]), "turn_mask": torch.ones(1, 1, 2, dtype=torch.bool),
              "turn_values": torch.tensor([[[0.2, 0.5, 0.0]]]), "turn_ids": turn_ids}
    values_NT = torch.tensor([[0.0, 0.2, 0.3, 0.0, 0.5]])
    mask_NT = torch.tensor([[0.0, 1.0, 1.0, 0.0, 1.0]])
    ret, fit = critic.targets(torch.tensor([[1.0]]), values_NT, mask_NT, inputs)
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.9, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(fit, torch.tensor([[0.0, 1.0, 0.0, 0.0, 1.0]]))


def test_turn_ppo_trains_with_the_critic_read_at_turn_starts(tiny_cfg, quiet, prepare_calls, tmp_path):
    seen = prepare_calls
    cfg = _cfg(tiny_cfg, "algorithm.advantage=turn_ppo", "train.steps=3", "critic.lr=0.01", f'out="{tmp_path}"')
    rl.train(cfg, console=quiet)
    assert len(seen) == 3
    for i, (batch, prep) in enumerate(seen):
        inp = prep.inputs
        K = inp["turn_mask"].shape[-1]
        # turn_values are the critic's token values at each reached turn's first token, 0 after the last
        torch.testing.assert_close(inp["turn_values"], advantages.turn_start_values(inp["values"], inp["turn_ids"], K))
        if i == 0:  # the critic's head starts at zero: V = 0, so A_k is the discounted turn return
            assert inp["turn_values"].abs().max() == 0
        a_PGK, _ = advantages.turn_gae(inp["turn_rewards"], inp["turn_values"], inp["turn_mask"], gamma=0.99, lam=0.9)
        want_NT = advantages.broadcast_turns(a_PGK, inp["turn_ids"], inp["mask"])
        want_NT = want_NT.reshape(batch.rollouts.token_ids.shape)
        torch.testing.assert_close(prep.adv.reshape(want_NT.shape), want_NT)
    # after a step of fitting, the critic reads nonzero values at turn starts and the advantages are no longer
    # the plain returns
    assert seen[0][1].inputs["turn_rewards"].sum() > 0
    assert seen[-1][1].inputs["turn_values"].abs().max() > 0
    rows = [line for line in (tmp_path / "metrics.jsonl").read_text().splitlines() if '"critic/value_loss"' in line]
    assert len(rows) == 3
