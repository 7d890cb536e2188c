"""KL estimators: catalog B11 numbers, gradients, k3_plus straight-through."""

import math

import pytest
import torch

from posttrain.algorithms import kl

# catalog B11: pi = 0.5, pi_ref = 0.4
LOGP, REF = math.log(0.5), math.log(0.4)


def _value_grad(name, logp=LOGP, ref=REF):
    x = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
    out = kl.estimate(name, x, torch.tensor([[ref]], dtype=torch.float64))
    out.sum().backward()
    return out.item(), x.grad.item()


def test_names():
    assert kl.names() == ["abs", "k1", "k2", "k3", "k3_plus"]


def test_catalog_b11_values():
    # k1 = log(0.5/0.4) = 0.223144; k2 = 0.223144^2 / 2 = 0.024897; k3 = 0.8 - log 0.8 - 1 = 0.023144
    assert _value_grad("k1")[0] == pytest.approx(0.223144, abs=1e-6)
    assert _value_grad("k2")[0] == pytest.approx(0.024897, abs=1e-6)
    assert _value_grad("k3")[0] == pytest.approx(0.023144, abs=1e-6)
    assert _value_grad("abs")[0] == pytest.approx(0.223144, abs=1e-6)
    # abs flips the sign of a negative log-ratio; k1 does not
    assert _value_grad("abs", REF, LOGP)[0] == pytest.approx(0.223144, abs=1e-6)
    assert _value_grad("k1", REF, LOGP)[0] == pytest.approx(-0.223144, abs=1e-6)


def test_gradients():
    # d k1 / d logpi = 1; d k2 = logpi - logpi_ref = 0.223144; d k3 = 1 - pi_ref/pi = 0.2
    assert _value_grad("k1")[1] == pytest.approx(1.0)
    assert _value_grad("k2")[1] == pytest.approx(0.223144, abs=1e-6)
    assert _value_grad("k3")[1] == pytest.approx(0.2)


def test_k3_plus_is_k3_value_with_k2_gradient():
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(3, 4, generator=g) * 2).requires_grad_(True)
    ref = logp.detach() + 0.3 * torch.randn(3, 4, generator=g)
    plus = kl.estimate("k3_plus", logp, ref)
    assert torch.allclose(plus, kl.estimate("k3", logp, ref))
    grad_plus = torch.autograd.grad(plus.sum(), logp)[0]
    grad_k2 = torch.autograd.grad(kl.estimate("k2", logp, ref).sum(), logp)[0]
    assert torch.allclose(grad_plus, grad_k2)
    # catalog numbers: value 0.023144, gradient 0.223144 (k3's own would be 0.2)
    assert _value_grad("k3_plus") == pytest.approx((0.023144, 0.223144), abs=1e-6)


@pytest.mark.parametrize("name", kl.names())
def test_zero_at_reference_and_ref_gets_no_gradient(name):
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    out = kl.estimate(name, logp, ref)
    assert torch.allclose(out, torch.zeros_like(out))
    (out.sum() + logp.sum()).backward()
    assert ref.grad is None


def test_k3_is_clamped_and_finite():
    out = kl.estimate("k3", torch.tensor([[-100.0]]), torch.tensor([[0.0]]))
    assert out.item() == 10.0


def test_adaptive_kl_coef_by_hand():
    from posttrain.algorithms.kl import adaptive_kl_coef

    # KL 0.3 vs target 0.1: e = 0.3 / 0.1 - 1 = 2, clipped to 0.2; 256 responses / horizon 10000
    # -> 0.1 * (1 + 0.2 * 0.0256) = 0.1005120
    assert adaptive_kl_coef(0.1, 0.3, 256, target=0.1) == pytest.approx(0.100512)
    # KL 0.11: e = 0.1 -> 0.1 * (1 + 0.1 * 0.0256) = 0.100256; KL 0.05: e = -0.5 -> -0.2 -> 0.099488
    assert adaptive_kl_coef(0.1, 0.11, 256, target=0.1) == pytest.approx(0.100256)
    assert adaptive_kl_coef(0.1, 0.05, 256, target=0.1) == pytest.approx(0.099488)
    assert adaptive_kl_coef(0.1, 0.1, 256, target=0.1) == pytest.approx(0.1)  # on target: unchanged
    assert adaptive_kl_coef(0.1, float("nan"), 256, target=0.1) == 0.1
