"""The produced batch (posttrain/produce/batch.py): a driver's generation batch and a step's batch are one type;
selecting groups picks the per-group fields, joining batches concatenates them and adds up what it took."""

from __future__ import annotations

from dataclasses import fields

import torch

from posttrain.produce.batch import Batch
from posttrain.rollout import Rollout
from posttrain.tasks.base import Example

G = 2


def _batch(tag: str, P: int, T: int, **kw) -> Batch:
    """P groups of G rows, T tokens each; row n's tokens are 10 * n + t, its text tag + n; group p's reward p."""
    N = P * G
    tokens = (10 * torch.arange(N)[:, None] + torch.arange(T)).long()
    rollouts = Rollout.single_turn([[p] for p in range(P)], tokens, torch.ones(N, T), torch.zeros(N, T),
                                torch.ones(N, dtype=torch.bool), [f"{tag}{n}" for n in range(N)], G)
    r_PG = torch.arange(P, dtype=torch.float)[:, None].expand(P, G)
    return Batch(
        examples=[Example(f"{tag}q{p}", str(p), "") for p in range(P)], prompt_ids=[[p] for p in range(P)],
        rollouts=rollouts,
        scored_texts=[f"{tag}s{n}" for n in range(N)], rewards_PGK=r_PG[..., None].clone(),
        valid_PG=torch.ones(P, G, dtype=torch.bool), correct_PG=r_PG > 0, rerolled_P=torch.zeros(P, dtype=torch.bool),
        **{"metrics": {}, "failures": [], "consumed": P, "generate_s": 0.0, "reward_s": 0.0, "gen_tokens": N * T,
           "rewards_PG": r_PG.clone(), **kw},
    )


def test_selecting_groups_picks_every_per_group_field_and_keeps_what_it_took():
    b = _batch("a", 3, 2, metrics={"accuracy": 0.5}, failures=[{"index": 1}], generate_s=1.5,
               external_PG=torch.tensor([[False, True]] * 3),
               sampled_inputs={"baseline_rewards": torch.tensor([7.0, 8.0, 9.0])})
    s = b.select_groups([2, 0])
    assert [e.prompt for e in s.examples] == ["aq2", "aq0"] and s.prompt_ids == [[2], [0]]
    assert s.scored_texts == ["as4", "as5", "as0", "as1"]  # rows 2G, 2G + 1, then 0, 1
    assert s.rollouts.texts == ["a4", "a5", "a0", "a1"] and s.rollouts.token_ids[:, 0].tolist() == [40, 50, 0, 10]
    assert s.rewards_PG.tolist() == [[2.0, 2.0], [0.0, 0.0]] and s.rewards_PGK.shape == (2, G, 1)
    assert s.correct_PG.tolist() == [[True, True], [False, False]] and s.external_PG.tolist() == [[False, True]] * 2
    assert s.sampled_inputs["baseline_rewards"].tolist() == [9.0, 7.0]
    # what it took describes all 3 groups generated, the discarded one too
    assert (s.consumed, s.generate_s, s.gen_tokens, s.failures, s.metrics) == (3, 1.5, 12, [{"index": 1}],
                                                                                {"accuracy": 0.5})
    assert s.turns is None and b.select_groups([]).rewards_PG.shape == (0, G)


def test_joining_batches_concatenates_groups_pads_rows_and_adds_up_what_it_took():
    a = _batch("a", 1, 2, metrics={"accuracy": 1.0, "reward/mean": 2.0}, failures=[{"index": 0}], generate_s=0.5,
               reward_s=0.25, driver_state=["old"])
    b = _batch("b", 2, 3, metrics={"accuracy": 0.5, "only_b": 3.0}, failures=[{"index": 3}], generate_s=0.25,
               reward_s=0.5, driver_state=["new"])
    c = Batch.cat([a, b], pad_id=99)
    assert [e.prompt for e in c.examples] == ["aq0", "bq0", "bq1"] and c.scored_texts[:3] == ["as0", "as1", "bs0"]
    assert c.rollouts.token_ids.tolist()[:3] == [[0, 1, 99], [10, 11, 99], [0, 1, 2]]  # a's rows padded to T = 3
    assert c.rewards_PG.tolist() == [[0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]
    assert c.consumed == 1 + 2 and c.gen_tokens == 2 * 2 + 4 * 3 and c.generate_s == 0.75 and c.reward_s == 0.75
    assert c.failures == [{"index": 0}, {"index": 3}]
    # metrics: the mean over the generation batches of the first one's keys (a key it lacks counts 0)
    assert c.metrics == {"accuracy": (1.0 + 0.5) / 2, "reward/mean": (2.0 + 0.0) / 2}
    assert c.driver_state == ["new"]  # the driver's state after the last generation batch
    assert c.turns is None and c.external_PG is None and c.sampled_inputs == {}
    assert Batch.cat([a], pad_id=99).rollouts is a.rollouts  # one batch: its rows as they are


def test_every_field_says_how_it_goes_along():
    # a field without its rule would be silently dropped (select) or fail (cat): the one field list is the rule
    assert all("along" in f.metadata for f in fields(Batch))
