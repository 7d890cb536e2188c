import math

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
