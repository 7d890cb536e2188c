"""Tests for posttrain.algorithms.advantages: worked numbers from the catalog, invariants, loops."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms import advantages as adv
from posttrain.algorithms.registry import UnknownNameError

T = torch.tensor
R4 = T([[1.0, 0.0, 0.0, 1.0]])  # the catalog's running example group


def close(x: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(x, T(expected, dtype=x.dtype), atol=atol, rtol=0)


def ones_mask(p: int, g: int, t: int = 1) -> torch.Tensor:
    return torch.ones(p, g, t)


# --------------------------------------------------------------------------- contract


def test_registry_contract_and_unknown_name():
    assert {"grpo", "dr_grpo", "rloo", "gae", "reinforce_pp", "qae", "gdpo"} <= set(adv.names())
    with pytest.raises(UnknownNameError, match="grpo"):
        adv.compute("grpoo", R4)
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        adv.compute("grpo", T([1.0, 0.0]))
    # undeclared kwargs are ignored, declared ones are used
    close(adv.compute("grpo", R4, lengths=T([[1, 2, 3, 4]]), std="population"), [[1, -1, -1, 1]])


def _extra_inputs(p: int, g: int, t: int, gen: torch.Generator) -> dict[str, object]:
    mask = torch.ones(p, g, t)
    mask[0, 0, t - 1 :] = 0.0  # a shorter response
    return {
        "lengths": mask.sum(-1),
        "mask": mask,
        "logprobs": -torch.rand(p, g, t, generator=gen) * 3,
        "entropies": torch.rand(p, g, t, generator=gen) * 2,
        "values": torch.rand(p, g, t, generator=gen),
        "token_rewards": torch.randn(p, g, t, generator=gen) * 0.1,
        "induced_rewards": torch.randn(p, g, t, generator=gen),  # tf_reward's teacher-forcing-induced step reward
        "metric": torch.rand(p, g, generator=gen),
        "baseline_rewards": torch.rand(p, generator=gen),
        "reference_rewards": (torch.rand(p, g, generator=gen) > 0.5).float(),  # one a slot (aapo_momentum)
        "prompt_confidence": torch.rand(p, generator=gen),
        # turn-level inputs (two turns: the first half of each response is turn 0, the rest turn 1)
        "turn_rewards": torch.rand(p, g, 2, generator=gen),
        "turn_mask": torch.ones(p, g, 2, dtype=torch.bool),
        "turn_ids": torch.where(mask > 0, (torch.arange(t) * 2 // t).expand(p, g, t), -1),
        "state_ids": torch.randint(-1, 3, (p, g, 2), generator=gen),
        "agent_ids": torch.zeros(p, g, 2, dtype=torch.long),
        "expert_match": torch.ones(p, g, 2, dtype=torch.bool),
        "turn_values": torch.rand(p, g, 3, generator=gen),
        "turn_values_low": torch.rand(p, g, 2, generator=gen),
        "turn_values_high": torch.rand(p, g, 3, generator=gen),
        "switch": torch.zeros(p, g, 2, dtype=torch.bool),
        # RL-PLUS: the last row of a group is external (a group of one keeps its on-policy sample)
        "external": torch.arange(g).expand(p, g) == (g - 1 if g > 1 else g),
    }


@pytest.mark.parametrize("name", adv.names())
def test_every_estimator_finite_on_random_batch(name):
    gen = torch.Generator().manual_seed(0)
    p, g, t = 3, 4, 5
    rewards = (torch.rand(p, g, generator=gen) > 0.5).float()
    rewards[1] = 1.0  # one all-correct group
    rewards[2] = 0.0  # one all-wrong group
    if name in ("gdpo", "gd2po"):
        rewards = torch.stack([rewards, torch.rand(p, g, generator=gen)], dim=-1)
    out = adv.compute(name, rewards, **_extra_inputs(p, g, t, gen))
    assert out.shape in ((p, g), (p, g, t)), out.shape
    assert torch.isfinite(out).all()
    assert not out.requires_grad


@pytest.mark.parametrize("name", adv.names())
def test_every_estimator_handles_a_group_of_one(name):
    gen = torch.Generator().manual_seed(1)
    rewards = T([[1.0], [0.0]])
    if name in ("gdpo", "gd2po"):
        rewards = torch.stack([rewards, rewards], dim=-1)
    extra = _extra_inputs(2, 1, 3, gen)
    kwargs = {"k": 1} if name == "passk" else {}
    out = adv.compute(name, rewards, **extra, **kwargs)
    assert torch.isfinite(out).all()


# names whose advantage is exactly 0 when every reward of a group is equal (no group signal)
ZERO_ON_EQUAL = [
    "grpo", "dr_grpo", "rloo", "opo", "grpo_passk", "qae", "mapo", "f_grpo", "passk",
    "canon", "a_grae", "ha_dw", "capo", "grpo_n", "gdpo", "gd2po", "reinforce_pp_baseline",
    "entropy_adv", "a3po",
]  # fmt: skip


@pytest.mark.parametrize("name", ZERO_ON_EQUAL)
@pytest.mark.parametrize("value", [0.0, 1.0, 0.3])
def test_equal_rewards_give_zero_advantage(name, value):
    gen = torch.Generator().manual_seed(2)
    rewards = torch.full((2, 4), value)
    if name in ("gdpo", "gd2po"):
        rewards = torch.stack([rewards, rewards], dim=-1)
    out = adv.compute(name, rewards, **_extra_inputs(2, 4, 3, gen), k=2)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, torch.zeros_like(out), atol=1e-6, rtol=0)


# --------------------------------------------------------------------------- baselines


def test_grpo_dr_grpo_rloo_worked_numbers():
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.57735 -> 0.5 / (0.57735 + 1e-6) = 0.866024
    close(adv.compute("grpo", R4), [[0.866024, -0.866024, -0.866024, 0.866024]])
    # population std = 0.5 -> 0.5 / 0.5 = 1
    close(adv.compute("grpo", R4, std="population"), [[1, -1, -1, 1]])
    close(adv.compute("dr_grpo", R4), [[0.5, -0.5, -0.5, 0.5]])
    # leave-one-out: 1 - mean(0, 0, 1) = 0.666667
    close(adv.compute("rloo", R4), [[0.666667, -0.666667, -0.666667, 0.666667]])


def test_opo_length_weighted_baseline():
    # b = (3*1 + 1*0 + 1*0 + 3*1) / (3+1+1+3) = 6/8 = 0.75 -> r - 0.75
    out = adv.compute("opo", R4, lengths=T([[3.0, 1.0, 1.0, 3.0]]))
    close(out, [[0.25, -0.75, -0.75, 0.25]])
    # equal lengths -> Dr.GRPO
    close(adv.compute("opo", R4, lengths=torch.ones(1, 4)), [[0.5, -0.5, -0.5, 0.5]])


def test_grpo_passk_best_sample_only():
    # best 0.9, second 0.5 -> only index 1 gets 0.4
    r = T([[0.2, 0.9, 0.5, 0.5]])
    close(adv.compute("grpo_passk", r), [[0, 0.4, 0, 0]])
    # verl's default divides by the unbiased std: std([.2,.9,.5,.5]) = 0.287228
    s = r.std().item()
    close(adv.compute("grpo_passk", r, std="unbiased"), [[0, 0.4 / (s + 1e-6), 0, 0]])
    # a tie for the best gives 0 everywhere
    close(adv.compute("grpo_passk", R4), [[0, 0, 0, 0]])


def test_a_star_subtracts_the_optimal_value_of_the_reference_samples():
    # A*-PO (catalog 3.9): V* = 0.5 log((2 e^2 + 2) / 4) = 0.716890 from references [1, 0, 0, 1]; A = r - V*
    out = adv.compute("a_star", T([[1.0], [0.0]]), reference_rewards=T([[1.0, 0.0, 0.0, 1.0]] * 2), beta1=0.5)
    torch.testing.assert_close(out, T([[0.283110], [-0.716890]]), atol=1e-5, rtol=0)
    # beta1 -> 0: the plain mean (0.5); V* lies between the mean and the max of the references
    torch.testing.assert_close(adv.compute("a_star", T([[1.0]]), reference_rewards=T([[1.0, 0, 0, 1]]), beta1=0.0),
                               T([[0.5]]))
    for beta1 in (0.05, 0.5, 5.0):
        v = 1.0 - adv.compute("a_star", T([[1.0]]), reference_rewards=T([[1.0, 0, 0, 1]]), beta1=beta1)
        assert 0.5 < float(v) < 1.0


def test_aapo_momentum_adds_the_clipped_margin_over_the_reference_to_grpo():
    # catalog 3.20: r = [1, 0, 0, 1], r_ref = [0, 0, 1, 1]; mean 0.5, unbiased std sqrt(1/3) = 0.577350, + eps 1e-4:
    # the group term is +-0.5 / 0.577450 = +-0.865875; margins r - r_ref = [1, 0, -1, 0] clip to [0.28, 0, -0.2, 0]
    out = adv.compute("aapo_momentum", T([[1.0, 0.0, 0.0, 1.0]]), reference_rewards=T([[0.0, 0.0, 1.0, 1.0]]))
    torch.testing.assert_close(out, T([[1.145875, -0.865875, -1.065875, 0.865875]]), atol=1e-6, rtol=0)
    # what distinguishes it: a group whose rewards are all equal has no GRPO signal (0 everywhere), but a slot
    # whose reference response did worse (better) gets +min(margin, 0.28) (-min(-margin, 0.2)): the momentum term
    refs = T([[0.0, 1.0, 1.0, 0.0]])
    assert adv.compute("grpo", T([[1.0, 1.0, 1.0, 1.0]])).abs().max() == 0
    flat = adv.compute("aapo_momentum", T([[1.0, 1.0, 1.0, 1.0]]), reference_rewards=refs)
    torch.testing.assert_close(flat, T([[0.28, 0.0, 0.0, 0.28]]))
    flat = adv.compute("aapo_momentum", T([[0.0, 0.0, 0.0, 0.0]]), reference_rewards=refs)
    torch.testing.assert_close(flat, T([[0.0, -0.2, -0.2, 0.0]]))
    # one reference response per sample slot, else a clear error naming the setting
    with pytest.raises(ValueError, match="advantage_params.samples = 4"):
        adv.compute("aapo_momentum", T([[1.0, 0.0, 0.0, 1.0]]), reference_rewards=T([[0.0, 1.0]]))


def test_remax_subtracts_greedy_reward():
    # baseline per prompt: 0.5 and 1.0
    out = adv.compute("remax", T([[1.0, 0.0], [1.0, 0.0]]), baseline_rewards=T([0.5, 1.0]))
    close(out, [[0.5, -0.5], [0.0, -1.0]])


# --------------------------------------------------------------------------- token level


def test_reinforce_pp_worked_number():
    # two 1-token responses with returns [1, 0]: mean 0.5, unbiased var 0.5 -> +-0.5/sqrt(0.5)
    out = adv.compute("reinforce_pp", T([[1.0, 0.0]]), mask=ones_mask(1, 2))
    close(out, [[[0.707107], [-0.707107]]])


def test_reinforce_pp_baseline_worked_number():
    # centred [.5,-.5,-.5,.5]; batch mean 0, unbiased var 1/3 -> 0.5 / sqrt(1/3) = 0.866025
    out = adv.compute("reinforce_pp_baseline", R4, mask=ones_mask(1, 4))
    close(out, [[[0.866025], [-0.866025], [-0.866025], [0.866025]]])


def _loop_returns(tok: list[float], mask: list[float], gamma: float) -> list[float]:
    out, running = [0.0] * len(tok), 0.0
    for t in reversed(range(len(tok))):
        running = tok[t] + gamma * running
        out[t] = running
        running *= mask[t]
    return out


def test_reinforce_pp_returns_match_loop_reference():
    gen = torch.Generator().manual_seed(3)
    p, g, t, gamma = 2, 3, 6, 0.9
    rewards = torch.rand(p, g, generator=gen)
    token_rewards = torch.randn(p, g, t, generator=gen) * 0.1
    mask = torch.ones(p, g, t)
    mask[0, 1, 4:] = 0
    mask[1, 2, 2:] = 0
    tok = adv._token_rewards(rewards, mask, token_rewards)
    ref = torch.zeros(p, g, t)
    for i in range(p):
        for j in range(g):
            # outcome on the last valid token, token rewards on every valid token
            n = int(mask[i, j].sum())
            dense = [float(token_rewards[i, j, s]) if s < n else 0.0 for s in range(t)]
            dense[n - 1] += float(rewards[i, j])
            torch.testing.assert_close(tok[i, j], T(dense), atol=1e-6, rtol=0)
            ref[i, j] = T(_loop_returns(dense, mask[i, j].tolist(), gamma))
    torch.testing.assert_close(adv.discounted_returns(tok, mask, gamma=gamma), ref, atol=1e-6, rtol=0)
    # the estimator whitens the returns over masked tokens (unbiased variance)
    vals = ref[mask > 0]
    expected = (ref - vals.mean()) / torch.sqrt(vals.var(unbiased=True) + 1e-8) * mask
    out = adv.compute("reinforce_pp", rewards, mask=mask, token_rewards=token_rewards, gamma=gamma)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


def test_gae_worked_number():
    # r=[0,0,1], V=[.5,.6,.7], gamma=1, lam=.95:
    # t=2: delta = 1 - .7 = .3 -> A=.3; t=1: delta = .7 - .6 = .1 -> A = .1 + .95*.3 = .385
    # t=0: delta = .6 - .5 = .1 -> A = .1 + .95*.385 = .46575
    values = T([[[0.5, 0.6, 0.7]]])
    out = adv.compute("gae", T([[1.0]]), values=values, mask=torch.ones(1, 1, 3), lam=0.95, whiten=False)
    close(out, [[[0.46575, 0.385, 0.3]]])
    a, ret = adv.gae_advantages_and_returns(T([[[0.0, 0.0, 1.0]]]), values, torch.ones(1, 1, 3), lam=0.95)
    close(ret, [[[0.96575, 0.985, 1.0]]])


def _loop_gae(r: list[float], v: list[float], m: list[float], gamma: float, lam: float) -> list[float]:
    # verl's loop: masked positions pass V_{t+1} and A_{t+1} through
    out, next_v, next_a = [0.0] * len(r), 0.0, 0.0
    for t in reversed(range(len(r))):
        delta = r[t] + gamma * next_v - v[t]
        a_t = delta + gamma * lam * next_a
        if m[t] > 0:
            next_v, next_a = v[t], a_t
        out[t] = next_a
    return out


def test_gae_matches_loop_reference_with_holes():
    gen = torch.Generator().manual_seed(4)
    p, g, t, gamma, lam = 2, 2, 7, 0.99, 0.9
    tok = torch.randn(p, g, t, generator=gen)
    values = torch.randn(p, g, t, generator=gen)
    mask = torch.ones(p, g, t)
    mask[0, 0, 2:4] = 0  # observation tokens in the middle (multi-turn)
    mask[1, 1, 5:] = 0  # padding
    a, ret = adv.gae_advantages_and_returns(tok, values, mask, gamma=gamma, lam=lam)
    for i in range(p):
        for j in range(g):
            ref = _loop_gae(tok[i, j].tolist(), values[i, j].tolist(), mask[i, j].tolist(), gamma, lam)
            torch.testing.assert_close(a[i, j], T(ref), atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, a + values)
    # whitened output: zero mean, unit (unbiased) variance over the masked tokens
    out = adv.compute(
        "gae", torch.zeros(p, g), values=values, mask=mask, token_rewards=tok, gamma=gamma, lam=lam
    )
    vals = out[mask > 0]
    assert abs(vals.mean().item()) < 1e-5 and abs(vals.var().item() - 1.0) < 1e-4
    assert (out[mask == 0] == 0).all()


def test_entropy_adv_clipped_bonus():
    # A = .866025; H=1.5: min(.4*1.5=.6, .866/2=.433) = .433 -> 1.299038
    # A = -.866025, H=1.5 -> -.433013; A = -.866025, H=.5: min(.2, .433) -> -.666025; A=.866, H=.5 -> 1.066025
    ent = T([[[1.5], [1.5], [0.5], [0.5]]])
    out = adv.compute("entropy_adv", R4, entropies=ent, mask=ones_mask(1, 4))
    close(out, [[[1.299038], [-0.433013], [-0.666025], [1.066025]]])


def test_a3po_polarity_multipliers():
    # p_t = .5 on every token: positives x (1 + .5*.5) = 1.25, negatives x (1 + .5*.5) = 1.25
    # p_t = .9: positives x 1.05, negatives x 1.45 (high-prob tokens of wrong answers amplified)
    lp = torch.log(T([[[0.5, 0.9]], [[0.5, 0.9]], [[0.5, 0.9]], [[0.5, 0.9]]])).view(1, 4, 2)
    out = adv.compute("a3po", R4, logprobs=lp, mask=torch.ones(1, 4, 2))
    a = 0.866024
    close(out[0, 0], [a * 1.25, a * 1.05])
    close(out[0, 1], [-a * 1.25, -a * 1.45])


# --------------------------------------------------------------------------- seed methods


def test_qae_quantile_baseline():
    # K=.4 of [0,0,1,1] interpolates: index .4*3 = 1.2 -> 0 + .2*(1-0) = .2; std_u .57735
    # (1 - .2)/.57735 = 1.385638; (0 - .2)/.57735 = -.346410
    close(adv.compute("qae", R4), [[1.385638, -0.346410, -0.346410, 1.385638]])
    # 8 samples, 2 correct: Q = 0 -> correct (1-0)/std_u(=.46291) = 2.160242, wrong 0
    r2 = T([[1.0, 1.0, 0, 0, 0, 0, 0, 0]])
    close(adv.compute("qae", r2), [[2.160242, 2.160242, 0, 0, 0, 0, 0, 0]])
    # 6 correct: Q = 1 -> correct 0, wrong -2.160242
    r6 = T([[1.0, 1, 1, 1, 1, 1, 0, 0]])
    close(adv.compute("qae", r6), [[0, 0, 0, 0, 0, 0, -2.160242, -2.160242]])
    with pytest.raises(ValueError):
        adv.compute("qae", R4, quantile=1.5)


def test_ngrpo_virtual_sample():
    # [1,0,0,1] + {1}: mean .6, std_u .547723 -> (1-.6)/.547723 = .730295, (0-.6)/.547723 = -1.095443
    close(adv.compute("ngrpo", R4), [[0.730295, -1.095443, -1.095443, 0.730295]])
    # all wrong + {1}: mean .2, std_u sqrt(.2) = .447214 -> -.2/.447214 = -.447212
    close(adv.compute("ngrpo", torch.zeros(1, 4)), [[-0.447212] * 4])
    # all correct: the virtual sample changes nothing -> 0
    close(adv.compute("ngrpo", torch.ones(1, 4)), [[0.0] * 4])


def test_mapo_mix():
    # [1,1,1,0]: p=.75, lambda = 1 - 4*.75*.25 = .25; mu=.75, std_u .5
    # correct: .75 * .25/.5 + .25 * .25/.75 = .375 + .083333 = .458333
    # wrong:   .75 * -.75/.5 + .25 * -.75/.75 = -1.125 - .25 = -1.375
    close(adv.compute("mapo", T([[1.0, 1, 1, 0]])), [[0.458332, 0.458332, 0.458332, -1.374997]])
    # 50/50 group: lambda = 0 -> GRPO
    close(adv.compute("mapo", R4), [[0.866024, -0.866024, -0.866024, 0.866024]])


def test_f_grpo_focal_weight():
    # [1,0,0,1], gamma 1: g = 1 - .5 = .5 -> +-.433012; gamma 2: .25 -> +-.216506
    close(adv.compute("f_grpo", R4), [[0.433012, -0.433012, -0.433012, 0.433012]])
    close(adv.compute("f_grpo", R4, gamma=2.0), [[0.216506, -0.216506, -0.216506, 0.216506]])
    # [1,1,1,0]: g = .25; GRPO [.5,.5,.5,-1.5] -> [.125,.125,.125,-.375]
    close(adv.compute("f_grpo", T([[1.0, 1, 1, 0]])), [[0.125, 0.125, 0.125, -0.375]])


def test_passk_analytic_advantage():
    # n=4, c=2, k=2: rho = 1 - C(2,2)/C(4,2) = 1 - 1/6 = .833333; sigma = sqrt(.8333*.1667) = .372678
    # A_pos = .166667/.372678 = .447212; A_neg = (.166667 - C(1,1)/C(3,1)) / .372678 = -.447212
    close(adv.compute("passk", R4, k=2), [[0.447212, -0.447212, -0.447212, 0.447212]])
    # k=1 is GRPO with the population std (+-1)
    close(adv.compute("passk", R4, k=1), [[0.999998, -0.999998, -0.999998, 0.999998]])
    # n=8, c=2, k=4: rho = 1 - C(6,4)/C(8,4) = 1 - 15/70 = .785714; sigma = .410326
    # A_pos = .214286/.410326 = .522232; A_neg = (.214286 - C(5,3)/C(7,3)=10/35)/.410326 = -.174077
    r = T([[1.0, 1, 0, 0, 0, 0, 0, 0]])
    close(adv.compute("passk", r, k=4), [[0.522232] * 2 + [-0.174077] * 6])
    with pytest.raises(ValueError):
        adv.compute("passk", R4, k=5)


def test_lens_confidence_weighted_penalty():
    lp = torch.log(T([0.5, 0.4, 0.2, 0.1])).view(1, 4, 1)
    m = ones_mask(1, 4)
    # all wrong: D = 2 * .5 = 1; r~ = -(1/4) pbar/(1 - pbar) = [-.25, -.166667, -.0625, -.027778]
    # de-meaned (mean -.126736): [-.123264, -.039931, .064236, .098958], times alpha = .25
    out = adv.compute("lens", torch.zeros(1, 4), logprobs=lp, mask=m)
    close(out, [[-0.123264 * 0.25, -0.039931 * 0.25, 0.064236 * 0.25, 0.098958 * 0.25]])
    # mixed [1,0,0,1]: D_imp = (1/4 (1/.5 + 1/.1))^-1 = 1/3, D = max(1/3, 1) = 1
    # r~ = [1, -.166667, -.0625, 1] -> GRPO (std_u) [.864139, -.944900, -.783379, .864139]
    out = adv.compute("lens", R4, logprobs=lp, mask=m)
    close(out, [[0.864139, -0.944900, -0.783379, 0.864139]], atol=2e-5)
    # pbar is the geometric mean over masked tokens only: padding must not change it
    lp2 = torch.cat([lp, torch.full((1, 4, 1), -50.0)], dim=-1)
    m2 = torch.cat([m, torch.zeros(1, 4, 1)], dim=-1)
    torch.testing.assert_close(adv.compute("lens", R4, logprobs=lp2, mask=m2), out)


def test_ddca_conditional_length_advantage():
    # A_acc with the population std: [1,-1,-1,1]. Correct set lengths [100, 300]: mean 200, std_p 100
    # z = [-1, 1], s = [.268941, .731059], mean .5 -> A_len = [.231059, -.231059]
    # DDCA x pass rate .5 x beta .2: +-.023106 -> [1.023106, -1, -1, .976894]
    lengths = T([[100.0, 200.0, 300.0, 300.0]])
    close(adv.compute("ddca", R4, lengths=lengths), [[1.023106, -1.0, -1.0, 0.976894]])
    close(adv.compute("ddca", R4, lengths=lengths, dynamic=False), [[1.046212, -1.0, -1.0, 0.953788]])
    # an all-correct group keeps a pure length signal (pass rate 1): lengths [100, 300] -> +-.2*.231059
    out = adv.compute("ddca", T([[1.0, 1.0]]), lengths=T([[100.0, 300.0]]))
    close(out, [[0.046212, -0.046212]])
    # an all-wrong group gets 0
    close(adv.compute("ddca", T([[0.0, 0.0]]), lengths=T([[100.0, 300.0]])), [[0.0, 0.0]])


def test_canon_regrouping():
    ent = T([[0.9, 0.1, 0.3, 0.5]])
    # ascending metric: low half {1 (.1), 2 (.3)} rewards [0,0] -> m- = 0; high half {3, 0} -> m+ = 1
    # mu=1: high: r - m- = [1, 1]; low: r - m+ = [-1, -1]
    close(adv.compute("canon", R4, metric=ent), [[1, -1, -1, 1]])
    close(adv.compute("canon", R4, metric=ent, inter_weight=0.0), [[0, 0, 0, 0]])
    close(adv.compute("canon", R4, metric=ent, inter_weight=0.5), [[0.5, -0.5, -0.5, 0.5]])  # = Dr.GRPO
    # [1,0,1,0]: low {1, 2} rewards [0, 1] m- = .5; high {3, 0} rewards [0, 1] m+ = .5
    close(adv.compute("canon", T([[1.0, 0, 1, 0]]), metric=ent), [[0.5, -0.5, 0.5, -0.5]])


def test_progrpo_confidence_reweighting():
    # A + (c(q) - c(o)) = [.866 - .4, -.866 + .2, -.866 + .1, .866 + .3]
    conf = T([[0.9, 0.3, 0.4, 0.2]])
    expected = [[0.466025, -0.666025, -0.766025, 1.166025]]
    out = adv.compute("progrpo", R4, prompt_confidence=T([0.5]), answer_confidence=conf)
    close(out, expected)
    # the same from one-token log-probs (the lowest 20% of one token is that token)
    lp = torch.log(conf).view(1, 4, 1)
    close(adv.compute("progrpo", R4, prompt_confidence=T([0.5]), logprobs=lp, mask=ones_mask(1, 4)), expected)
    # an all-wrong group keeps plain GRPO (0)
    out = adv.compute("progrpo", torch.zeros(1, 4), prompt_confidence=T([0.5]), answer_confidence=conf)
    close(out, [[0, 0, 0, 0]])
    with pytest.raises(ValueError, match="answer_confidence"):
        adv.compute("progrpo", R4, prompt_confidence=T([0.5]))


def test_low_prob_confidence_takes_lowest_fraction():
    # 10 tokens, fraction .2 -> the 2 lowest log-probs (-3, -2) -> exp(-2.5); padding ignored
    lp = T([[[-3.0, -2.0, -1.0, -0.5, -0.1, -0.1, -0.1, -0.1, -0.1, -0.1, -99.0]]])
    mask = torch.ones(1, 1, 11)
    mask[..., -1] = 0
    close(adv.low_prob_confidence(lp, mask), [[math.exp(-2.5)]])


def test_a_grae_curriculum_and_attenuation():
    r = T([[1.0, 0, 0, 1], [1.0, 1, 1, 0]])
    # mu = .5 and .75 -> m = .625. Group 1: A^ = +-.866024, sqrt(.5) = .707107
    # A_diff = .5*.866/.7071 = .612372, A_easy = .5*.866/.292893 = 1.478398
    # A = .375*1.478398 + .625*.612372 = .937131; positive -> x min(1, .625) = .585707
    close(
        adv.compute("a_grae", r),
        [[0.5857, -0.9371, -0.9371, 0.5857], [0.5501, 0.5501, 0.5501, -2.6405]],
        atol=1e-4,
    )
    # momentum 0 (the authors'): the progress is this batch's, whatever the history
    st = adv.AGRAEState(mean_accuracy=0.1)
    torch.testing.assert_close(adv.compute("a_grae", r, state=st), adv.compute("a_grae", r))
    # update: EMA of batch accuracy (.625 here): .5 * 0 + .5 * .625 = .3125
    st2 = adv.a_grae_update_state(adv.AGRAEState(mean_accuracy=0.0), r, momentum=0.5)
    assert st2 == adv.AGRAEState(mean_accuracy=0.3125)
    assert adv.a_grae_update_state(None, r).mean_accuracy == pytest.approx(0.625)
    # with momentum, the entry folds this batch in before using the progress (no lag behind the batch):
    # history 0 at momentum .5 gives m = .3125, the m that momentum 1 reads straight from a state of .3125
    torch.testing.assert_close(
        adv.compute("a_grae", r, state=adv.AGRAEState(mean_accuracy=0.0), momentum=0.5),
        adv.compute("a_grae", r, state=adv.AGRAEState(mean_accuracy=0.3125), momentum=1.0),
    )
    assert not torch.allclose(  # the lagged m (0: the history alone) gives other advantages
        adv.compute("a_grae", r, state=adv.AGRAEState(mean_accuracy=0.0), momentum=0.5),
        adv.compute("a_grae", r, state=adv.AGRAEState(mean_accuracy=0.0), momentum=1.0),
    )


def test_ha_dw_reweighting_and_anchor_update():
    # C = .5, group [1,0,0,0]: p^ = .25, diff = -.25, M = .25; A^ (std_u) = [1.5, -.5, -.5, -.5]
    # D = -sgn(A) sgn(diff) = [+1, -1, -1, -1] -> Phi = [e^.25 = 1.284025, e^-.25 = .778801]
    # catalog 3.15 (lambda_scale 1): A' = Phi A^ = [1.5 * 1.284025, -.5 * .778801 x3]
    kalman = {"anchor": "kalman"}
    out = adv.compute("ha_dw", T([[1.0, 0, 0, 0]]), state=adv.HADWState(anchor=0.5), scale=1.0, **kalman)
    close(out, [[1.926034, -0.389400, -0.389400, -0.389400]])
    # default scale 1.5, the authors' literal (yangfengkai/HA-DW core_algos.py):
    # 1.5 * 1.926034 = 2.889051; 1.5 * -.389400 = -.584101 (= -.75 * e^-.25)
    default = adv.compute("ha_dw", T([[1.0, 0, 0, 0]]), state=adv.HADWState(anchor=0.5), **kalman)
    close(default, [[2.889051, -0.584101, -0.584101, -0.584101]])
    torch.testing.assert_close(adv.compute("ha_dw", T([[1.0, 0, 0, 0]]), **kalman), default)  # None = anchor .5
    # the window anchor (the authors'): mean of the recent accuracies with this batch's: (.75 + .25) / 2 = .5,
    # so the same C = .5 as above and the same advantages
    recent = adv.HADWState(recent=(0.75,))
    torch.testing.assert_close(adv.compute("ha_dw", T([[1.0, 0, 0, 0]]), state=recent), default)
    # no history: C = this batch's accuracy .25 = p^, diff 0, Phi = 1.5 e^0: A' = 1.5 A^ = [2.25, -.75 x3]
    close(adv.compute("ha_dw", T([[1.0, 0, 0, 0]])), [[2.25, -0.75, -0.75, -0.75]])
    # window update: the last `window` accuracies; C their mean
    st = adv.ha_dw_update_state(adv.HADWState(recent=(1.0, 0.5)), T([[1.0, 0, 0, 0]]), window=2)
    assert st.recent == (0.5, 0.25) and st.anchor == pytest.approx(0.375)
    # Kalman: C+ = (1 - .1) .5 + .1 * .25 = .475
    st = adv.ha_dw_update_state(adv.HADWState(anchor=0.5), T([[1.0, 0, 0, 0]]), **kalman)
    assert st.anchor == pytest.approx(0.475)
    # eta * stability = 2 is clipped to a rate of 1: the anchor becomes the batch accuracy .5
    assert adv.ha_dw_update_state(None, R4, eta=0.5, stability=4.0, **kalman).anchor == pytest.approx(0.5)
    with pytest.raises(ValueError, match="window"):
        adv.ha_dw_update_state(None, R4, window=0)


def test_capo_phases():
    st0, late = adv.CAPOState(step=0), adv.CAPOState(step=100)
    close(adv.compute("capo", R4, state=st0), [[0.866024, 0, 0, 0.866024]])
    close(adv.compute("capo", R4, state=late), [[0.866024, -0.866024, -0.866024, 0.866024]])
    # step 99 < switch_step 100 (our default) still masks; switch_step is a per-run setting
    close(adv.compute("capo", R4, state=adv.CAPOState(step=99)), [[0.866024, 0, 0, 0.866024]])
    torch.testing.assert_close(adv.compute("capo", R4, state=adv.CAPOState(step=60), switch_step=60),
                               adv.compute("grpo", R4))
    assert adv.capo_update_state(st0, R4) == adv.CAPOState(step=1)
    assert adv.capo_update_state(None) == adv.CAPOState(step=1)


def test_negative_sample_variants():
    close(adv.compute("grpo_n", R4), [[0, -0.866024, -0.866024, 0]])
    close(adv.compute("nsr", R4), [[0, -1, -1, 0]])
    close(adv.compute("w_reinforce", R4), [[0.1, -1, -1, 0.1]])
    close(adv.compute("nsr", T([[-1.0, 1.0]])), [[-1, 0]])  # {-1, 1} rewards read the same


def test_gdpo_and_gd2po_multi_reward():
    # useful [1,0,0,1], harmless [1,1,0,0] -> A^u = [.866,-.866,-.866,.866], A^h = [.866,.866,-.866,-.866]
    r = torch.stack([R4[0], T([1.0, 1, 0, 0])], dim=-1).unsqueeze(0)  # [1, 4, 2]
    # GDPO sum [1.732048, 0, -1.732048, 0]; whitened: mean 0, unbiased var 2 -> /sqrt(2)
    close(adv.compute("gdpo", r, whiten=False), [[1.732048, 0, -1.732048, 0]])
    close(adv.compute("gdpo", r), [[1.224745, 0, -1.224745, 0]])
    # GD2PO: rollouts 1 and 3 conflict -> keep [T,F,T,F], kappa .5 -> [.866024, 0, -.866024, 0]
    close(adv.compute("gd2po", r, whiten=False), [[0.866024, 0, -0.866024, 0]])
    # whitened over kept rollouts only: mean 0, unbiased var 1.5 -> .866/1.224745 = .707107
    close(adv.compute("gd2po", r), [[0.707107, 0, -0.707107, 0]])
    # SNR mode: |sum| / sum|.| = 0 < .2 for the conflicting rollouts -> still dropped
    close(adv.compute("gd2po", r, mode="snr", whiten=False), [[0.866024, 0, -0.866024, 0]])
    # with tau = 0 nothing counts as a conflict -> GDPO
    close(adv.compute("gd2po", r, mode="snr", tau=0.0, whiten=False), [[1.732048, 0, -1.732048, 0]])


def test_gdpo_token_weighted_whitening_matches_token_level():
    # whitening per sequence with token-count weights == verl's whitening of the broadcast tokens
    gen = torch.Generator().manual_seed(5)
    r = torch.rand(2, 3, 2, generator=gen)
    mask = torch.ones(2, 3, 4)
    mask[0, 0, 1:] = 0
    mask[1, 2, 3:] = 0
    out = adv.compute("gdpo", r, mask=mask)
    raw = adv.compute("gdpo", r, whiten=False).unsqueeze(-1).expand_as(mask)
    vals = raw[mask > 0]
    expected = (raw - vals.mean()) / torch.sqrt(vals.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(
        out.unsqueeze(-1).expand_as(mask)[mask > 0], expected[mask > 0], atol=1e-5, rtol=0
    )


def test_multi_reward_k1_is_whitened_grpo():
    gen = torch.Generator().manual_seed(6)
    r = torch.rand(3, 4, generator=gen)
    g = adv.compute("grpo", r)
    expected = (g - g.mean()) / torch.sqrt(g.var(unbiased=True) + 1e-8)
    torch.testing.assert_close(adv.compute("gdpo", r), expected, atol=1e-5, rtol=0)
