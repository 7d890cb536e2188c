"""A-LoL (arXiv:2305.14718; catalog 3.16): the "a_lol" policy loss, by hand."""

import math

import pytest
import torch

from posttrain.algorithms import aggregation, losses


def _loss_and_grad(name, logp, old, adv, mask, **kw):
    logp = logp.clone().requires_grad_(True)
    out = losses.compute(name, logp, old, adv, mask, **kw)
    (g,) = torch.autograd.grad(out.sum(), logp)
    return out.detach(), g


def test_catalog_case_w_a_plus_and_the_response_loss():
    # catalog 3.16: R = 0.8, V = 0.5 -> A+ = 0.3; log pi_theta - log pi_ref over the response = (-1.5 + 1.0) +
    # (-0.5 - 0.0) = -1 -> w = exp(-1) = 0.367879 (inside [0.1, 1.9]); NLL = 1.5 + 0.5 = 2.0
    # per token: [1.5, 0.5] x 0.367879 x 0.3 = [0.165546, 0.055182]; their sum 2.0 x 0.367879 x 0.3 = 0.220728
    logp = torch.tensor([[-1.5, -0.5]])
    ref = torch.tensor([[-1.0, 0.0]])
    mask = torch.ones(1, 2)
    adv = torch.tensor([0.8 - 0.5])
    out, g = _loss_and_grad("a_lol", logp, logp.detach(), adv, mask, ref_logprobs=ref)
    torch.testing.assert_close(out, torch.tensor([[0.165546, 0.055182]]), atol=1e-6, rtol=0)
    assert out.sum().item() == pytest.approx(0.220728, abs=1e-6)
    # the weight carries no gradient: d/dlogp_t = -w A+ = -0.110364 on each token
    torch.testing.assert_close(g, torch.full((1, 2), -math.exp(-1) * 0.3), atol=1e-6, rtol=0)
    # its declared aggregation (the authors' batch mean of summed NLLs) gives the response's loss
    assert losses.REGISTRY.traits("a_lol").aggregation == "seq_mean_token_sum"
    assert aggregation.reduce("seq_mean_token_sum", out, mask).item() == pytest.approx(0.220728, abs=1e-6)


def test_ratio_is_clamped_to_one_plus_minus_clip():
    # log ratio +2 -> exp(2) = 7.389 -> 1 + 0.9 = 1.9; log ratio -5 -> 0.006738 -> 1 - 0.9 = 0.1; A = 1, NLL = 1
    # -> losses 1.9 and 0.1. With clip = 0.5 the bounds are 1.5 and 0.5. A padded token (mask 0) does not count.
    logp = torch.tensor([[-1.0, -7.0], [-1.0, -7.0]])
    ref = torch.tensor([[-3.0, 0.0], [4.0, 0.0]])
    mask = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, 1.0])
    out = losses.compute("a_lol", logp, logp, adv, mask, ref_logprobs=ref)
    torch.testing.assert_close(out.sum(1), torch.tensor([1.9, 0.1]))
    out = losses.compute("a_lol", logp, logp, adv, mask, ref_logprobs=ref, clip=0.5)
    torch.testing.assert_close(out.sum(1), torch.tensor([1.5, 0.5]))


def test_token_ratio_variant_weights_each_token_by_its_own_clamped_ratio():
    # the authors' a_lol_seq (ratio = "token"): log pi_theta - log pi_ref per token = [-0.5, -0.5] -> w_t =
    # exp(-0.5) = 0.606531 each (the sequence variant: exp(-1) = 0.367879 on both); A+ = 0.3, NLL_t = [1.5, 0.5]
    # -> [1.5, 0.5] x 0.606531 x 0.3 = [0.272939, 0.090980], sum 0.363919 (vs 0.220728). Per-token log ratios
    # [+3, -0.5]: the first clamps to 1.9 alone (the sequence ratio e^2.5 = 12.18 would clamp both tokens to 1.9)
    logp = torch.tensor([[-1.5, -0.5]])
    mask = torch.ones(1, 2)
    adv = torch.tensor([0.3])
    out = losses.compute("a_lol", logp, logp, adv, mask, ref_logprobs=torch.tensor([[-1.0, 0.0]]), ratio="token")
    torch.testing.assert_close(out, torch.tensor([[0.272939, 0.090980]]), atol=1e-6, rtol=0)
    ref = torch.tensor([[-4.5, 0.0]])
    out = losses.compute("a_lol", logp, logp, adv, mask, ref_logprobs=ref, ratio="token")
    torch.testing.assert_close(out, torch.tensor([[1.5 * 1.9 * 0.3, 0.5 * math.exp(-0.5) * 0.3]]))
    out = losses.compute("a_lol", logp, logp, adv, mask, ref_logprobs=ref)
    torch.testing.assert_close(out, torch.tensor([[1.5 * 1.9 * 0.3, 0.5 * 1.9 * 0.3]]))


def test_negative_advantages_get_no_gradient_where_reinforce_pushes_them_down():
    # what sets A-LoL apart from its nearest neighbour reinforce (l = -A log pi): A = [0.5, -0.5], log ratio 0
    # (w = 1). reinforce: grad = -A = [-0.5, +0.5] (it lowers the negative response); a_lol: grad = -max(A, 0) w =
    # [-0.5, 0]: the negative response is left alone. Where pi_theta / pi_ref = e^0.5 = 1.648721 the positive
    # response's gradient is scaled by that weight, which reinforce does not have.
    logp = torch.tensor([[-1.0], [-2.0]])
    mask = torch.ones(2, 1)
    adv = torch.tensor([0.5, -0.5])
    _, g_rf = _loss_and_grad("reinforce", logp, logp.detach(), adv, mask)
    out, g = _loss_and_grad("a_lol", logp, logp.detach(), adv, mask, ref_logprobs=logp.clone())
    torch.testing.assert_close(g_rf, torch.tensor([[-0.5], [0.5]]))
    torch.testing.assert_close(g, torch.tensor([[-0.5], [0.0]]))
    assert out[1].item() == 0.0
    _, g = _loss_and_grad("a_lol", logp, logp.detach(), adv, mask, ref_logprobs=logp - 0.5)
    torch.testing.assert_close(g, torch.tensor([[-0.5 * math.exp(0.5)], [0.0]]))


def test_reads_the_reference_and_refuses_a_bad_clip():
    assert losses.inputs("a_lol") == ["ref_logprobs"]
    logp = torch.zeros(1, 1)
    with pytest.raises(TypeError, match="ref_logprobs"):
        losses.compute("a_lol", logp, logp, torch.ones(1), torch.ones(1, 1))
    with pytest.raises(ValueError, match="clip"):
        losses.compute("a_lol", logp, logp, torch.ones(1), torch.ones(1, 1), ref_logprobs=logp, clip=1.0)
    with pytest.raises(ValueError, match="ratio"):
        losses.compute("a_lol", logp, logp, torch.ones(1), torch.ones(1, 1), ref_logprobs=logp, ratio="seq")
