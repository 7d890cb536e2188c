"""f-GRPO (provisional, arXiv:2602.05946; seed 004:179): the "fdiv_grpo" policy loss, by hand, and what sets it
apart from REINFORCE on the same advantages."""

import math

import pytest
import torch

from posttrain.algorithms import aggregation, losses


def _loss_and_grad(logp, adv, ref, old=None, **kw):
    logp = logp.clone().requires_grad_(True)
    mask = torch.ones_like(logp)
    out = losses.compute("fdiv_grpo", logp, logp.detach() if old is None else old, adv, mask, ref_logprobs=ref, **kw)
    (g,) = torch.autograd.grad(out.sum(), logp)
    return out.detach(), g


# two rows (A = +2, A = -1), each with tokens whose log pi_theta - log pi_ref = [+1, -2]; beta = 0.5 -> r = [0.5, -1]
LOGP = torch.tensor([[0.0, -3.0], [0.0, -3.0]])
REF = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
ADV = torch.tensor([2.0, -1.0])


def test_pearson_chi2_by_hand():
    # positive row: |A| (-r) = 2 x [-0.5, 1.0] = [-1.0, 2.0]
    # negative row: |A| (r + r^2 / 4) = 1 x [0.5 + 0.0625, -1 + 0.25] = [0.5625, -0.75]
    out, g = _loss_and_grad(LOGP, ADV, REF, beta=0.5)
    torch.testing.assert_close(out, torch.tensor([[-1.0, 2.0], [0.5625, -0.75]]))
    # d/dlog pi: positive row -|A| beta = -1.0 on both tokens; negative row |A| beta (1 + r / 2) = 0.5 x [1.25, 0.5]
    torch.testing.assert_close(g, torch.tensor([[-1.0, -1.0], [0.625, 0.25]]))
    # the declared aggregation divides the sum by the token count: (-1 + 2 + 0.5625 - 0.75) / 4 = 0.203125
    assert losses.REGISTRY.traits("fdiv_grpo").aggregation == "token_mean"
    assert aggregation.reduce("token_mean", out, torch.ones(2, 2)).item() == pytest.approx(0.203125)


def test_hellinger_by_hand():
    # positive row: |A| (e^(-r) - 1) = 2 x [e^-0.5 - 1, e^1 - 1] = 2 x [-0.393469, 1.718282] = [-0.786939, 3.436564]
    # negative row: |A| f*(g(r)), g = 1 - e^(-r), f*(s) = s / (1 - s): r = 0.5 -> s = 0.393469, 0.393469 / 0.606531
    #   = 0.648721 (= e^0.5 - 1); r = -1 -> s = 1 - e = -1.718282, -1.718282 / 2.718282 = -0.632121 (= e^-1 - 1)
    out, g = _loss_and_grad(LOGP, ADV, REF, beta=0.5, divergence="hellinger")
    torch.testing.assert_close(out, torch.tensor([[-0.786939, 3.436564], [0.648721, -0.632121]]), atol=1e-6, rtol=0)
    # d/dlog pi: positive -|A| beta e^(-r) = -[0.606531, 2.718282]; negative |A| beta e^r = 0.5 x [1.648721, 0.367879]
    torch.testing.assert_close(g, torch.tensor([[-0.606531, -2.718282], [0.824361, 0.183940]]), atol=1e-6, rtol=0)


def test_gamma_adds_the_log_ratio_to_the_old_policy_to_the_implicit_reward():
    # the released trainer's gamma (log pi_theta - log pi_old), reported by a review: log pi_theta - log pi_old = 1
    # on every token, gamma = 0.3 -> r = 0.5 x [1, -2] + 0.3 = [0.8, -0.7]; chi^2 positive row 2 x [-0.8, 0.7]
    old = LOGP - 1.0
    out, _ = _loss_and_grad(LOGP, ADV, REF, old=old, beta=0.5, gamma=0.3)
    torch.testing.assert_close(out[0], torch.tensor([-1.6, 1.4]))
    # negative row: r + r^2 / 4 = [0.8 + 0.16, -0.7 + 0.1225] = [0.96, -0.5775]
    torch.testing.assert_close(out[1], torch.tensor([0.96, -0.5775]))
    # gamma = 0 (the default) ignores pi_old altogether
    torch.testing.assert_close(_loss_and_grad(LOGP, ADV, REF, old=old, beta=0.5)[0],
                               _loss_and_grad(LOGP, ADV, REF, beta=0.5)[0])


