"""ROVER (arXiv:2509.24981; posttrain/algorithms/losses_rover.py): the catalog's hand example, invariants, the
next-state term, the clip, the update's mean log-softmax inputs, and a short training run."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from posttrain.algorithms import losses
from posttrain.algorithms.losses_rover import next_state_term
from posttrain.config import ConfigError, LearnSettings
from posttrain.config.base import LOSS_INPUTS
from posttrain.learn.logprobs import mean_log_softmax


def _loss_and_grad(logp, old, adv, mask, m, m_old, **kw):
    x = logp.clone().requires_grad_(True)
    out = losses.compute("rover", x, old, adv, mask, mean_logsoftmax=m, old_mean_logsoftmax=m_old, **kw)
    (g,) = torch.autograd.grad(out.sum(), x)
    return out.detach(), g


# --- hand-computed example (catalog L227) ---------------------------------------------------------------


def test_hand_example():
    # one response of two tokens, A_hat = 1.0 on both; token 0: log pi_theta - log pi_old = 0.1, token 1: 0.
    # The state after token 0 (position 1) has m_theta - m_old = 0.02; position 0's dm (0.5) is never read.
    # token 0: Q = 1 * 0.1 = 0.1, next = 1 * 0.02 = 0.02, target = 1.0 + 0.02 = 1.02,
    #          l = (0.1 - 1.02)^2 = (-0.92)^2 = 0.8464; dl/dlogpi = 2 (Q - target) = -1.84
    # token 1 (the last): Q = 0, next = 0, target = 1.0, l = 1.0; dl/dlogpi = -2.0
    logp = torch.tensor([[-1.0, -2.0]])
    old = logp - torch.tensor([[0.1, 0.0]])
    m_old = torch.tensor([[-5.0, -6.0]])
    m = m_old + torch.tensor([[0.5, 0.02]])
    out, g = _loss_and_grad(logp, old, torch.tensor([1.0]), torch.ones(1, 2), m, m_old)
    assert out.flatten().tolist() == pytest.approx([0.8464, 1.0], abs=1e-6)
    assert g.flatten().tolist() == pytest.approx([-1.84, -2.0], abs=1e-6)
    # rover_t = rho scales Q and next: rho = 2 -> Q = 0.2, target = 1.04, l = (0.2 - 1.04)^2 = 0.7056
    out, _ = _loss_and_grad(logp, old, torch.tensor([1.0]), torch.ones(1, 2), m, m_old, rover_t=2.0)
    assert out[0, 0].item() == pytest.approx(0.7056, abs=1e-6)


# --- invariants --------------------------------------------------------------------------------------------


def test_zero_loss_and_gradient_when_q_equals_the_target():
    # Q_t = A + next_t on every token: the regression is solved, loss and gradient are 0
    g = torch.Generator().manual_seed(0)
    m, m_old = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)
    mask = torch.ones(3, 5)
    adv = torch.tensor([0.5, -1.0, 2.0])
    target = adv[:, None] + next_state_term(m, m_old, mask)
    old = torch.randn(3, 5, generator=g)
    out, grad = _loss_and_grad(old + target, old, adv, mask, m, m_old)
    assert out.abs().max().item() < 1e-10 and grad.abs().max().item() < 1e-6


def test_gradient_pulls_the_log_ratio_toward_the_target():
    # d l / d logpi = 2 (Q - target): below the target the loss raises log pi (negative gradient, the PG sign for
    # A > 0), above it lowers it; on-policy (Q = 0, next = 0) it is -2 A, twice the policy gradient
    old = torch.zeros(1, 3)
    mask = torch.ones(1, 3)
    z = torch.zeros(1, 3)
    _, g = _loss_and_grad(torch.tensor([[0.1, 0.5, 2.0]]), old, torch.tensor([1.0]), mask, z, z)
    assert g.flatten().tolist() == pytest.approx([2 * (0.1 - 1), 2 * (0.5 - 1), 2 * (2.0 - 1)], abs=1e-6)
    for a in (1.5, -0.7):
        _, g = _loss_and_grad(old, old, torch.tensor([a]), mask, z, z)
        assert g.flatten().tolist() == pytest.approx([-2 * a] * 3, abs=1e-6)
    # the next-state term is a target, not a path for the gradient: the loss reads its values only
    m = torch.randn(1, 3, requires_grad=True)
    out = losses.compute("rover", old.clone().requires_grad_(), old, torch.tensor([1.0]), mask,
                         mean_logsoftmax=m, old_mean_logsoftmax=z)
    assert not torch.autograd.grad(out.sum(), m, allow_unused=True)[0]


def test_next_state_term_is_zero_at_each_responses_last_token():
    # row 0 has 4 response tokens, row 1 has 2 (then padding): next_t = dm_{t+1} while t+1 is a response token,
    # 0 at the last response token (t = 3, t = 1) and on padding, whatever dm holds there
    dm = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0]])
    nxt = next_state_term(dm, torch.zeros_like(dm), mask)
    torch.testing.assert_close(nxt, torch.tensor([[0.2, 0.3, 0.4, 0.0], [0.6, 0.0, 0.0, 0.0]]))
    # through the loss: Q = 0, A = 0, so l_t = next_t^2 on the mask
    out, _ = _loss_and_grad(torch.zeros(2, 4), torch.zeros(2, 4), torch.zeros(2), mask, dm, torch.zeros_like(dm))
    torch.testing.assert_close(out, nxt**2 * mask)


def test_clip_freezes_q_only_on_the_offending_side():
    # eps = 0.2: bounds log 1.2 = 0.18232, log 0.8 = -0.22314. Token (Q, target):
    #   (0.3, 1.0): above the high bound and the target wants it higher -> Q = log 1.2, no gradient
    #   (0.3, 0.0): above the bound but the target pulls it down -> not clipped, gradient 2 (0.3 - 0) = 0.6
    #   (-0.5, -1.0): below the low bound, target lower still -> Q = log 0.8, no gradient
    #   (-0.5, 0.0): below the bound, target pulls it up -> not clipped, gradient 2 (-0.5) = -1.0
    logp = torch.tensor([[0.3], [0.3], [-0.5], [-0.5]])
    adv = torch.tensor([1.0, 0.0, -1.0, 0.0])
    z = torch.zeros(4, 1)
    out, g = _loss_and_grad(logp, z, adv, torch.ones(4, 1), z, z, use_rover_clip=True)
    hi, lo = math.log(1.2), math.log(0.8)
    assert out.flatten().tolist() == pytest.approx([(hi - 1) ** 2, 0.09, (lo + 1) ** 2, 0.25], abs=1e-6)
    assert g.flatten().tolist() == pytest.approx([0.0, 0.6, 0.0, -1.0], abs=1e-6)
    # off by default (the authors' script): the same tokens all keep their gradient
    _, g = _loss_and_grad(logp, z, adv, torch.ones(4, 1), z, z)
    assert (g != 0).all()


def test_mean_log_softmax_is_the_vocabulary_mean_and_at_most_minus_log_v():
    # m(s) = mean_a log softmax(z)_a (the authors' sum_log_softmax: mean_x - logsumexp); by Jensen
    # m <= log mean_a p_a = -log V, with equality for uniform logits
    z = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mean_log_softmax(z), torch.log_softmax(z, -1).mean(-1))
    assert (mean_log_softmax(z) <= -math.log(11) + 1e-6).all()
    assert mean_log_softmax(torch.zeros(1, 11)).item() == pytest.approx(-math.log(11), abs=1e-6)


# --- config and the update -----------------------------------------------------------------------------


def test_config_accepts_rover_and_rejects_bad_parameters(tiny_cfg):
    assert {"mean_logsoftmax", "old_mean_logsoftmax"} <= set(LOSS_INPUTS)
    assert losses.inputs("rover") == ["mean_logsoftmax", "old_mean_logsoftmax"]
    tiny_cfg("algorithm.loss=rover", "algorithm.loss_params={use_rover_clip=true, eps_low=0.1}")
    for bad in ("{rover_t=0.0}", "{eps_low=1.0}", "{eps_high=-0.1}"):
        with pytest.raises(ConfigError, match="rover"):
            tiny_cfg("algorithm.loss=rover", f"algorithm.loss_params={bad}")


def test_old_inputs_are_computed_only_when_the_loss_declares_them(tiny_cfg, monkeypatch):
    # pi_old's mean log-softmax comes from the same pass as the old log-probs ([N, T, 2]: log-probs, then the
    # term); a loss without the input gets the plain [N, T] call, and on-policy nothing is computed
    from posttrain.learn import update
    from posttrain.learn.update import logit_inputs, old_policy
    from posttrain.train.loop_state import Phases

    calls = []

    def fake(model, rows, rollouts, *, terms=(), **kw):
        calls.append(len(terms))
        base = torch.full((2, 3), -1.0)
        return torch.stack([base, *[torch.full((2, 3), -7.0) for _ in terms]], -1) if terms else base

    monkeypatch.setattr(update, "batched_logprobs", fake)  # count the passes the old policy asks for

    rollouts = SimpleNamespace(behaviour_logprobs=torch.full((2, 3), -2.0))
    mask = torch.ones(2, 3)
    lp = {"pad_id": 0, "temperature": 1.0, "budget": 0}
    rover_cfg, ppo_cfg = tiny_cfg("algorithm.loss=rover"), tiny_cfg()
    behaviour_cfg = tiny_cfg("algorithm.loss=rover", "algorithm.old_logprobs=behaviour")
    rover, ppo = Phases.from_config(rover_cfg).learn, Phases.from_config(ppo_cfg).learn
    assert logit_inputs(rover.loss_inputs) == ["mean_logsoftmax"] and logit_inputs(ppo.loss_inputs) == []

    old, rows = old_policy(None, [], rollouts, mask, rover, LearnSettings.of(rover_cfg), True, lp)
    assert calls == [1] and (old == -1.0).all() and set(rows) == {"old_mean_logsoftmax"}
    assert (rows["old_mean_logsoftmax"] == -7.0).all()
    old, rows = old_policy(None, [], rollouts, mask, ppo, LearnSettings.of(ppo_cfg), True, lp)
    assert calls == [1, 0] and (old == -1.0).all() and rows == {}
    old, rows = old_policy(None, [], rollouts, mask, rover, LearnSettings.of(rover_cfg), False, lp)  # on-policy
    assert calls == [1, 0] and old is None and rows == {}
    # behaviour log-probs as pi_old: the ratio's old log-probs are the sampler's, m_old still the learner's
    learn = Phases.from_config(behaviour_cfg).learn
    old, rows = old_policy(None, [], rollouts, mask, learn, LearnSettings.of(behaviour_cfg), True, lp)
    assert calls == [1, 0, 1] and (old == -2.0).all() and (rows["old_mean_logsoftmax"] == -7.0).all()


def test_the_update_feeds_the_temperature_scaled_mean_log_softmax(tiny_cfg, tmp_path, monkeypatch):
    # two minibatches of a rollout batch: the first sees pi_old (m_theta = m_old and the log-ratio is 0), the
    # second a moved policy (next_t != 0); both inputs are mean_a log softmax(logits / T) of the tiny model
    from posttrain.learn.logprobs import completion_logits
    from posttrain.learn.update import policy_update
    from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
    from posttrain.models.load import encode_chat
    from posttrain.rollout import SamplingParams, make_engine
    from posttrain.train.loop_state import Phases

    d = build_tiny(tmp_path / "m", TinySpec(alphabet="0123456789+=", hidden_size=32, intermediate_size=64,
                                            num_layers=2))
    model, tok = load_model(str(d)), load_tokenizer(str(d))
    prompts = [encode_chat(tok, q) for q in ("12+3=", "4+55=")]
    r = make_engine("hf", model, tok).generate(prompts, SamplingParams(max_new_tokens=6, n=4, temperature=0.6),
                                               seed=0)
    cfg = tiny_cfg("algorithm.loss=rover", "rollout.temperature=0.6", "train.lr=0.05")
    with torch.no_grad():
        logits = completion_logits(model, r.row_prompts, r.token_ids, r.attention_mask, pad_id=tok.pad_token_id,
                                   temperature=0.6)
    m_before = torch.log_softmax(logits, -1).mean(-1)
    seen = []
    real = losses.compute

    def spy(name, logp, old, adv, mask, **kw):
        seen.append({"logp": logp.detach().clone(), "old": old.clone(), "mask": mask.clone(),
                     **{k: v.detach().clone() for k, v in kw.items() if isinstance(v, torch.Tensor)}})
        return real(name, logp, old, adv, mask, **kw)

    monkeypatch.setattr(losses, "compute", spy)
    mbs = [torch.arange(0, 4), torch.arange(4, 8)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.5, -0.5])
    settings = LearnSettings.of(cfg)
    metrics = policy_update(model, None, opt, Phases.from_config(cfg).learn, settings, r.row_prompts, r, r.loss_mask,
                            adv, {}, tok.pad_token_id, 0, minibatches=mbs)
    assert metrics["train/optimizer_steps"] == 2.0 and len(seen) == 2
    for call, rows in zip(seen, mbs, strict=True):
        m = call["mask"].bool()
        torch.testing.assert_close(call["old_mean_logsoftmax"][m], m_before[rows][m], atol=1e-5, rtol=1e-5)
    first, second = seen
    m = first["mask"].bool()
    torch.testing.assert_close(first["mean_logsoftmax"][m], first["old_mean_logsoftmax"][m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(first["logp"][m], first["old"][m], atol=1e-5, rtol=1e-5)
    m = second["mask"].bool()
    assert (second["mean_logsoftmax"] - second["old_mean_logsoftmax"])[m].abs().max() > 1e-4  # the policy moved
    assert (second["mean_logsoftmax"][m] <= -math.log(logits.shape[-1]) + 1e-5).all()


def test_a_short_run_trains(tiny_cfg, quiet, tmp_path, test_entries):
    # two steps of the recipe's setting through the loop (4 minibatches, so three of each batch's are off-policy):
    # finite losses and the parameters change
    from transformers import AutoModelForCausalLM

    from posttrain.train.rl import train

    cfg = tiny_cfg("algorithm.loss=rover", "algorithm.loss_params={}", "train.steps=2", "train.minibatches=4",
                   "rollout.temperature=0.6", "checkpoint.every=2", "eval.every=0", 'reward=[{name="test_length"}]',
                   "train.lr=1e-2")
    train(cfg, console=quiet)
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["train/nonfinite"] == 0 and r["train/optimizer_steps"] == 4
               for r in rows)
    before = AutoModelForCausalLM.from_pretrained(run / "base_model").state_dict()
    after = AutoModelForCausalLM.from_pretrained(run / "checkpoints" / "step_000002").state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
