"""RL-PLUS (arXiv:2508.00222; catalog 3.10): the "grpo_onpolicy_stats" estimator and the "rl_plus" loss."""

import math
from collections import defaultdict

import pytest
import torch

from posttrain.algorithms import advantages, losses

EPS = 1e-6


def _loss_and_grad(logp, old, adv, mask, **kw):
    logp = logp.clone().requires_grad_(True)
    out = losses.compute("rl_plus", logp, old, adv, mask, **kw)
    (g,) = torch.autograd.grad(out.sum(), logp)
    return out.detach(), g


# ---- grpo_onpolicy_stats ----


def test_catalog_all_wrong_group_gives_its_external_sample_advantage_one():
    # on-policy [0, 0, 0] -> mu = 0, sigma = 0 -> 1; the external sample (reward 1): A = (1 - 0) / (1 + 1e-6)
    r = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    ext = torch.tensor([[False, False, False, True]])
    a = advantages.compute("grpo_onpolicy_stats", r, external=ext)
    torch.testing.assert_close(a, torch.tensor([[0.0, 0.0, 0.0, 1.0 / (1.0 + EPS)]]))


def test_hand_example_statistics_exclude_the_external_sample():
    # on-policy [1, 0, 0]: mu = 1/3; unbiased var = ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, sigma = 0.577350
    # A = (r - 1/3) / 0.577350: 1 -> 1.154701, 0 -> -0.577350; the external 1 -> 1.154701 (plain GRPO over all four
    # would give mu = 0.5, sigma = 0.577350: +-0.866025)
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    ext = torch.tensor([[False, False, False, True]])
    a = advantages.compute("grpo_onpolicy_stats", r, external=ext)
    torch.testing.assert_close(a, torch.tensor([[1.154701, -0.577350, -0.577350, 1.154701]]), atol=1e-5, rtol=0)
    # population: sigma = sqrt(2/9) = 0.471405 -> (2/3) / 0.471405 = 1.414214, -(1/3) / 0.471405 = -0.707107
    pop = advantages.compute("grpo_onpolicy_stats", r, external=ext, std="population")
    torch.testing.assert_close(pop, torch.tensor([[1.414214, -0.707107, -0.707107, 1.414214]]), atol=1e-5, rtol=0)
    # none (the released script's grpo_use_std=False): r - 1/3
    flat = advantages.compute("grpo_onpolicy_stats", r, external=ext, std="none")
    torch.testing.assert_close(flat, torch.tensor([[2 / 3, -1 / 3, -1 / 3, 2 / 3]]) / (1 + EPS))


def test_without_external_rows_it_is_grpo():
    torch.manual_seed(0)
    r = torch.rand(5, 6)
    a = advantages.compute("grpo_onpolicy_stats", r, external=torch.zeros(5, 6, dtype=torch.bool))
    torch.testing.assert_close(a, advantages.compute("grpo", r))


def test_a_single_on_policy_sample_uses_mean_zero_and_std_one():
    # the authors' code: len(id2score) == 1 -> mu 0, sigma 1, so A = r / (1 + eps)
    r = torch.tensor([[0.5, 1.0]])
    a = advantages.compute("grpo_onpolicy_stats", r, external=torch.tensor([[False, True]]))
    torch.testing.assert_close(a, r / (1 + EPS))
    with pytest.raises(ValueError, match="no on-policy sample"):
        advantages.compute("grpo_onpolicy_stats", r, external=torch.tensor([[True, True]]))
    with pytest.raises(ValueError, match="std must be"):
        advantages.compute("grpo_onpolicy_stats", r, external=torch.tensor([[False, True]]), std="mad")


