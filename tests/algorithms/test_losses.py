"""Policy losses: hand-computed examples (catalog worked numbers), invariants, smoke over names()."""

import math

import pytest
import torch

from posttrain.algorithms import aggregation, losses

LOG = math.log


def _tok(logp, old, adv, **params):
    """One-token helper: returns (loss value, d loss / d logp) for scalar inputs."""
    logp_NT = torch.tensor([[logp]], dtype=torch.float64, requires_grad=True)
    old_NT = torch.tensor([[old]], dtype=torch.float64)
    name = params.pop("name")
    loss = losses.compute(name, logp_NT, old_NT, torch.tensor([adv], dtype=torch.float64),
                          torch.ones(1, 1, dtype=torch.float64), **params)
    loss.sum().backward()
    return loss.item(), logp_NT.grad.item()


# --- ppo_clip (catalog B5) ---------------------------------------------------------------------


def test_ppo_clip_catalog_b5():
    # rho = 1.5, A = 1, eps_high = 0.28 -> max(-1.5, -1.28) = -1.28
    assert _tok(LOG(1.5), 0.0, 1.0, name="ppo_clip", eps_high=0.28)[0] == pytest.approx(-1.28)
    # same with eps_high = 0.2 -> -1.2
    assert _tok(LOG(1.5), 0.0, 1.0, name="ppo_clip")[0] == pytest.approx(-1.2)
    # rho = 0.5, A = -1 -> max(0.5, 0.8) = 0.8
    assert _tok(LOG(0.5), 0.0, -1.0, name="ppo_clip")[0] == pytest.approx(0.8)
    # rho = 5, A = -1: max(5, 1.2) = 5, dual clip c = 3 caps it at 3
    assert _tok(LOG(5.0), 0.0, -1.0, name="ppo_clip", dual_clip=3.0)[0] == pytest.approx(3.0)


def test_ppo_clip_asymmetric_clip():
    kw = dict(name="ppo_clip", eps_low=0.2, eps_high=0.28)
    # upper side clips at 1.28 (not 1.2): value -1.28 and no gradient
    assert _tok(LOG(1.5), 0.0, 1.0, **kw) == pytest.approx((-1.28, 0.0))
    # lower side clips at 0.8 for A < 0: value 0.8 and no gradient
    assert _tok(LOG(0.5), 0.0, -1.0, **kw) == pytest.approx((0.8, 0.0))
    # rho = 1.25 is inside the upper band (< 1.28) but outside a symmetric 0.2 band
    loss, grad = _tok(LOG(1.25), 0.0, 1.0, **kw)
    assert (loss, grad) == pytest.approx((-1.25, -1.25))  # d(-A rho)/dlogpi = -A rho
    # the pessimistic side is never clipped: rho = 0.5, A = 1 -> max(-0.5, -0.8) = -0.5
    assert _tok(LOG(0.5), 0.0, 1.0, **kw) == pytest.approx((-0.5, -0.5))


# --- cispo (catalog B9) ------------------------------------------------------------------------


def test_cispo_catalog_b9():
    # rho = 0.6/0.4 = 1.5, eps_high = 0.28 -> weight sg(1.28); l = -1.28 * A * logpi
    loss, grad = _tok(LOG(0.6), LOG(0.4), 1.0, name="cispo", eps_high=0.28)
    assert loss == pytest.approx(-1.28 * LOG(0.6))  # = 0.653857
    assert loss == pytest.approx(0.653857, abs=1e-6)
    assert grad == pytest.approx(-1.28)  # the token keeps a gradient (PPO would give 0)
    # lower clip: rho = 0.5, eps_low = 0.2 -> weight 0.8, gradient -0.8 A = 0.8 for A = -1
    assert _tok(LOG(0.2), LOG(0.4), -1.0, name="cispo", eps_low=0.2)[1] == pytest.approx(0.8)


# --- reinforce (RGRA, catalog L197) ------------------------------------------------------------


