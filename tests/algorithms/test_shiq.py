"""ShiQ (arXiv:2505.11081; posttrain/algorithms/losses_shiq.py, seed papers/004_f298e9ec572f7f27.txt:239): a hand
example, the fixed points (the reference at zero reward; the shifted soft-Q logits on every trajectory of a small
tree), what sets it apart (the logits' level is the value and carries gradient; a sparse reward reaches every token),
the config, the update's reference pass, and a short run on the tiny model."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import losses
from posttrain.algorithms.losses_shiq import returns_to_go
from posttrain.config import ConfigError
from posttrain.config.base import LOSS_INPUTS, TOKEN_LOSS_INPUTS


def _shiq(logp, ref, v, v_ref, r, mask=None, **kw):
    """The loss and its gradients with respect to log pi and V (both leaves)."""
    logp = logp.clone().requires_grad_(True)
    v = v.clone().requires_grad_(True)
    mask = torch.ones_like(logp) if mask is None else mask
    out = losses.compute("shiq", logp, logp.detach(), torch.zeros(logp.shape[0]), mask, ref_logprobs=ref,
                         logsumexp=v, ref_logsumexp=v_ref, rewards=r, **kw)
    g_logp, g_v = torch.autograd.grad(out.sum(), (logp, v))
    return out.detach(), g_logp, g_v


def _token_terms(logits_TV, ids_T):
    """log softmax of the chosen tokens and logsumexp at each position, ``[T]`` each."""
    return torch.log_softmax(logits_TV, -1).gather(-1, ids_T[:, None])[:, 0], torch.logsumexp(logits_TV, -1)


# --- hand-computed example ---------------------------------------------------------------------------------------


def test_hand_example():
    # beta = 0.5, one response of two tokens, reward 1 (R_t = 1 on both: the outcome sits on the last token)
    # log pi - log pi_ref = [0.2, 0.0]            -> S_t = sum_{k>=t} = [0.2 + 0.0, 0.0] = [0.2, 0.0]
    # V - V_ref = [3.0 - 2.9, 2.0 - 2.2]          -> D_t = [0.1, -0.2]
    # beta (S + D) = 0.5 [0.3, -0.2] = [0.15, -0.1]; residuals e = [0.15 - 1, -0.1 - 1] = [-0.85, -1.1]
    # l = e^2 = [0.7225, 1.21]
    # d sum l / d log pi_0 = 2 beta e_0 = -0.85 (token 0 is in S_0 only)
    # d sum l / d log pi_1 = 2 beta (e_0 + e_1) = -1.95 (token 1 is in S_0 and S_1)
    # d sum l / d V_t = 2 beta e_t = [-0.85, -1.1]
    logp, ref = torch.tensor([[-1.0, -0.5]]), torch.tensor([[-1.2, -0.5]])
    v, v_ref = torch.tensor([[3.0, 2.0]]), torch.tensor([[2.9, 2.2]])
    out, g_logp, g_v = _shiq(logp, ref, v, v_ref, torch.tensor([1.0]), beta=0.5)
    assert out.flatten().tolist() == pytest.approx([0.7225, 1.21], abs=1e-6)
    assert g_logp.flatten().tolist() == pytest.approx([-0.85, -1.95], abs=1e-6)
    assert g_v.flatten().tolist() == pytest.approx([-0.85, -1.1], abs=1e-6)


def test_returns_to_go_sum_over_the_trained_tokens_only():
    # row 1's third position is padding: its 9.0 enters no sum; [1, 2, 3] -> [6, 5, 3]
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    torch.testing.assert_close(returns_to_go(x, mask), torch.tensor([[6.0, 5.0, 3.0], [9.0, 5.0, 0.0]]))
    # through the loss: padding gets no loss, whatever its inputs
    out, _, _ = _shiq(torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3), torch.randn(2, 3),
                      torch.tensor([1.0, 0.0]), mask)
    assert out[1, 2].item() == 0.0 and (out[mask > 0] > 0).all()


# --- fixed points -------------------------------------------------------------------------------------------------


def test_the_reference_is_a_fixed_point_at_zero_reward():
    # the "shifted" step: at r = 0 the solution is the reference's own logits, so training starts at rest
    # (log pi = log pi_ref and V = V_ref: S = D = 0 and R = 0 on every token)
    g = torch.Generator().manual_seed(0)
    logp, v = -torch.rand(3, 5, generator=g), torch.randn(3, 5, generator=g)
    out, g_logp, g_v = _shiq(logp, logp, v, v, torch.zeros(3))
    assert out.abs().max().item() == 0.0 and g_logp.abs().max().item() == 0.0 and g_v.abs().max().item() == 0.0
    # with a reward the start is not at rest: every token's residual is -R, the log-probs are pushed up
    out, g_logp, _ = _shiq(logp, logp, v, v, torch.tensor([1.0, 0.0, 1.0]))
    torch.testing.assert_close(out, torch.tensor([1.0, 0.0, 1.0])[:, None].expand(3, 5))
    assert (g_logp[[0, 2]] < 0).all() and (g_logp[1] == 0).all()


def test_shifted_soft_q_logits_zero_the_loss_on_every_trajectory():
    # a two-token tree over a 3-token vocabulary: the root s0, then s1(a) after token a; the reward r(a, b) comes
    # at the end. The soft Q-values of the KL-regularized problem are
    #   q(s1(a), b) = r(a, b);  q(s0, a) = beta log sum_b pi_ref(b | s1(a)) exp(r(a, b) / beta)
    # and ShiQ's logits are the reference's shifted by q / beta: l*(s, a) = l_ref(s, a) + q(s, a) / beta. On every
    # one of the 9 trajectories the multi-step residual is 0, and softmax(l*) = pi_ref exp(q / beta) / Z is the
    # optimal policy, sampled from the logits alone (no reference model at inference)
    g = torch.Generator().manual_seed(1)
    beta = 0.5
    l0 = torch.randn(3, generator=g)
    l1 = torch.randn(3, 3, generator=g)  # l1[a] = the reference's logits at s1(a)
    r = torch.rand(3, 3, generator=g)
    q0 = beta * torch.logsumexp(torch.log_softmax(l1, -1) + r / beta, -1)
    star0, star1 = l0 + q0 / beta, l1 + r / beta
    rows = [(a, b) for a in range(3) for b in range(3)]
    logp, ref, v, v_ref = (torch.zeros(9, 2) for _ in range(4))
    for i, (a, b) in enumerate(rows):
        ids = torch.tensor([a, b])
        logp[i], v[i] = _token_terms(torch.stack([star0, star1[a]]), ids)
        ref[i], v_ref[i] = _token_terms(torch.stack([l0, l1[a]]), ids)
    rewards = torch.tensor([r[a, b].item() for a, b in rows])
    out, g_logp, g_v = _shiq(logp, ref, v, v_ref, rewards, beta=beta)
    assert out.abs().max().item() < 1e-10 and g_logp.abs().max().item() < 1e-5 and g_v.abs().max().item() < 1e-5
    torch.testing.assert_close(torch.softmax(star0, -1), torch.softmax(torch.log_softmax(l0, -1) + q0 / beta, -1))
    # the level matters: the same policy with the root's logits all raised by 1 (softmax unchanged) is not a
    # solution any more: D(s0) grows by 1 and the first token's residual by beta
    out, _, _ = _shiq(logp, ref, v + torch.tensor([1.0, 0.0]), v_ref, rewards, beta=beta)
    torch.testing.assert_close(out[:, 0], torch.full((9,), beta**2))


# --- what sets it apart ------------------------------------------------------------------------------------------


def test_the_logits_level_is_the_value_and_carries_gradient():
    # a log-prob loss cannot see a shift of every logit at a state (log softmax drops it); ShiQ reads the level as
    # V(s_t) and trains it: the gradient reaches `logsumexp` (GRAD_INPUTS), never the reference's inputs
    assert losses.GRAD_INPUTS == ("logsumexp",)
    logits = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(2))
    ids = torch.randint(7, (2, 4), generator=torch.Generator().manual_seed(3))
    shifted = logits + 1.5  # the same policy, every logit raised by 1.5
    ref_logits = torch.randn(2, 4, 7, generator=torch.Generator().manual_seed(4))
    ref = torch.log_softmax(ref_logits, -1).gather(-1, ids[..., None])[..., 0]
    ref_v = torch.logsumexp(ref_logits, -1)
    r, mask = torch.tensor([1.0, 0.0]), torch.ones(2, 4)

    def both(z):
        z = z.clone().requires_grad_(True)
        logp = torch.log_softmax(z, -1).gather(-1, ids[..., None])[..., 0]
        kw = {"ref_logprobs": ref, "rewards": r}
        shiq = losses.compute("shiq", logp, logp.detach(), r, mask, logsumexp=torch.logsumexp(z, -1),
                              ref_logsumexp=ref_v, **kw)
        a_star = losses.compute("a_star_po", logp, logp.detach(), r, mask, ref_logprobs=ref)
        (grad,) = torch.autograd.grad(shiq.sum(), z)
        return shiq.detach(), a_star.detach(), grad

    s0, a0, g0 = both(logits)
    s1, a1, g1 = both(shifted)
    torch.testing.assert_close(a0, a1)  # the sequence log-ratio loss is blind to the level
    assert (s0 - s1).abs().max().item() > 1e-3  # ShiQ is not
    # the gradient has a part along the all-ones direction of the vocabulary (it moves the level): a log-prob
    # loss's gradient sums to 0 over the vocabulary at every position
    assert g0.sum(-1).abs().max().item() > 1e-3
    # the reference's inputs are detached like the other inputs
    ref_v_leaf = ref_v.clone().requires_grad_(True)
    out = losses.compute("shiq", ref.clone().requires_grad_(True), ref, r, mask, ref_logprobs=ref,
                         logsumexp=ref_v, ref_logsumexp=ref_v_leaf, rewards=r)
    assert torch.autograd.grad(out.sum(), ref_v_leaf, allow_unused=True)[0] is None


def test_a_sparse_reward_reaches_every_token_in_one_update():
    # multi-step consistency: at the start (pi = pi_ref, V = V_ref) every residual is -R, and token k sits in the
    # sums of positions 0..k, so d sum l / d log pi_k = 2 beta sum_{t<=k} (-R) = -2 beta (k + 1) R: no token is
    # left without signal, and the push grows toward the end (where the reward was earned)
    logp = torch.full((1, 4), -1.0)
    v = torch.zeros(1, 4)
    _, g_logp, g_v = _shiq(logp, logp, v, v, torch.tensor([2.0]), beta=0.1)
    assert g_logp.flatten().tolist() == pytest.approx([-0.4, -0.8, -1.2, -1.6], abs=1e-6)
    assert g_v.flatten().tolist() == pytest.approx([-0.4] * 4, abs=1e-6)


# --- config and the update ---------------------------------------------------------------------------------------


def test_config_accepts_shiq_and_loads_the_reference_without_a_kl_term(tiny_cfg):
    from posttrain.train.loop_state import Phases

    assert {"logsumexp", "ref_logsumexp"} <= set(LOSS_INPUTS) and {"logsumexp", "ref_logsumexp"} <= set(
        TOKEN_LOSS_INPUTS)
    assert losses.inputs("shiq") == ["ref_logprobs", "logsumexp", "ref_logsumexp", "rewards"]
    cfg = tiny_cfg("algorithm.loss=shiq", "algorithm.kl_coef=0.0", "algorithm.loss_params={beta=0.05}")
    learn = Phases.from_config(cfg).learn
    assert learn.needs_ref and learn.needs_reference and learn.kl is None
    for bad in ("{beta=0.0}", "{beta=-1.0}", "{gamma=1.0}"):
        with pytest.raises(ConfigError, match="shiq"):
            tiny_cfg("algorithm.loss=shiq", f"algorithm.loss_params={bad}")


def test_the_reference_pass_computes_its_logsumexp_only_for_a_loss_that_declares_it(tiny_cfg, monkeypatch):
    from posttrain.learn import update
    from posttrain.learn.update import logit_inputs, reference_policy
    from posttrain.train.loop_state import Phases

    calls = []

    def fake(model, rows, rollouts, *, terms=(), **kw):
        calls.append(len(terms))
        base = torch.full((2, 3), -1.0)
        return torch.stack([base, *[torch.full((2, 3), 5.0) for _ in terms]], -1) if terms else base

    monkeypatch.setattr(update, "batched_logprobs", fake)
    lp = {"pad_id": 0, "temperature": 1.0, "budget": 0}
    shiq = Phases.from_config(tiny_cfg("algorithm.loss=shiq")).learn
    kl = Phases.from_config(tiny_cfg("algorithm.kl_coef=0.1")).learn
    assert logit_inputs(shiq.loss_inputs) == ["logsumexp"] and logit_inputs(kl.loss_inputs) == []
    ref, rows = reference_policy(object(), [], SimpleNamespace(), shiq, lp)
    assert calls == [1] and (ref == -1.0).all() and set(rows) == {"ref_logsumexp"}
    assert (rows["ref_logsumexp"] == 5.0).all()
    ref, rows = reference_policy(object(), [], SimpleNamespace(), kl, lp)
    assert calls == [1, 0] and (ref == -1.0).all() and rows == {}
    assert reference_policy(None, [], SimpleNamespace(), shiq, lp) == (None, {}) and calls == [1, 0]


def test_shiq_trains_the_tiny_model(tmp_path, quiet):
    # the preset for 2 steps (2 epochs each): finite losses, the reference held, the parameters moved
    from pathlib import Path

    from posttrain.config import load_config
    from posttrain.train import rl

    recipe = Path(__file__).resolve().parents[2] / "recipes" / "shiq.toml"
    cfg = load_config(recipe, [f'out="{tmp_path / "run"}"', "train.steps=2", "log.progress=false",
                               "log.tensorboard=false", "log.plot_groups=false", "checkpoint.every=0", "eval.every=0"])
    assert (cfg.algorithm.loss, cfg.algorithm.aggregation, cfg.algorithm.kl_coef, cfg.train.epochs) == (
        "shiq", "seq_mean_token_sum", 0.0, 2)
    rl.train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/nonfinite"] == 0 and math.isfinite(r["loss"]) for r in rows)
    assert all(r["train/optimizer_steps"] == 2 for r in rows)