def _loop_reference(r, ext, eps=EPS):
    """compute_grpo_outcome_advantage_split (YihongDong/RL-PLUS @ eb4aa4d4e2), written as the authors' loop."""
    P, G = r.shape
    scores = r.reshape(-1).clone()
    index = [p for p in range(P) for _ in range(G)]
    on = ~ext.reshape(-1)
    id2score, id2mean, id2std = defaultdict(list), {}, {}
    for i in range(P * G):
        if bool(on[i]):
            id2score[index[i]].append(scores[i])
    for idx, vals in id2score.items():
        if len(vals) == 1:
            id2mean[idx], id2std[idx] = torch.tensor(0.0), torch.tensor(1.0)
        else:
            id2mean[idx], id2std[idx] = torch.mean(torch.stack(vals)), torch.std(torch.stack(vals))
        if id2std[idx].item() == 0:
            id2std[idx] = torch.tensor(1.0)
    return torch.stack([(scores[i] - id2mean[index[i]]) / (id2std[index[i]] + eps) for i in range(P * G)]).view(P, G)


def test_matches_the_authors_loop():
    g = torch.Generator().manual_seed(3)
    r = (torch.rand(16, 5, generator=g) > 0.6).float()
    r[0] = 0.0  # a flat group: sigma 0 -> 1
    ext = torch.zeros(16, 5, dtype=torch.bool)
    ext[:, -1] = True
    ext[1, 1:] = True  # a single on-policy sample
    ext[2, :2] = True  # external rows need not be last
    a = advantages.compute("grpo_onpolicy_stats", r, external=ext)
    torch.testing.assert_close(a, _loop_reference(r, ext))


# ---- rl_plus loss ----


def test_catalog_external_token_hand_example():
    # pi_theta = pi_old = 0.5, A = 1 on an external token: omega = (0.5 + 1) / 2 = 0.75,
    # r_off = 2 * 0.5 / (0.5 + 0.75) = 0.8, A_expl = 1 * (1 - 0.5)^0.5 = 0.707107, l = -0.8 * 0.707107 = -0.565685
    lp = torch.full((1, 1), math.log(0.5))
    loss, g = _loss_and_grad(lp, lp, torch.ones(1), torch.ones(1, 1), external=torch.tensor([True]))
    torch.testing.assert_close(loss, torch.tensor([[-0.565685]]), atol=1e-6, rtol=0)
    # r_off is proportional to pi_theta = exp(logp), and A_expl is detached: dl/dlogp = -r_off A_expl = l
    torch.testing.assert_close(g, torch.tensor([[-0.565685]]), atol=1e-6, rtol=0)


def test_external_ratio_mixes_old_and_one_and_the_exploration_weight_is_detached():
    # pi_theta = 0.5, pi_old = 0.25: omega = 0.625, r = 1 / 0.875 = 1.142857, A_expl = 2 * 0.707107 = 1.414214,
    # l = -1.616244; dl/dlogp = l (no term from (1 - pi_theta)^0.5: it is detached)
    lp, old = torch.full((1, 1), math.log(0.5)), torch.full((1, 1), math.log(0.25))
    loss, g = _loss_and_grad(lp, old, torch.full((1,), 2.0), torch.ones(1, 1), external=torch.ones(1))
    torch.testing.assert_close(loss, torch.tensor([[-1.616244]]), atol=1e-5, rtol=0)
    torch.testing.assert_close(g, loss)
    # a negative advantage pushes the external token down: l > 0
    neg, _ = _loss_and_grad(lp, old, torch.full((1,), -2.0), torch.ones(1, 1), external=torch.ones(1))
    torch.testing.assert_close(neg, -loss)