def test_reinforce_rgra():
    # l = -A logpi: A = 2, logpi = -0.5 -> 1.0; gradient -A = -2; old_logprobs ignored
    assert _tok(-0.5, -7.0, 2.0, name="reinforce") == pytest.approx((1.0, -2.0))
    # catalog L197: GRPO A = [.866025, -.866025, -.866025, .866025], one token each,
    # seq_mean_token_mean over G = 4 -> dL/dlogpi_i = -A_i / 4 = [-.216506, .216506, ...]
    adv = torch.tensor([0.866025, -0.866025, -0.866025, 0.866025])
    logp = torch.full((4, 1), -1.0, requires_grad=True)
    mask = torch.ones(4, 1)
    loss = aggregation.reduce("seq_mean_token_mean", losses.compute("reinforce", logp, logp, adv, mask), mask)
    loss.backward()
    assert logp.grad.flatten().tolist() == pytest.approx([-0.216506, 0.216506, 0.216506, -0.216506], abs=1e-6)
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # advantages sum to 0 at equal log-probs


# --- sapo --------------------------------------------------------------------------------------


def test_sapo_gate():
    # rho = e^0.5 = 1.648721, A = 1, tau_pos = 1: l = -sigmoid(0.648721) * 4 = -2.626889
    assert _tok(0.5, 0.0, 1.0, name="sapo")[0] == pytest.approx(-2.626889, abs=1e-6)
    # A = -1 uses tau_neg = 1.05: l = +sigmoid(1.05 * 0.648721) * 4 / 1.05 = 2.529512
    assert _tok(0.5, 0.0, -1.0, name="sapo")[0] == pytest.approx(2.529512, abs=1e-6)
    # at rho = 1: value -2A/tau = -2, gradient f'(1) rho (-A) = -A = -1
    assert _tok(0.0, 0.0, 1.0, name="sapo") == pytest.approx((-2.0, -1.0))


# --- gspo (catalog B8) -------------------------------------------------------------------------


def _seq(name, lr, adv, **params):
    """One sequence of len(lr) tokens with log-ratios lr; returns (per-token loss, grad of seq-mean)."""
    old = torch.full((1, len(lr)), -1.0, dtype=torch.float64)
    logp = (old + torch.tensor([lr], dtype=torch.float64)).requires_grad_(True)
    mask = torch.ones_like(old)
    loss_NT = losses.compute(name, logp, old, torch.tensor([adv], dtype=torch.float64), mask, **params)
    aggregation.reduce("seq_mean_token_mean", loss_NT, mask).backward()
    return loss_NT.detach()[0].tolist(), logp.grad[0].tolist()


def test_gspo_catalog_b8():
    # token log-ratios [0.1, -0.1, 0.3] -> s = exp(0.1) = 1.105171 on every token
    loss, grad = _seq("gspo", [0.1, -0.1, 0.3], 1.0, eps_low=0.2, eps_high=0.2)
    assert loss == pytest.approx([-1.105171] * 3, abs=1e-6)
    # seq_mean_token_mean: d/dlogpi_t of -A s = -A s / |y| = -0.368390 per token
    assert grad == pytest.approx([-1.105171 / 3] * 3, abs=1e-6)
    # paper-size eps (4e-4): s > 1 + eps_high with A > 0 -> clipped, value -1.0004, no gradient
    loss, grad = _seq("gspo", [0.1, -0.1, 0.3], 1.0)
    assert loss == pytest.approx([-1.0004] * 3) and grad == pytest.approx([0.0] * 3)
    # A < 0: max(1.105171, 1.0004) keeps the unclipped side, so the gradient flows
    loss, grad = _seq("gspo", [0.1, -0.1, 0.3], -1.0)
    assert loss == pytest.approx([1.105171] * 3, abs=1e-6)
    assert grad == pytest.approx([1.105171 / 3] * 3, abs=1e-6)


# --- gmpo --------------------------------------------------------------------------------------


def test_gmpo_geometric_mean_with_token_clip():
    # A = 1, lr = [0.1, -0.1, 0.5], eps 0.4: the 0.5 is clipped to 0.4 (pessimistic for A > 0)
    # rho = exp((0.1 - 0.1 + 0.4) / 3) = 1.142631; l = -1.142631 on every token
    loss, grad = _seq("gmpo", [0.1, -0.1, 0.5], 1.0)
    assert loss == pytest.approx([-1.142631] * 3, abs=1e-6)
    # gradient -A rho / |y| for unclipped tokens = -0.380877, 0 for the clipped one
    assert grad == pytest.approx([-1.142631 / 3, -1.142631 / 3, 0.0], abs=1e-6)
    # A = -1: clipping keeps the larger log-ratio (pessimistic): rho = exp(0.5/3) = 1.181360
    loss, grad = _seq("gmpo", [0.1, -0.1, 0.5], -1.0)
    assert loss == pytest.approx([1.181360] * 3, abs=1e-6)
    assert grad == pytest.approx([1.181360 / 3] * 3, abs=1e-6)


