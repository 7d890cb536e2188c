import math

import pytest
import torch

from posttrain.algorithms.value import clipped_value_loss, explained_variance


def test_clipped_value_loss_hand_numbers():
    # token 0: V=1.0, V_old=0.0, R=2.0, c=0.5 -> V_clip = 0 + clamp(1, -.5, .5) = 0.5
    #   unclipped (1-2)^2 = 1, clipped (0.5-2)^2 = 2.25 -> max 2.25, the clipped branch
    # token 1: V=0.2, V_old=0.0, R=0.3 -> inside the band: V_clip = V, both 0.01, not clipped
    # token 2: V=-3.0, V_old=-1.0, R=-3.0 -> V_clip = -1.5: unclipped 0, clipped 2.25 -> 2.25
    # token 3: masked out
    v = torch.tensor([[1.0, 0.2, -3.0, 9.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.0, -1.0, 0.0]])
    ret = torch.tensor([[2.0, 0.3, -3.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, clipped = clipped_value_loss(v, old, ret, mask, cliprange=0.5)
    torch.testing.assert_close(loss, torch.tensor([[2.25, 0.01, 2.25, 0.0]]))
    assert clipped.tolist() == [[1.0, 0.0, 1.0, 0.0]]
    loss.sum().backward()
    # the clipped branch has no gradient wrt V (V_clip is at the band's edge); token 1: 2 (V - R) = -0.2
    torch.testing.assert_close(v.grad, torch.tensor([[0.0, -0.2, 0.0, 0.0]]))


def test_clipped_value_loss_at_the_rollout_values_is_plain_mse():
    v = torch.tensor([[0.5, -1.0]])
    ret = torch.tensor([[1.5, 1.0]])
    loss, clipped = clipped_value_loss(v, v.clone(), ret, torch.ones(1, 2), cliprange=0.1)
    torch.testing.assert_close(loss, (v - ret) ** 2)
    assert clipped.sum() == 0


def test_explained_variance_cases():
    ret = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the 100 is masked out
    assert explained_variance(ret.clone(), ret, mask) == 1.0  # perfect critic
    assert explained_variance(torch.full_like(ret, 2.0), ret, mask) == 0.0  # the mean return
    # V = 0: Var[R - 0] = Var[R] -> 0 as well; V = -R: Var[2R] = 4 Var[R] -> 1 - 4 = -3
    assert explained_variance(torch.zeros_like(ret), ret, mask) == 0.0
    assert math.isclose(explained_variance(-ret, ret, mask), -3.0)
    assert math.isnan(explained_variance(ret, torch.ones_like(ret), mask))  # constant returns
    assert math.isnan(explained_variance(ret, ret, torch.zeros_like(mask)))


def test_hl_gauss_target_hand_numbers():
    # catalog L187: edges [0, 0.2, ..., 1.0], y = 0.3, sigma = 0.15 (0.75 bin widths):
    # p_i = Phi((z_{i+1} - 0.3) / 0.15) - Phi((z_i - 0.3) / 0.15): Phi(-1/3) - Phi(-2) = 0.3694 - 0.0228 = 0.3467 for
    # bin 0 before renormalizing over the support (total Phi(14/3) - Phi(-2) = 0.9772): 0.3467 / 0.9772 = ...
    # the catalog's renormalized values: [0.2351, 0.5065, 0.2351, 0.0228, 0.0004], mean over the centres 0.3094
    from posttrain.algorithms.value import hl_gauss_target

    edges = torch.tensor([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    p = hl_gauss_target(torch.tensor(0.3), edges, 0.15)
    torch.testing.assert_close(p, torch.tensor([0.2351, 0.5065, 0.2351, 0.0228, 0.0004]), atol=1e-4, rtol=0)
    centres = (edges[1:] + edges[:-1]) / 2
    assert float((p * centres).sum()) == pytest.approx(0.3094, abs=1e-4)
    far = hl_gauss_target(torch.tensor([5.0, -5.0]), edges, 0.15)  # outside the support: the nearest bins, no NaN
    assert torch.isfinite(far).all() and far[0].argmax() == 4 and far[1].argmax() == 0


def test_hl_gauss_head_reads_v_off_the_bins_and_fits_by_cross_entropy():
    from posttrain.algorithms.value import head

    h = head("hl_gauss", bins=5, low=0.0, high=1.0)
    assert h.outputs == 5
    zero = torch.zeros(1, 2, 5)  # a head that starts at zero: the uniform histogram, V = the support's centre
    torch.testing.assert_close(h.value(zero), torch.full((1, 2), 0.5))
    # the loss is the cross-entropy to the target histogram: at logits = log(target) it is the target's entropy,
    # its minimum, and V there is the target's mean (0.3094 for y = 0.3, as above)
    from posttrain.algorithms.value import hl_gauss_target

    target = hl_gauss_target(torch.tensor([[0.3]]), torch.linspace(0, 1, 6), 0.15)
    best = target.log().clamp(min=-30)
    ret, mask = torch.tensor([[0.3]]), torch.ones(1, 1)
    loss, clipped = h.loss(best, ret, ret, mask, cliprange=0.5)
    entropy = float(-(target * target.log()).sum())
    assert float(loss) == pytest.approx(entropy, abs=1e-4) and clipped.sum() == 0
    assert float(h.value(best)) == pytest.approx(0.3094, abs=1e-4)
    worse, _ = h.loss(zero[:, :1], ret, ret, mask, cliprange=0.5)
    assert float(worse) > float(loss)
    # what distinguishes it from the squared error: the gradient of one outlying return is bounded (a
    # cross-entropy's gradient in the logits is softmax - target, at most 1 per bin) where the regression's grows
    out = torch.zeros(1, 1, 5, requires_grad=True)
    h.loss(out, ret, torch.tensor([[100.0]]), mask, cliprange=1e9)[0].sum().backward()
    assert out.grad.abs().max() <= 1.0
    v = torch.zeros(1, 1, requires_grad=True)
    clipped_value_loss(v, v.detach(), torch.tensor([[100.0]]), mask, cliprange=1e9)[0].sum().backward()
    assert v.grad.abs().max() == pytest.approx(200.0)  # 2 (V - R)


def test_value_heads_refuse_a_bad_support():
    from posttrain.algorithms.value import head

    with pytest.raises(ValueError, match="bins >= 2"):
        head("hl_gauss", bins=1)
    with pytest.raises(ValueError, match="high > low"):
        head("hl_gauss", low=1.0, high=0.0)
    assert head("scalar").outputs == 1