@pytest.mark.parametrize("divergence", ["pearson", "hellinger"])
def test_at_the_reference_the_gradient_is_beta_times_the_policy_gradient(divergence):
    # r = 0: chi^2 d(-r) = -beta, d(r + r^2/4) = beta (1 + 0); Hellinger -beta e^0, beta e^0: -beta A either way
    logp = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.1, 0.3], [0.25, 0.25, 0.5]]))
    adv = torch.tensor([1.5, -0.7, 0.0])
    out, g = _loss_and_grad(logp, adv, logp.clone(), beta=0.1, divergence=divergence)
    assert out.abs().max() == 0  # -g(0) = f*(g(0)) = 0
    torch.testing.assert_close(g, -0.1 * adv[:, None].expand_as(logp))


def test_chi2_pushes_a_negative_row_harder_the_more_the_policy_over_weights_it():
    # what sets it apart: REINFORCE's gradient on a negative row is |A| whatever pi_theta does; chi^2's is
    # |A| beta (1 + r / 2), growing with r = beta log(pi_theta / pi_ref): log ratio 0, 5, 10 with beta = 0.2
    # -> r = 0, 1, 2 -> 0.2 x [1, 1.5, 2] = [0.2, 0.3, 0.4]
    ref = torch.full((1, 3), -12.0)
    logp = torch.tensor([[-12.0, -7.0, -2.0]])
    _, g = _loss_and_grad(logp, torch.tensor([-1.0]), ref, beta=0.2)
    torch.testing.assert_close(g, torch.tensor([[0.2, 0.3, 0.4]]))
    logp_r = logp.clone().requires_grad_(True)
    (g_r,) = torch.autograd.grad(losses.compute("reinforce", logp_r, logp, torch.tensor([-1.0]),
                                                torch.ones(1, 3)).sum(), logp_r)
    torch.testing.assert_close(g_r, torch.ones(1, 3))  # constant
    assert g[0, 2] / g[0, 0] == pytest.approx(2.0)


def test_hellinger_bounds_the_positive_term_where_chi2_does_not():
    # positive rows: Hellinger's |A| (e^(-r) - 1) > -|A| for every r (its pull up vanishes as e^(-r)), chi^2's -|A| r
    # falls without bound: at log ratio 10, beta = 0.5, r = 5: Hellinger 2 (e^-5 - 1) = -1.986524, chi^2 -10
    logp, ref = torch.tensor([[-1.0]]), torch.tensor([[-11.0]])
    out_h, g_h = _loss_and_grad(logp, torch.tensor([2.0]), ref, beta=0.5, divergence="hellinger")
    out_p, _ = _loss_and_grad(logp, torch.tensor([2.0]), ref, beta=0.5)
    assert out_h.item() == pytest.approx(2 * (math.exp(-5) - 1), abs=1e-6) and out_h.item() > -2.0
    assert out_p.item() == pytest.approx(-10.0)
    assert g_h.item() == pytest.approx(-2 * 0.5 * math.exp(-5), abs=1e-7)  # -|A| beta e^(-r) = -0.006738


@pytest.mark.parametrize(("kw", "message"), [({"divergence": "kl"}, "divergence"), ({"beta": 0.0}, "beta")])
def test_bad_parameters_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        losses.compute("fdiv_grpo", LOGP, LOGP, ADV, torch.ones(2, 2), ref_logprobs=REF, **kw)


def test_the_reference_is_a_required_input():
    assert losses.inputs("fdiv_grpo") == ["ref_logprobs"]
    with pytest.raises(TypeError, match="ref_logprobs"):
        losses.compute("fdiv_grpo", LOGP, LOGP, ADV, torch.ones(2, 2))
