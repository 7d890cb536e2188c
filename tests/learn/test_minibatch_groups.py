"""A row-coupled loss gets whole groups in every minibatch of the update's own plan (issue 38, D10).

DRPO's objective is a sum over a prompt's group (a soft-max over its positives, a log-mean-exp over its
negatives); with ``train.minibatches > 1`` a row shuffle split groups across minibatches, so each minibatch
computed a different objective. The loss declares ``row_coupled``; ``LearnParts.minibatch_unit`` reads that
trait and ``policy_update`` shuffles and chunks groups, not rows.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from posttrain.algorithms import aggregation, losses
from posttrain.config import load_config
from posttrain.learn import update
from posttrain.learn.parts import LearnParts
from posttrain.learn.update import minibatch_rows
from posttrain.train import rl

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
DRPO = ['algorithm.loss="drpo"', 'algorithm.aggregation="seq_mean_token_mean"']


def _groups_whole(plan: list[torch.Tensor], groups_N: torch.Tensor) -> bool:
    """Every group's rows lie in one minibatch, all of them."""
    for idx in plan:
        for q in groups_N[idx].unique().tolist():
            if set((groups_N == q).nonzero().flatten().tolist()) - set(idx.tolist()):
                return False
    return True


def test_group_plan_by_hand_and_against_the_row_plan():
    groups_N = torch.arange(4).repeat_interleave(2)  # 4 groups of 2 rows: [0, 0, 1, 1, 2, 2, 3, 3]
    # in order, k = 2: groups {0, 1} then {2, 3}, i.e. rows 0-3 then 4-7
    assert [i.tolist() for i in minibatch_rows(8, 2, None, groups_N)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for seed in range(20):
        plan = minibatch_rows(8, 2, torch.Generator().manual_seed(seed), groups_N)
        assert sorted(torch.cat(plan).tolist()) == list(range(8)) and [len(i) for i in plan] == [4, 4]
        assert _groups_whole(plan, groups_N)
    # the old plan (rows shuffled) splits a group for most seeds: what the group plan rules out
    split = [not _groups_whole(minibatch_rows(8, 2, torch.Generator().manual_seed(s), None), groups_N)
             for s in range(20)]
    assert sum(split) > 10


def test_drpo_loss_on_a_group_minibatch_equals_the_whole_batch_loss_on_those_groups():
    # 4 groups of 2 rows, one correct and one wrong each, one token per row (so s_i = logp_i), tau = 10, logp = old
    # (k3 = 0, no KL term). Group 0: s_pos = -1, s_neg = -2: J = -1 - 10 log exp(-2 / 10) = -1 + 2 = 1, and each
    # row's loss is -J * N / (#groups * G_q) = -1 * 8 / (4 * 2) = -1 on the whole batch, -1 * 4 / (2 * 2) = -1 on a
    # minibatch of 2 whole groups: the same.
    logp = torch.tensor([[-1.0], [-2.0], [-0.5], [-3.0], [-1.5], [-1.0], [-2.5], [-0.2]])
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    groups_N, mask = torch.arange(4).repeat_interleave(2), torch.ones(8, 1)

    def loss(idx: torch.Tensor) -> torch.Tensor:
        return losses.compute("drpo", logp[idx], logp[idx], torch.zeros(len(idx)), mask[idx], rewards=rewards[idx],
                              group_ids=groups_N[idx], tau=10.0, max_len=1)

    whole = loss(torch.arange(8))
    assert math.isclose(float(whole[0, 0]), -1.0, abs_tol=1e-6)
    for seed in range(5):
        for idx in minibatch_rows(8, 2, torch.Generator().manual_seed(seed), groups_N):
            torch.testing.assert_close(loss(idx), whole[idx])
    # a row chunk that splits groups 1 and 2 (rows 3 and 4 apart from 2 and 5): groups without both kinds give 0
    split = torch.tensor([0, 1, 2, 4])
    assert not torch.allclose(loss(split), whole[split])
    # and the scalar: the mean of two whole-group minibatches' seq_mean_token_mean is the whole batch's
    plan = minibatch_rows(8, 2, torch.Generator().manual_seed(0), groups_N)
    parts = [aggregation.reduce("seq_mean_token_mean", loss(i), mask[i]) for i in plan]
    torch.testing.assert_close(sum(parts) / 2, aggregation.reduce("seq_mean_token_mean", whole, mask))


def test_the_unit_follows_the_trait_not_a_name():
    drpo = load_config(RECIPES / "tiny.toml", DRPO)
    grpo = load_config(RECIPES / "tiny.toml", [])
    assert losses.REGISTRY.traits("drpo").row_coupled and not losses.REGISTRY.traits("ppo_clip").row_coupled
    assert LearnParts.from_config(drpo.algorithm, 6).minibatch_unit == "group"
    assert LearnParts.from_config(grpo.algorithm, 6).minibatch_unit == "row"


def test_a_drpo_run_with_two_minibatches_trains_whole_groups(tmp_path, quiet, monkeypatch):
    seen: list[torch.Tensor] = []
    real = update.minibatch_step

    def spy(model, optimizer, parts, cfg, batch, *args, **kwargs):
        seen.append(batch.idx)
        return real(model, optimizer, parts, cfg, batch, *args, **kwargs)

    monkeypatch.setattr(update, "minibatch_step", spy)
    cfg = load_config(RECIPES / "tiny.toml", [
        *DRPO, f'out="{tmp_path / "run"}"', "train.steps=1", "train.minibatches=2", "log.progress=false",
        "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0", "eval.every=0",
    ])
    rl.train(cfg, console=quiet)
    G = cfg.rollout.group_size
    assert len(seen) == 2
    assert sorted(torch.cat(seen).tolist()) == list(range(cfg.rollout.prompts_per_step * G))
    for idx in seen:  # group p holds rows p G .. p G + G - 1 (prepare's group_ids): each appears G times
        groups = idx // G
        assert all(int((groups == q).sum()) == G for q in groups.unique()), f"a group split: rows {idx.tolist()}"
