"""Preference losses: catalog numbers (B12, L131, L203, L205), gradients, inputs."""

import math

import pytest
import torch

from posttrain.algorithms import preference


def _t(*xs):
    return torch.tensor(xs, dtype=torch.float64)


def _loss(name, cw, cl, rw=0.0, rl=0.0, **params):
    return preference.compute(name, _t(cw), _t(cl), _t(rw), _t(rl), **params).item()


def test_names():
    assert preference.names() == [
        "aot", "aot_unpaired", "apo_down", "apo_zero", "bco_pair", "cpl", "discopop", "dpo", "exo_pair", "hinge",
        "inpo", "ipo", "nca_pair", "ra_dpo", "robust", "sppo_hard",
    ]  # the TRL loss types (preference_trl.py) are tested in test_preference_trl.py


def test_dpo_catalog_b12():
    # beta 0.1, chosen log-ratio +1, rejected -1: -log sigmoid(0.1 * 2) = 0.598139
    assert _loss("dpo", 1.0, -1.0) == pytest.approx(0.598139, abs=1e-6)
    # the reference shifts the margin: logpi = (0, 0), ref = (-1, 1) gives the same h = 2
    assert _loss("dpo", 0.0, 0.0, -1.0, 1.0) == pytest.approx(0.598139, abs=1e-6)


def test_dpo_gradient_and_reference_detached():
    cw, cl = _t(1.0).requires_grad_(True), _t(-1.0).requires_grad_(True)
    rw = _t(0.0).requires_grad_(True)
    preference.compute("dpo", cw, cl, rw, _t(0.0)).sum().backward()
    # dL/dlogpi_w = -beta sigmoid(-beta h) = -0.1 * sigmoid(-0.2) = -0.045017
    assert cw.grad.item() == pytest.approx(-0.1 / (1 + math.exp(0.2)), abs=1e-6)
    assert cl.grad.item() == pytest.approx(0.1 / (1 + math.exp(0.2)), abs=1e-6)
    assert rw.grad is None


def test_ipo():
    # h = 2, beta = 0.1: (2 - 1/0.2)^2 = (2 - 5)^2 = 9
    assert _loss("ipo", 1.0, -1.0) == pytest.approx(9.0)
    # minimum at h = 1/(2 beta) = 5
    assert _loss("ipo", 2.5, -2.5) == pytest.approx(0.0)


def test_cpl_catalog_l131():
    # alpha 0.1, S_w = -10, S_l = -12; lambda 0.5: logit = -1 - 0.5 * (-1.2) = -0.4 -> softplus(0.4) = 0.9130
    assert _loss("cpl", -10.0, -12.0) == pytest.approx(0.9130, abs=1e-4)
    # lambda 1: logit = -1 + 1.2 = 0.2 -> softplus(-0.2) = 0.5981
    assert _loss("cpl", -10.0, -12.0, contrastive_bias=1.0) == pytest.approx(0.5981, abs=1e-4)
    # reference-free: the reference log-probs do not matter
    assert _loss("cpl", -10.0, -12.0, 5.0, -7.0) == pytest.approx(0.9130, abs=1e-4)


def test_inpo_catalog_l203():
    # eta 1, tau 0.1: h = 1.0 - 0.1 * 0 - 0.9 * 0.6 = 0.46; (0.46 - 0.5)^2 = 0.0016
    out = _loss("inpo", 1.0, 0.0, 0.0, 0.0, prev_chosen_logps=_t(0.6), prev_rejected_logps=_t(0.0))
    assert out == pytest.approx(0.0016, abs=1e-9)
    with pytest.raises(TypeError, match=r"\['prev_chosen_logps', 'prev_rejected_logps'\]"):
        _loss("inpo", 1.0, 0.0)
    assert preference.inputs("inpo") == ["prev_chosen_logps", "prev_rejected_logps"]


def test_inpo_gradient_reduces_to_ipo_and_prev_detached():
    # catalog L203 example: h = 0.46, dL/dlogpi_w = 2 (h - eta/2) = 2 (0.46 - 0.5) = -0.08, dL/dlogpi_l = +0.08
    cw, cl = _t(1.0).requires_grad_(True), _t(0.0).requires_grad_(True)
    pw = _t(0.6).requires_grad_(True)
    prev = dict(prev_chosen_logps=pw, prev_rejected_logps=_t(0.0))
    preference.compute("inpo", cw, cl, _t(0.0), _t(0.0), **prev).sum().backward()
    assert cw.grad.item() == pytest.approx(-0.08) and cl.grad.item() == pytest.approx(0.08)
    assert pw.grad is None  # the previous iterate is frozen
    # pi_t = pi_ref: d_theta = 1, d_ref = d_t = 0.2: h = 1 - 0.1 * 0.2 - 0.9 * 0.2 = 0.8; (0.8 - 0.5)^2 = 0.09,
    # which is IPO with beta = 1/eta = 1: (0.8 - 1/2)^2
    prev = dict(prev_chosen_logps=_t(0.2), prev_rejected_logps=_t(0.0))
    assert _loss("inpo", 1.0, 0.0, 0.2, 0.0, **prev) == pytest.approx(0.09)
    assert _loss("ipo", 1.0, 0.0, 0.2, 0.0, beta=1.0) == pytest.approx(0.09)