# --- clip_cov / kl_cov ---------------------------------------------------------------------------


def _cov_batch():
    # A = [[2, 2], [-2, -2]], logpi = [[-1, -3], [-3, -1]]; means 0 and -2
    # cov = A (logpi + 2) = [[2, -2], [2, -2]] -> tokens (0,0) and (1,0) lie in (1, 5)
    adv = torch.tensor([2.0, -2.0])
    logp = torch.tensor([[-1.0, -3.0], [-3.0, -1.0]], requires_grad=True)
    return adv, logp, torch.ones(2, 2)


def test_clip_cov_drops_band_tokens():
    adv, logp, mask = _cov_batch()
    # clip_cov_ratio 0.5 -> int(0.5 * 4) = 2 tokens: both candidates dropped (no randomness left)
    loss = losses.compute("clip_cov", logp, logp.detach(), adv, mask, clip_cov_ratio=0.5)
    assert loss.tolist() == [[0.0, -2.0], [0.0, 2.0]]  # others: -A * rho = -A at rho = 1
    loss.sum().backward()
    assert logp.grad.tolist() == [[0.0, -2.0], [0.0, 2.0]]  # dropped tokens get no gradient


def test_clip_cov_default_drops_one_sampled_token():
    adv, logp, mask = _cov_batch()
    # default ratio 2e-4 -> max(int(2e-4 * 4), 1) = 1 of the 2 candidates, drawn by the generator
    outs = [
        losses.compute("clip_cov", logp, logp.detach(), adv, mask, generator=torch.Generator().manual_seed(s))
        for s in (0, 0, 1, 2, 3)
    ]
    for out in outs:
        assert int((out == 0).sum()) == 1 and (out[0, 0] == 0) != (out[1, 0] == 0)
    assert torch.equal(outs[0], outs[1])  # same seed, same draw


def test_kl_cov_penalizes_top_covariance_tokens():
    adv, logp, mask = _cov_batch()
    old = logp.detach() - 0.1  # rho = e^0.1 = 1.105171 everywhere, |lr| = 0.1
    # kl_cov_ratio 0.5 -> k = 2 largest cov: (0,0) and (1,0) (cov 2); they get + 1 * 0.1
    loss = losses.compute("kl_cov", logp, old, adv, mask, kl_cov_ratio=0.5)
    expected = [[-2 * 1.105171 + 0.1, -2 * 1.105171], [2 * 1.105171 + 0.1, 2 * 1.105171]]
    assert loss.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]


# --- apa, a_star_po, drpo ----------------------------------------------------------------------


def test_apa_catalog_l217():
    # (dlogpi - c A)^2 = (0.05 - 10 * 0.02)^2 = 0.0225; gradient 2 (0.05 - 0.2) = -0.3
    assert _tok(0.05, 0.0, 0.02, name="apa") == pytest.approx((0.0225, -0.3))
    # apa_init, the paper's anchor pi_init (ref_logprobs), whatever pi_old is:
    # (0.05 - (-0.05) - 10 * 0.02)^2 = (0.1 - 0.2)^2 = 0.01
    logp = torch.tensor([[0.05]])
    for old in (0.0, 0.3):
        out = losses.compute("apa_init", logp, torch.full((1, 1), old), torch.tensor([0.02]), torch.ones(1, 1),
                             ref_logprobs=torch.tensor([[-0.05]]))
        assert out.item() == pytest.approx(0.01)


def test_apa_init_loads_the_reference_without_a_kl_term(tiny_cfg):
    from posttrain.train.loop_state import Phases

    init = Phases.from_config(tiny_cfg('algorithm.loss="apa_init"', "algorithm.kl_coef=0")).learn
    assert init.needs_ref and init.kl is None  # the anchor needs pi_init; no KL penalty comes with it
    assert not Phases.from_config(tiny_cfg('algorithm.loss="apa"', "algorithm.kl_coef=0")).learn.needs_ref


