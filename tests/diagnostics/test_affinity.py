import math

import pytest
import torch

from posttrain.diagnostics import affinity, group_affinity


def test_on_policy_batch_has_affinity_one():
    logp = torch.randn(3, 5)
    s = affinity(logp, logp.clone(), torch.ones(3, 5), torch.randn(3))
    assert s == {"eur": pytest.approx(1.0), "uc": pytest.approx(0.0), "affinity": pytest.approx(1.0)}


def test_catalog_example():
    # eps = 0.2, rho = [1.0, 1.1, 1.3], |A| = 1: 1.3 is out of band -> EUR = 2/3
    # log rho in band = [0, 0.0953102]; mu = 0.0476551; UC = sqrt(mean (log rho - mu)^2) = 0.0476551
    # tau = log(1.2) / 2 = 0.0911608; Affinity = 2/3 exp(-0.0476551 / 0.0911608) = 0.395255
    logp = torch.log(torch.tensor([[1.0, 1.1, 1.3]]))
    s = affinity(logp, torch.zeros(1, 3), torch.ones(1, 3), torch.tensor([1.0]), eps=0.2)
    assert s["eur"] == pytest.approx(0.666667, abs=1e-6)
    assert s["uc"] == pytest.approx(0.047655, abs=1e-6)
    assert s["affinity"] == pytest.approx(0.395255, abs=1e-6)
    assert math.log1p(0.2) / 2 == pytest.approx(0.091161, abs=1e-6)


def test_advantage_weights_and_mask():
    # rho = [1.0, 1.3], |A| = [1, 3]: EUR = 1 / (1 + 3) = 0.25; one in-band token -> UC = 0
    logp = torch.log(torch.tensor([[1.0], [1.3]]))
    s = affinity(logp, torch.zeros(2, 1), torch.ones(2, 1), torch.tensor([1.0, -3.0]))
    assert s["eur"] == pytest.approx(0.25) and s["uc"] == 0.0 and s["affinity"] == pytest.approx(0.25)
    # the out-of-band token masked out -> on-policy again
    s = affinity(logp, torch.zeros(2, 1), torch.tensor([[1], [0]]), torch.tensor([1.0, -3.0]))
    assert s["affinity"] == pytest.approx(1.0)
    # no advantages: unit weights -> EUR = 1/2
    assert affinity(logp, torch.zeros(2, 1), torch.ones(2, 1))["eur"] == pytest.approx(0.5)


def test_zero_advantages_give_zero_as_in_reference_code():
    logp = torch.zeros(2, 3)
    s = affinity(logp, logp, torch.ones(2, 3), torch.zeros(2))
    assert s == {"eur": 0.0, "uc": 0.0, "affinity": 0.0}


def test_group_affinity_catalog_group_and_an_on_policy_group():
    # group 7: the catalog's ratios [1.0, 1.1, 1.3], |A| = 1 -> Affinity 0.395255 on each of its rows;
    # group 2: on-policy (ratio 1) -> 1; group 5: all advantages 0 -> weights sum 0 -> 0
    logp = torch.log(torch.tensor([[1.0, 1.1, 1.3], [1.0, 1.0, 1.0], [1.2, 0.5, 1.0]]))
    old = torch.zeros(3, 3)
    out = group_affinity(logp, old, torch.ones(3, 3), torch.tensor([7, 2, 5]), torch.tensor([1.0, -1.0, 0.0]))
    assert out.tolist() == pytest.approx([0.395255, 1.0, 0.0], abs=1e-6)


def test_group_affinity_equals_affinity_on_each_groups_rows():
    g = torch.Generator().manual_seed(0)
    logp = 0.1 * torch.randn(9, 6, generator=g)
    old = logp + 0.15 * torch.randn(9, 6, generator=g)
    mask = (torch.rand(9, 6, generator=g) > 0.25).float()
    adv = torch.randn(9, generator=g)
    ids = torch.tensor([4, 4, 0, 0, 0, 9, 9, 9, 9])
    out = group_affinity(logp, old, mask, ids, adv, eps=0.2)
    for k in ids.unique().tolist():
        rows = ids == k
        want = affinity(logp[rows], old[rows], mask[rows], adv[rows], eps=0.2)["affinity"]
        assert out[rows].tolist() == pytest.approx([want] * int(rows.sum()), abs=1e-6)