def test_ra_dpo_risk_gradients():
    # Ra-DPO1, catalog numbers: z = 2.8, dL/dz = -beta sigmoid(-beta z) = -0.1 * sigmoid(-0.28) = -0.1 * 0.430453;
    # z = h - (R_l - R_w), so dL/dR_w = -0.0430453 and dL/dR_l = +0.0430453
    rw, rl = _t(0.3).requires_grad_(True), _t(0.5).requires_grad_(True)
    preference.compute("ra_dpo", _t(2.0), _t(-1.0), _t(0.0), _t(0.0), chosen_risk=rw, rejected_risk=rl).sum().backward()
    assert rw.grad.item() == pytest.approx(-0.0430453, abs=1e-6)
    assert rl.grad.item() == pytest.approx(0.0430453, abs=1e-6)
    # Ra-DPO2: z = 2.9, R_w is stop-gradient; dL/dR_l = alpha beta sigmoid(-0.29) = 0.5 * 0.1 * 0.427998 = 0.0213999
    rw, rl = _t(0.3).requires_grad_(True), _t(0.5).requires_grad_(True)
    preference.compute("ra_dpo", _t(2.0), _t(-1.0), _t(0.0), _t(0.0), chosen_risk=rw, rejected_risk=rl,
                       variant=2).sum().backward()
    assert rw.grad is None and rl.grad.item() == pytest.approx(0.0213999, abs=1e-6)


def test_ra_dpo_catalog_l205():
    # m_w = 2, m_l = -1, R_w = 0.3, R_l = 0.5: logits = 3 - (0.5 - 0.3) = 2.8 -> -log sigmoid(0.28) = 0.5629
    risk = dict(chosen_risk=_t(0.3), rejected_risk=_t(0.5))
    assert _loss("ra_dpo", 2.0, -1.0, **risk) == pytest.approx(0.5629, abs=1e-4)
    # Ra-DPO2: logits = 3 - 0.5 (0.5 - 0.3) = 2.9 -> softplus(-0.29) = 0.5583
    assert _loss("ra_dpo", 2.0, -1.0, variant=2, **risk) == pytest.approx(math.log1p(math.exp(-0.29)))
    # zero risk is plain DPO
    zero = dict(chosen_risk=_t(0.0), rejected_risk=_t(0.0))
    assert _loss("ra_dpo", 1.0, -1.0, **zero) == pytest.approx(_loss("dpo", 1.0, -1.0))
    with pytest.raises(TypeError, match="chosen_risk"):
        _loss("ra_dpo", 2.0, -1.0)


def test_token_risk_catalog_l205():
    # p_ref = [.5, .3, .15, .05], pi = [.4, .4, .1, .1]: D = [0.2231, -0.2877, 0.4055, -0.6931]
    # VaR = quantile_0.05(D) = -0.6931 + 0.15 * 0.4054 = -0.6323 -> tail mask [T, T, T, F]
    # R_t = .5 * .2231 + .3 * (-.2877) + .15 * .4055 = 0.0861
    ref = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]]))
    pol = torch.log(torch.tensor([[[0.4, 0.4, 0.1, 0.1]]]))
    assert preference.token_risk(pol, ref, torch.ones(1, 1)).item() == pytest.approx(0.0861, abs=1e-4)
    # a masked position adds nothing; R sums over valid positions
    two = preference.token_risk(pol.expand(1, 2, 4), ref.expand(1, 2, 4), torch.tensor([[1.0, 0.0]]))
    assert two.item() == pytest.approx(0.0861, abs=1e-4)
    # the gradient reaches the policy only: dR/dlogpi(v) = -p_ref(v) 1[tail] = [-.5, -.3, -.15, 0]
    pol_g = pol.clone().requires_grad_(True)
    ref_g = ref.clone().requires_grad_(True)
    preference.token_risk(pol_g, ref_g, torch.ones(1, 1)).sum().backward()
    assert pol_g.grad[0, 0].tolist() == pytest.approx([-0.5, -0.3, -0.15, 0.0], abs=1e-6)
    assert ref_g.grad is None
    # policy = reference: D = 0 everywhere, nothing lies above VaR = 0, so R = 0 (Ra-DPO starts as DPO)
    assert preference.token_risk(ref, ref, torch.ones(1, 1)).item() == 0.0


@pytest.mark.parametrize("name", preference.names())
def test_every_loss_finite_with_gradient(name):
    g = torch.Generator().manual_seed(0)
    b = 5
    cw = (-torch.rand(b, generator=g) * 20).requires_grad_(True)
    cl = (-torch.rand(b, generator=g) * 20).requires_grad_(True)
    extra = {
        "prev_chosen_logps": -torch.rand(b, generator=g) * 20,
        "prev_rejected_logps": -torch.rand(b, generator=g) * 20,
        "chosen_risk": torch.rand(b, generator=g),
        "rejected_risk": torch.rand(b, generator=g),
    }
    ref = -torch.rand(2, b, generator=g) * 20
    out = preference.compute(name, cw, cl, ref[0], ref[1], **{k: extra[k] for k in preference.inputs(name)})
    assert out.shape == (b,) and torch.isfinite(out).all()
    out.sum().backward()
    assert torch.isfinite(cw.grad).all() and torch.isfinite(cl.grad).all()
    # raising the chosen log-prob never increases the loss, except for the losses with a finite target
    # (ipo, inpo, sppo_hard, exo_pair), apo_down (lowers the chosen by design) and discopop (non-monotone near h = 0)
    assert torch.all(cw.grad <= 1e-12) or name in ("ipo", "inpo", "sppo_hard", "exo_pair", "apo_down", "discopop")


def test_unknown_parameter():
    with pytest.raises(TypeError, match="unknown parameter"):
        _loss("dpo", 1.0, -1.0, tau=1.0)


def test_every_entry_is_documented():
    for name in preference.names():
        doc = " ".join(preference.REGISTRY.doc(name).split())
        assert ("arXiv" in doc or "papers/" in doc) and "Nearest neighbour" in doc, name