def test_a_star_po_catalog_3_9():
    # V* = 0.716890; r = 1 -> A* = 0.283110; log-ratio 0 -> (0 - 0.283110)^2 = 0.080151
    # r = 0 -> A* = -0.716890 -> 0.513932
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    adv = torch.tensor([1 - 0.716890, 0 - 0.716890])
    out = losses.compute("a_star_po", logp, logp.detach(), adv, torch.ones(2, 3), ref_logprobs=logp.detach())
    assert out[:, 0].tolist() == pytest.approx([0.080151, 0.513932], abs=1e-6)
    assert torch.equal(out[:, 0:1].expand(2, 3), out)  # the sequence value sits on every token
    # beta = 0.1, sum of log-ratios 2 (0.5 on each of 4 tokens): (0.2 - 0.283110)^2 = 0.006907
    logp = torch.full((1, 4), -0.5)
    out = losses.compute("a_star_po", logp, logp, adv[:1], torch.ones(1, 4),
                         ref_logprobs=torch.full((1, 4), -1.0), beta=0.1)
    assert out[0, 0].item() == pytest.approx(0.006907, abs=1e-6)


def test_a_star_po_needs_ref_logprobs():
    logp = torch.zeros(1, 2)
    with pytest.raises(TypeError, match="ref_logprobs"):
        losses.compute("a_star_po", logp, logp, torch.zeros(1), torch.ones(1, 2))
    assert losses.inputs("a_star_po") == ["ref_logprobs"]


def test_drpo_length_weights_and_objective():
    # T = 5. Group 7 (mixed): positives with lengths 1, 3 (ratios 0.2, 0.6) and s = -1, -2;
    # negatives s = -1, -3. Group 3: all correct (not counted in J, counted in #groups = 2).
    # w = softmax([(1-.2)/.1, (1-.6)/.1]) = softmax([8, 4]) = [0.982014, 0.017986]  (catalog 3.34)
    # pos = 0.982014 * -1 + 0.017986 * -2 = -1.017986
    # lme = log mean(exp(-1/10), exp(-3/10)) = -0.195008; J = pos - 10 * lme = 0.932097
    lengths = [1, 3, 2, 5, 2, 2, 2, 2]
    s = [-1.0, -2.0, -1.0, -3.0, -1.0, -1.0, -1.0, -1.0]
    mask = torch.tensor([[1.0] * n + [0.0] * (5 - n) for n in lengths])
    logp = (torch.tensor(s)[:, None] * mask).requires_grad_(True)
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    group_ids = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])[[0, 4, 1, 5, 2, 6, 3, 7]]  # interleaved
    perm = [0, 4, 1, 5, 2, 6, 3, 7]
    out = losses.compute("drpo", logp[perm], logp.detach()[perm], torch.zeros(8), mask[perm],
                         rewards=rewards[perm], group_ids=group_ids)
    total = aggregation.reduce("seq_mean_token_mean", out, mask[perm])
    # -(1/#groups) sum_q J_q = -0.932097 / 2; KL to pi_old is 0 so the penalty is 0
    assert total.item() == pytest.approx(-0.932097 / 2, abs=1e-5)
    total.backward()
    # d total / d s_i = -w_i / 2 for positives, +softmax(s_neg / tau)_j / 2 for negatives;
    # per token divide by the length: pos 0: -0.982014 / 2 / 1; neg 3: 0.450166 / 2 / 5
    sm = math.exp(-0.3) / (math.exp(-0.1) + math.exp(-0.3))  # 0.450166
    assert logp.grad[0, 0].item() == pytest.approx(-0.982014 / 2, abs=1e-5)
    assert logp.grad[1, 0].item() == pytest.approx(-0.017986 / 2 / 3, abs=1e-5)
    assert logp.grad[3, 0].item() == pytest.approx(sm / 2 / 5, abs=1e-5)
    assert logp.grad[4:].abs().max().item() == 0.0  # the all-correct group gives no gradient


