"""SFT losses (``sft.loss``; posttrain/algorithms/sft_losses.py): ``mle``, the default, unchanged; ``iq_learn``, IRL
imitation as TD-regularized MLE (arXiv:2409.01369, seed papers/004_f298e9ec572f7f27.txt:147): the catalog's hand
example and identity, invariants, what sets it apart from MLE, the config, the trainer's forward and a short run."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posttrain.algorithms import sft_losses
from posttrain.algorithms.sft_losses import next_value
from posttrain.config import ConfigError


def _terms(logits_NTV, ids_NT):
    """log pi of the chosen tokens and logsumexp at every position, ``[N, T]`` each."""
    return torch.log_softmax(logits_NTV, -1).gather(-1, ids_NT[..., None])[..., 0], torch.logsumexp(logits_NTV, -1)


def _iq(logits_NTV, ids_NT, mask_NT=None, **kw):
    z = logits_NTV.clone().requires_grad_(True)
    logp, v = _terms(z, ids_NT)
    mask = torch.ones_like(logp) if mask_NT is None else mask_NT
    out = sft_losses.compute("iq_learn", logp, mask, logsumexp=v, **kw)
    (g,) = torch.autograd.grad(out.sum(), z)
    return out.detach(), g


# --- hand-computed example (catalog L147) ---------------------------------------------------------------------


def test_hand_example_and_the_implied_reward_identity():
    # position 0: logits [2, 1, 0], token 0: V(s0) = log(e^2 + e + 1) = 2.407606, log pi = 2 - 2.407606 = -0.407606
    # position 1: logits all c = 1.5 - log 3 (logsumexp 1.5), token 0: log pi = -log 3 = -1.098612, Q = c = 0.401388
    # gamma = 1: r_0 = Q_0 - V(s1) = 2 - 1.5 = 0.5; r_1 = Q_1 - 0 (the end) = 0.401388
    # coef = 0.1: l_0 = 0.407606 + 0.1 * 0.25 = 0.432606; l_1 = 1.098612 + 0.1 * 0.161112 = 1.114723
    c = 1.5 - math.log(3)
    logits = torch.tensor([[[2.0, 1.0, 0.0], [c, c, c]]])
    ids = torch.tensor([[0, 0]])
    logp, v = _terms(logits, ids)
    assert v[0].tolist() == pytest.approx([2.407606, 1.5], abs=1e-6)
    assert logp[0, 0].item() == pytest.approx(-0.407606, abs=1e-6)
    out, _ = _iq(logits, ids, coef=0.1)
    assert out[0].tolist() == pytest.approx([0.432606, 1.114723], abs=1e-6)
    # the identity: r_t + gamma V(s_{t+1}) - V(s_t) = log pi_t (0.5 + 1.5 - 2.407606 = -0.407606)
    mask = torch.ones(1, 2)
    r = logp + v - next_value(v, mask)
    torch.testing.assert_close(r + next_value(v, mask) - v, logp)
    assert r[0].tolist() == pytest.approx([0.5, c], abs=1e-6)
    # gamma discounts the next state's value: gamma = 0.5 -> r_0 = 2 - 0.75 = 1.25, l_0 = 0.407606 + 0.1 * 1.5625
    out, _ = _iq(logits, ids, coef=0.1, gamma=0.5)
    assert out[0, 0].item() == pytest.approx(0.407606 + 0.15625, abs=1e-6)


def test_next_value_skips_untrained_positions_and_ends_at_zero():
    # row 0: all trained -> [v1, v2, v3, 0]; row 1: an environment reply at positions 1-2 (attended, not trained):
    # the next state of position 0 is position 3 (after the reply), and position 3 is the last -> 0
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 1.0]])
    torch.testing.assert_close(next_value(v, mask), torch.tensor([[2.0, 3.0, 4.0, 0.0], [8.0, 8.0, 8.0, 0.0]]))


# --- invariants -----------------------------------------------------------------------------------------------


def test_mle_is_the_negative_log_likelihood_and_iq_learn_at_coef_zero():
    g = torch.Generator().manual_seed(0)
    logits, ids = torch.randn(3, 4, 6, generator=g), torch.randint(6, (3, 4), generator=g)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [0.0, 1.0, 1.0, 1.0]])
    logp, v = _terms(logits, ids)
    torch.testing.assert_close(sft_losses.compute("mle", logp, mask), -logp * mask)
    z = logits.clone().requires_grad_(True)
    lp, _ = _terms(z, ids)
    (g_mle,) = torch.autograd.grad(sft_losses.compute("mle", lp, mask).sum(), z)
    out, g_iq = _iq(logits, ids, mask, coef=0.0)
    torch.testing.assert_close(out, -logp * mask)
    torch.testing.assert_close(g_iq, g_mle)
    # masked positions get no loss
    out, _ = _iq(logits, ids, mask)
    assert (out[mask == 0] == 0).all() and (out[mask > 0] > 0).all()


# --- what sets it apart --------------------------------------------------------------------------------------


def test_the_td_term_ties_each_position_to_the_next_states_value():
    # MLE is one token at a time and blind to the logits' level (log softmax drops it). The TD term reads Q = the
    # chosen logit and V(s_{t+1}) = the next position's logsumexp: raising every logit of position 1 by 2 (the same
    # policy) changes l_0 through r_0 = Q_0 - V(s1) and l_1 through Q_1, and the gradient of l_0 reaches the
    # logits of position 1, along their all-ones direction (the level)
    g = torch.Generator().manual_seed(1)
    logits, ids = torch.randn(1, 2, 5, generator=g), torch.tensor([[1, 3]])
    raised = logits + torch.tensor([0.0, 2.0])[None, :, None]
    logp, _ = _terms(logits, ids)
    logp_r, _ = _terms(raised, ids)
    torch.testing.assert_close(sft_losses.compute("mle", logp, torch.ones(1, 2)),
                               sft_losses.compute("mle", logp_r, torch.ones(1, 2)))
    a, _ = _iq(logits, ids)
    b, _ = _iq(raised, ids)
    assert (a - b).abs().min().item() > 1e-3
    z = logits.clone().requires_grad_(True)
    lp, v = _terms(z, ids)
    out = sft_losses.compute("iq_learn", lp, torch.ones(1, 2), logsumexp=v)
    (g0,) = torch.autograd.grad(out[0, 0], z)
    assert g0[0, 1].abs().max().item() > 1e-3 and abs(g0[0, 1].sum().item()) > 1e-3
    # under MLE the first token's loss has no gradient at the next position
    (g_mle,) = torch.autograd.grad(-_terms(z, ids)[0][0, 0], z)
    assert g_mle[0, 1].abs().max().item() == 0.0


def test_the_td_term_pulls_the_implied_rewards_toward_zero():
    # for a fixed policy (log softmax fixed) the levels c_t are free: r_t = log pi_t + V_t + c_t - V_{t+1} - c_{t+1}
    # (r_T = log pi_T + V_T + c_T) is a triangular system, so the implied rewards can all be 0; gradient steps on
    # the levels alone drive the regularizer toward it and leave the log-likelihood where it was
    g = torch.Generator().manual_seed(2)
    logits, ids = torch.randn(2, 5, 7, generator=g) * 3, torch.randint(7, (2, 5), generator=g)
    level = torch.zeros(2, 5, 1, requires_grad=True)
    opt = torch.optim.SGD([level], lr=0.5)
    before = None
    for _ in range(200):
        logp, v = _terms(logits + level, ids)
        out = sft_losses.compute("iq_learn", logp, torch.ones(2, 5), logsumexp=v, coef=0.5)
        td = (out + logp).sum().detach()
        before = float(td) if before is None else before
        opt.zero_grad()
        out.sum().backward()
        opt.step()
    logp_after, v_after = _terms(logits + level.detach(), ids)
    after = float((sft_losses.compute("iq_learn", logp_after, torch.ones(2, 5), logsumexp=v_after, coef=0.5)
                   + logp_after).sum())
    torch.testing.assert_close(logp_after, _terms(logits, ids)[0])
    assert after < 0.01 * before, (before, after)


# --- config, the trainer and a short run ---------------------------------------------------------------------


def test_config_defaults_to_mle_and_checks_the_loss(tiny_cfg):
    assert tiny_cfg().sft.loss == "mle" and tiny_cfg().sft.loss_params == {}
    assert sft_losses.inputs("iq_learn") == ["logsumexp"] and sft_losses.inputs("mle") == []
    cfg = tiny_cfg("sft.loss=iq_learn", "sft.loss_params={coef=0.5, gamma=0.9}")
    assert cfg.sft.loss == "iq_learn"
    with pytest.raises(ConfigError, match="did you mean 'iq_learn'"):
        tiny_cfg("sft.loss=iq_lean")
    for bad in ("{coef=-1.0}", "{gamma=1.5}", "{beta=0.1}", "{logsumexp=1.0}"):
        with pytest.raises(ConfigError, match="sft.loss_params"):
            tiny_cfg("sft.loss=iq_learn", f"sft.loss_params={bad}")
    with pytest.raises(ConfigError, match="sft.loss_params"):
        tiny_cfg("sft.loss_params={coef=0.1}")  # mle takes no parameter


def test_demonstration_loss_is_the_token_mean_of_the_chosen_loss(tmp_path):
    # mle: the token-mean NLL it always was; iq_learn: the same forward with each position's logsumexp
    from posttrain.learn.logprobs import completion_logits
    from posttrain.models import TinySpec, build_tiny, load_model
    from posttrain.trainers.sft import demonstration_loss

    d = build_tiny(tmp_path / "m", TinySpec(alphabet="0123456789+=", hidden_size=32, intermediate_size=64,
                                            num_layers=2))
    model = load_model(str(d))
    prompts, targets = [[3, 4, 5], [3, 6]], [[7, 8, 9], [10, 11]]
    masks = [[1.0, 1.0, 1.0], [1.0, 0.0]]
    ids = torch.tensor([[7, 8, 9], [10, 11, 0]])
    attn = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    mask = torch.tensor(masks[0] + [1.0, 0.0, 0.0]).view(2, 3)
    with torch.no_grad():
        logits = completion_logits(model, prompts, ids, attn, pad_id=0)
        logp, v = _terms(logits, ids)
        mle = demonstration_loss(model, prompts, targets, masks, 0)
        iq = demonstration_loss(model, prompts, targets, masks, 0, "iq_learn", {"coef": 0.3})
    torch.testing.assert_close(mle, -(logp * mask).sum() / mask.sum(), atol=1e-5, rtol=1e-5)
    want = sft_losses.compute("iq_learn", logp, mask, logsumexp=v, coef=0.3)
    torch.testing.assert_close(iq, want.sum() / mask.sum(), atol=1e-5, rtol=1e-5)
    assert iq > mle


def test_sft_trains_with_iq_learn(tiny_cfg, quiet, tmp_path):
    from posttrain.trainers.sft import sft

    cfg = tiny_cfg("sft.loss=iq_learn", "sft.steps=4", "sft.demos=32", "sft.batch_size=8", "sft.eval_every=4",
                   "sft.eval_prompts=8", "sft.target_accuracy=1.0", "checkpoint.every=0")
    summary = sft(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert summary["steps"] == 4 and all(math.isfinite(r["sft/loss"]) for r in rows)
