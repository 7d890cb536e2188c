import math

import pytest
import torch

from posttrain.diagnostics import kl_to_reference, ratio_stats


def test_clip_fractions_hand_example():
    ratios = torch.tensor([[1.0, 1.3, 0.7], [0.7, 1.3, 0.5]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([1.0, -1.0])  # per sequence
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the 0.5 is padding
    s = ratio_stats(ratios.log(), old, adv, mask, eps_low=0.2, eps_high=0.2)
    # row 0 (A > 0): 1.3 > 1.2 is clipped high; 0.7 < 0.8 with A > 0 is not clipped
    # row 1 (A < 0): 0.7 < 0.8 is clipped low; 1.3 with A < 0 is not clipped
    assert s["clip_frac_high"] == pytest.approx(1 / 5)
    assert s["clip_frac_low"] == pytest.approx(1 / 5)
    assert s["clip_frac"] == pytest.approx(2 / 5)
    # ratio mean (1 + 1.3 + 0.7 + 0.7 + 1.3) / 5 = 1.0; max 1.3, min 0.7 (0.5 is masked)
    assert (s["ratio_mean"], s["ratio_max"], s["ratio_min"]) == (
        pytest.approx(1.0),
        pytest.approx(1.3),
        pytest.approx(0.7),
    )
    # k3(old -> new) = r - 1 - log r: 0 at 1; 0.3 - log 1.3 = 0.037636; -0.3 - log 0.7 = 0.056675
    k3 = lambda r: r - 1 - math.log(r)  # noqa: E731
    assert s["approx_kl"] == pytest.approx((2 * k3(1.3) + 2 * k3(0.7)) / 5, rel=1e-5)


def test_clip_frac_equals_verl_pg_clipfrac():
    g = torch.Generator().manual_seed(0)
    logp, old = torch.randn(4, 9, generator=g) * 0.3, torch.randn(4, 9, generator=g) * 0.3
    adv = torch.randn(4, 9, generator=g)
    mask = torch.rand(4, 9, generator=g) > 0.2
    ratio = torch.exp(logp - old)
    # verl: pg_clipfrac = masked_mean(pg_losses2 > pg_losses1)
    l1, l2 = -adv * ratio, -adv * ratio.clamp(1 - 0.2, 1 + 0.28)
    verl = ((l2 > l1) & mask).sum() / mask.sum()
    s = ratio_stats(logp, old, adv, mask, eps_low=0.2, eps_high=0.28)
    assert s["clip_frac"] == pytest.approx(float(verl), abs=1e-6)


def test_on_policy_batch():
    logp = torch.randn(2, 4)
    s = ratio_stats(logp, logp.clone(), torch.tensor([1.0, -1.0]), torch.ones(2, 4))
    assert s["ratio_mean"] == pytest.approx(1.0) and s["clip_frac"] == 0.0 and s["approx_kl"] == 0.0


def test_kl_to_reference_catalog_values():
    # catalog B11: pi = 0.5, pi_ref = 0.4 -> k1 = log(1.25) = 0.223144, k3 = 0.8 - 1 - log 0.8 = 0.023144
    logp = torch.full((2, 3), math.log(0.5))
    ref = torch.full((2, 3), math.log(0.4))
    ref[1, 2] = 0.0  # a masked position that would change the means
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    s = kl_to_reference(logp, ref, mask)
    assert s["kl_k1"] == pytest.approx(0.223144, abs=1e-6)
    assert s["kl_k3"] == pytest.approx(0.023144, abs=1e-6)