def test_drpo_trust_region_penalty():
    # k3 to pi_old per token: rho - 1 - log rho with log rho = 0.1 -> 0.005171; beta (KL - delta) > 0
    mask = torch.ones(2, 1)
    logp = torch.tensor([[-1.0], [-2.0]])
    out = losses.compute("drpo", logp, logp - 0.1, torch.zeros(2), mask,
                         rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]))
    k3 = math.exp(0.1) - 1 - 0.1
    coef = 1e3 * (k3 - 1e-4)
    # J = s_pos - 10 log exp(s_neg/10) = -1 - (-2) = 1; per sequence -J * N / (Q G) = -1
    assert out.flatten().tolist() == pytest.approx([-1 + coef * k3] * 2, abs=1e-5)


# --- compute mechanics and invariants over the registry -------------------------------------------

RATIO_BASED = ["ppo_clip", "cispo", "reinforce", "sapo", "gspo", "gmpo", "clip_cov", "kl_cov"]


def _random_batch(seed=0, n=4, t=5):
    g = torch.Generator().manual_seed(seed)
    old = -1.0 + 0.1 * torch.randn(n, t, generator=g)
    mask = torch.ones(n, t)
    mask[0, 3:] = 0
    mask[2, 1:] = 0
    adv = 0.5 * (torch.rand(n, generator=g) - 0.5)  # small: no covariance selection in (1, 5)
    extra = {
        "ref_logprobs": old + 0.05 * torch.randn(n, t, generator=g),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 0.0])[:n],
        "group_ids": torch.tensor([0, 0, 1, 1])[:n],
        "external": torch.tensor([False, True, False, True])[:n],  # rl_plus: rows 1 and 3 are external
        # rover: m_theta and m_old per token (their own generator: the draws above and below stay as they were)
        "mean_logsoftmax": -5.0 + 0.1 * torch.randn(n, t, generator=torch.Generator().manual_seed(11)),
        "old_mean_logsoftmax": -5.0 + 0.1 * torch.randn(n, t, generator=torch.Generator().manual_seed(12)),
        # shiq: the logits' logsumexp under the policy and the reference (their own generators, as rover's)
        "logsumexp": 3.0 + 0.1 * torch.randn(n, t, generator=torch.Generator().manual_seed(13)),
        "ref_logsumexp": 3.0 + 0.1 * torch.randn(n, t, generator=torch.Generator().manual_seed(14)),
    }
    return old, adv, mask, extra


def _inputs_for(name, extra):
    return {k: extra[k] for k in losses.inputs(name)}


@pytest.mark.parametrize("name", RATIO_BASED)
def test_ratio_one_gives_policy_gradient(name):
    old, adv, mask, extra = _random_batch()
    logp = old.clone().requires_grad_(True)
    loss = losses.compute(name, logp, old, adv, mask, **_inputs_for(name, extra))
    # summed over tokens: d/dlogpi_it = -A_i m_it for every surrogate at rho = 1
    loss.sum().backward()
    assert torch.allclose(logp.grad, -adv[:, None] * mask, atol=1e-6)
    # and through the aggregation the paper pairs it with, mask-normalized
    logp.grad = None
    agg = "seq_mean_token_mean" if name in ("gspo", "gmpo", "sapo", "reinforce") else "token_mean"
    loss = losses.compute(name, logp, old, adv, mask, **_inputs_for(name, extra))
    aggregation.reduce(agg, loss, mask).backward()
    if agg == "token_mean":
        expected = -adv[:, None] * mask / mask.sum()
    else:
        expected = -adv[:, None] * mask / mask.sum(dim=1, keepdim=True) / mask.shape[0]
    assert torch.allclose(logp.grad, expected, atol=1e-7)


@pytest.mark.parametrize("name", losses.names())
def test_masked_tokens_have_zero_loss_and_gradient(name):
    old, adv, mask, extra = _random_batch(seed=1)
    logp_val = old + 0.2 * torch.randn(old.shape, generator=torch.Generator().manual_seed(5))
    logp_val = torch.where(mask > 0, logp_val, torch.full_like(old, -30.0))  # garbage under the mask
    logp = logp_val.requires_grad_(True)
    loss = losses.compute(name, logp, old, adv, mask, **_inputs_for(name, extra))
    loss.sum().backward()
    assert torch.all(loss[mask == 0] == 0)
    assert torch.all(logp.grad[mask == 0] == 0)


