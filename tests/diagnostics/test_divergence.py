import math

import pytest
import torch

from posttrain.diagnostics import divergence_stats, token_divergence

NINF = float("-inf")


def test_identical_policies_have_zero_divergence():
    logits = torch.randn(2, 3, 10)
    torch.testing.assert_close(token_divergence(logits, logits.clone()), torch.zeros(2, 3), atol=1e-6, rtol=0)
    torch.testing.assert_close(token_divergence(logits, logits + 4.0, kind="kl"), torch.zeros(2, 3), atol=1e-6, rtol=0)


def test_hand_computed_values():
    # pi = [0.5, 0.5], pi_0 = [1, 0]; M = [0.75, 0.25]
    # KL(pi || M) = 0.5 log(0.5/0.75) + 0.5 log(0.5/0.25) = 0.143841
    # KL(pi_0 || M) = log(1/0.75) = 0.287682;  JS = (0.143841 + 0.287682) / 2 = 0.215762
    pi = torch.tensor([[[0.0, 0.0]]])
    pi0 = torch.tensor([[[0.0, NINF]]])
    assert float(token_divergence(pi, pi0)) == pytest.approx(0.215762, abs=1e-6)
    # KL(pi_0 || pi) = 1 log(1 / 0.5) = log 2 (and KL(pi || pi_0) = inf)
    assert float(token_divergence(pi0, pi, kind="kl")) == pytest.approx(math.log(2), abs=1e-6)
    assert math.isinf(float(token_divergence(pi, pi0, kind="kl")))
    # disjoint supports: JS reaches its maximum log 2
    assert float(token_divergence(torch.tensor([[[0.0, NINF]]]), torch.tensor([[[NINF, 0.0]]]))) == pytest.approx(
        math.log(2), abs=1e-6
    )


def test_matches_float64_reference_and_chunking():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 9, generator=g), torch.randn(3, 4, 9, generator=g)
    p, q = torch.softmax(a.double(), -1), torch.softmax(b.double(), -1)
    m = (p + q) / 2
    js = 0.5 * (p * (p / m).log()).sum(-1) + 0.5 * (q * (q / m).log()).sum(-1)
    kl = (p * (p / q).log()).sum(-1)
    torch.testing.assert_close(token_divergence(a, b, chunk_tokens=5).double(), js, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(token_divergence(a, b, kind="kl").double(), kl, atol=1e-6, rtol=1e-5)


def test_stats_fraction_above_threshold():
    same = torch.zeros(1, 4, 2)
    base = same.clone()
    base[0, 1] = torch.tensor([0.0, NINF])  # JS = 0.215762 at position 1
    base[0, 3] = torch.tensor([0.0, NINF])  # position 3 is padding
    mask = torch.tensor([[1, 1, 1, 0]])
    s = divergence_stats(same, base, mask, threshold=0.1)
    assert s["divergence_frac_above"] == pytest.approx(1 / 3)
    assert s["divergence_mean"] == pytest.approx(0.215762 / 3, abs=1e-6)
    assert s["divergence_max"] == pytest.approx(0.215762, abs=1e-6)


def test_errors():
    with pytest.raises(ValueError):
        token_divergence(torch.zeros(1, 2, 3), torch.zeros(1, 2, 4))
    with pytest.raises(ValueError):
        token_divergence(torch.zeros(1, 2, 3), torch.zeros(1, 2, 3), kind="tv")