def test_off_clips_bound_the_external_ratio_only_when_set():
    # pi_theta = 0.9, pi_old = 0.1: omega = 0.55, r = 1.8 / 0.65 = 2.769231, A_expl = 0.1^0.5 = 0.316228
    # unclipped l = -0.875708; off_max_clip = 2: l = -2 * 0.316228 = -0.632456 (and no gradient through the clamp)
    lp, old = torch.full((1, 1), math.log(0.9)), torch.full((1, 1), math.log(0.1))
    one, m = torch.ones(1), torch.ones(1, 1)
    ext = torch.tensor([True])
    free, _ = _loss_and_grad(lp, old, one, m, external=ext)
    torch.testing.assert_close(free, torch.tensor([[-0.875708]]), atol=1e-5, rtol=0)
    capped, g = _loss_and_grad(lp, old, one, m, external=ext, off_max_clip=2.0)
    torch.testing.assert_close(capped, torch.tensor([[-0.632456]]), atol=1e-5, rtol=0)
    assert g.item() == 0.0
    floor, _ = _loss_and_grad(old, lp, one, m, external=ext, off_min_clip=2.0)  # r = 0.2 / 1.85 < 2 -> 2
    torch.testing.assert_close(floor, torch.tensor([[-2.0 * math.sqrt(0.9)]]), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="off_max_clip must be > 0"):
        losses.compute("rl_plus", lp, old, one, m, external=ext, off_max_clip=0.0)


def test_on_policy_tokens_are_ppo_clip():
    torch.manual_seed(1)
    lp, old = -torch.rand(4, 5), -torch.rand(4, 5)
    adv, mask = torch.randn(4), (torch.rand(4, 5) > 0.2).float()
    on = losses.compute("rl_plus", lp, old, adv, mask, external=torch.zeros(4, dtype=torch.bool))
    torch.testing.assert_close(on, losses.compute("ppo_clip", lp, old, adv, mask))
    # clip_upper_bound above 1 + eps_high raises the upper bound: ratio 1.5, A = 1 -> -1.5 (PPO's -1.2)
    lp1, old1 = torch.full((1, 1), math.log(1.5)), torch.zeros(1, 1)
    ext0 = torch.tensor([False])
    for bound, want in ((1.0, -1.2), (2.0, -1.5)):
        got = losses.compute("rl_plus", lp1, old1, torch.ones(1), torch.ones(1, 1), external=ext0,
                             clip_upper_bound=bound)
        torch.testing.assert_close(got, torch.tensor([[want]]))
    # clip = False (the released script's loss_remove_clip): -A rho
    got = losses.compute("rl_plus", lp1, old1, torch.ones(1), torch.ones(1, 1), external=ext0, clip=False)
    torch.testing.assert_close(got, torch.tensor([[-1.5]]))


def test_rows_mix_by_the_external_flag_and_padding_is_zero():
    torch.manual_seed(2)
    lp, old = -torch.rand(4, 3), -torch.rand(4, 3)
    adv, mask = torch.randn(4), torch.tensor([[1.0, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])
    ext = torch.tensor([False, True, False, True])
    mixed = losses.compute("rl_plus", lp, old, adv, mask, external=ext)
    all_on = losses.compute("rl_plus", lp, old, adv, mask, external=torch.zeros(4))
    all_off = losses.compute("rl_plus", lp, old, adv, mask, external=torch.ones(4))
    torch.testing.assert_close(mixed[~ext], all_on[~ext])
    torch.testing.assert_close(mixed[ext], all_off[ext])
    assert (mixed[mask == 0] == 0).all()
    # a per-token flag [N, T] (the config's probe shape) reads the same
    torch.testing.assert_close(losses.compute("rl_plus", lp, old, adv, mask, external=ext[:, None].expand(4, 3)), mixed)
    # at pi_theta = pi_old, an external token's gradient is the policy gradient scaled by 2p / (p + omega) and
    # the exploration weight: (-A) * 2p / (1.5 p + 0.5) * (1 - p)^0.5
    _, g = _loss_and_grad(lp, lp, adv, mask, external=ext)
    p = lp.exp()
    want = -adv[:, None] * 2 * p / (1.5 * p + 0.5) * (1 - p).sqrt() * mask
    torch.testing.assert_close(g[ext], want[ext])
    torch.testing.assert_close(g[~ext], (-adv[:, None] * mask)[~ext])  # PPO at ratio 1: the policy gradient