@pytest.mark.parametrize("name", losses.names())
def test_every_loss_is_finite_with_finite_gradient(name):
    g = torch.Generator().manual_seed(2)
    n, t = 6, 7
    old = -torch.rand(n, t, generator=g) * 3
    logp = (old + 0.3 * torch.randn(n, t, generator=g)).requires_grad_(True)
    mask = (torch.rand(n, t, generator=g) > 0.2).float()
    extra = {
        "ref_logprobs": old + 0.1 * torch.randn(n, t, generator=g),
        "rewards": torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0]),
        "group_ids": torch.tensor([0, 1, 0, 1, 0, 1]),
        "external": torch.tensor([False, False, True, False, False, True]),  # rl_plus's external rows
        # rover: m_theta and m_old per token (their own generator: the draws above and below stay as they were)
        "mean_logsoftmax": -5.0 + 0.1 * torch.randn(n, t, generator=torch.Generator().manual_seed(11)),
        "old_mean_logsoftmax": -5.0 + 0.1 * torch.randn(n, t, generator=torch.Generator().manual_seed(12)),
        # shiq: the logits' logsumexp under the policy and the reference (their own generators, as rover's)
        "logsumexp": 3.0 + 0.1 * torch.randn(n, t, generator=torch.Generator().manual_seed(13)),
        "ref_logsumexp": 3.0 + 0.1 * torch.randn(n, t, generator=torch.Generator().manual_seed(14)),
    }
    adv = torch.randn(n, t, generator=g) if name not in ("gmpo",) else torch.randn(n, generator=g)
    loss = losses.compute(name, logp, old, adv, mask, weights=torch.rand(n, t, generator=g),
                          **_inputs_for(name, extra))
    assert loss.shape == (n, t) and torch.isfinite(loss).all()
    for mode in aggregation.names():
        assert torch.isfinite(aggregation.reduce(mode, loss, mask))
    loss.sum().backward()
    assert logp.grad.shape == (n, t) and torch.isfinite(logp.grad).all()


def test_weights_multiply_the_loss():
    logp = torch.tensor([[-1.0, -2.0]])
    base = losses.compute("reinforce", logp, logp, torch.tensor([1.0]), torch.ones(1, 2))
    w = torch.tensor([[0.5, 2.0]])
    out = losses.compute("reinforce", logp, logp, torch.tensor([1.0]), torch.ones(1, 2), weights=w)
    assert torch.allclose(out, base * w)


def test_unknown_parameter_and_missing_input_errors():
    logp = torch.zeros(2, 2)
    with pytest.raises(TypeError, match="unknown parameter"):
        losses.compute("ppo_clip", logp, logp, torch.zeros(2), torch.ones(2, 2), eps=0.1)
    with pytest.raises(TypeError, match=r"\['rewards', 'group_ids'\]"):
        losses.compute("drpo", logp, logp, torch.zeros(2), torch.ones(2, 2))
    assert losses.inputs("ppo_clip") == []


def test_every_entry_is_documented():
    for name in losses.names():
        doc = " ".join(losses.REGISTRY.doc(name).split())
        assert ("arXiv" in doc or "papers/" in doc) and "Nearest neighbour" in doc, name


# --- drpo: L_max is the configured maximum length, and the aggregation is the paper's ---------------


def _drpo_group(width):
    # one group: positives of lengths 1 and 3 (s = -1, -2), one negative of length 2 (s = -1.5), padded to `width`
    lengths, s = [1, 3, 2], [-1.0, -2.0, -1.5]
    mask = torch.tensor([[1.0] * n + [0.0] * (width - n) for n in lengths])
    logp = (torch.tensor(s)[:, None] * mask).requires_grad_(True)
    return logp, mask, torch.tensor([1.0, 1.0, 0.0]), torch.tensor([0, 0, 0])


def test_drpo_l_max_is_the_configured_maximum_length():
    # L_max = 10 (the configured maximum), though the longest response in the batch is 3:
    # ratios 0.1, 0.3 -> w = softmax([(1-.1)/.1, (1-.3)/.1]) = softmax([9, 7]) = [0.880797, 0.119203]
    # pos = 0.880797 * -1 + 0.119203 * -2 = -1.119203; lme = log mean(exp(-1.5/10)) = -0.15
    # J = -1.119203 - 10 * -0.15 = 0.380797; one group -> loss -J = -0.380797 (KL to pi_old is 0)
    # (the batch's longest, 3, would give ratios 1/3, 1 -> w = softmax([6.67, 0]) = [0.998728, 0.001272])
    logp, mask, rewards, gids = _drpo_group(3)
    out = losses.compute("drpo", logp, logp.detach(), torch.zeros(3), mask, rewards=rewards, group_ids=gids,
                         max_len=10)
    total = aggregation.reduce("seq_mean_token_mean", out, mask)
    assert total.item() == pytest.approx(-0.380797, abs=1e-5)
    total.backward()
    # d total / d s_i = -w_i for positives; per token / |y_i|: -0.880797 / 1, -0.119203 / 3 = -0.039734
    assert logp.grad[0, 0].item() == pytest.approx(-0.880797, abs=1e-5)
    assert logp.grad[1, 0].item() == pytest.approx(-0.039734, abs=1e-5)
    # the padded width of the batch no longer matters: the same rows padded to 10 give the same loss
    wide = _drpo_group(10)
    out_wide = losses.compute("drpo", wide[0], wide[0].detach(), torch.zeros(3), wide[1], rewards=rewards,
                              group_ids=gids, max_len=10)
    assert aggregation.reduce("seq_mean_token_mean", out_wide, wide[1]).item() == pytest.approx(-0.380797, abs=1e-5)
    with pytest.raises(ValueError, match="max_len"):
        losses.compute("drpo", logp, logp, torch.zeros(3), mask, rewards=rewards, group_ids=gids, max_len=0)


def test_drpo_max_len_is_filled_with_rollout_max_new_tokens(tiny_cfg):
    from posttrain.train.loop_state import Phases

    drpo = ("algorithm.loss=drpo", "algorithm.aggregation=seq_mean_token_mean")
    cfg = tiny_cfg(*drpo, "rollout.max_new_tokens=9")
    assert Phases.from_config(cfg).learn.loss.keywords["max_len"] == 9
    cfg = tiny_cfg(*drpo, "algorithm.loss_params={max_len=12}")  # set explicitly: kept
    assert Phases.from_config(cfg).learn.loss.keywords["max_len"] == 12
    assert "max_len" not in Phases.from_config(tiny_cfg()).learn.loss.keywords  # ppo_clip has no L_max


def test_drpo_needs_seq_mean_token_mean(tiny_cfg):
    from posttrain.config import ConfigError

    # token_mean length-weights DRPO's groups (next test): the config rejects any aggregation but the paper's
    with pytest.raises(ConfigError, match="drpo.*seq_mean_token_mean"):
        tiny_cfg("algorithm.loss=drpo")  # tiny's token_mean
    tiny_cfg("algorithm.loss=drpo", "algorithm.aggregation=seq_mean_token_mean")


def test_drpo_token_mean_would_length_weight_the_groups():
    # Two groups, L_max = 10: group A as above (lengths 1, 3, 2; J_A = 0.380797), group B with the same scores on
    # rows of lengths 4, 4, 4 (ratios .4: w = [0.5, 0.5], pos = -1.5; J_B = -1.5 + 1.5 = 0).
    # Paper: -(J_A + J_B) / 2 = -0.190399. seq_mean_token_mean gives it; token_mean weighs each row's value
    # -J_q * N / (Q G_q) = -J_q by its tokens: -(6 * 0.380797 + 12 * 0) / 18 = -0.126932.
    a_logp, a_mask, rewards, _ = _drpo_group(4)
    b_mask = torch.ones(3, 4)
    b_logp = torch.tensor([-1.0, -2.0, -1.5])[:, None] * b_mask
    logp, mask = torch.cat([a_logp.detach(), b_logp]), torch.cat([a_mask, b_mask])
    out = losses.compute("drpo", logp, logp, torch.zeros(6), mask, rewards=torch.cat([rewards, rewards]),
                         group_ids=torch.tensor([0, 0, 0, 1, 1, 1]), max_len=10)
    assert aggregation.reduce("seq_mean_token_mean", out, mask).item() == pytest.approx(-0.190399, abs=1e-5)
    assert aggregation.reduce("token_mean", out, mask).item() == pytest.approx(-0.126932, abs=1e-5)
