"""Teacher-forcing-induced step reward (Hao et al. 2022, arXiv:2210.08708; catalog 3.14) and tf_reward."""

import json
import math

import pytest
import torch

from posttrain.algorithms import advantages
from posttrain.config import load_config
from posttrain.train import rl
from tests.conftest import ROOT


def _from_logits(logits_NTV, ids_NT, mask_NT):
    """The Learner's two inputs from full logits: log p of the taken token and the log-partition V."""
    v = torch.logsumexp(logits_NTV, -1)
    logp = logits_NTV.gather(-1, ids_NT[..., None])[..., 0] - v
    return advantages.induced_token_rewards(logp, v, mask_NT)


def test_hand_computed():
    # f(a_t|s_t) = logp_t + V_t = [-0.5 + 2, -1 + 3, -0.2 + 1] = [1.5, 2.0, 0.8]; V(s_{t+1}) = [3, 1, 0]
    # r = f - V_next = [-1.5, 1.0, 0.8]; its sum 0.3 = sum logp (-1.7) + V(s_1) (2)
    logp = torch.tensor([[-0.5, -1.0, -0.2, 0.0]])
    v = torch.tensor([[2.0, 3.0, 1.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])  # the last slot is padding: no reward, and V there is not read
    r = advantages.induced_token_rewards(logp, v, mask)
    torch.testing.assert_close(r, torch.tensor([[-1.5, 1.0, 0.8, 0.0]]))
    # tf_reward, outcome_coef 0: returns G = [0.3, 1.8, 0.8]; one response, so whitening over its 3 tokens:
    # mean 0.966667, unbiased std sqrt(((-0.666667)^2 + 0.833333^2 + (-0.166667)^2) / 2) = 0.763763
    adv = advantages.compute("tf_reward", torch.tensor([[1.0]]), mask=mask[None], induced_rewards=r[None],
                             outcome_coef=0.0)
    torch.testing.assert_close(adv[0, 0, :3], torch.tensor([-0.872872, 1.091089, -0.218218]), atol=1e-5, rtol=0)
    assert adv[0, 0, 3] == 0


def test_soft_bellman_holds_and_logits_are_q_values():
    # the logits read as soft Q-values satisfy Q(s_t, a_t) = r_t + V(s_{t+1}) exactly, V = logsumexp Q
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=g) * 2
    ids = torch.randint(0, 7, (3, 5), generator=g)
    mask = torch.ones(3, 5)
    r = _from_logits(logits, ids, mask)
    q = logits.gather(-1, ids[..., None])[..., 0]
    v_next = torch.cat([torch.logsumexp(logits, -1)[:, 1:], torch.zeros(3, 1)], 1)
    torch.testing.assert_close(q, r + v_next)


def test_a_state_wise_logit_shift_is_potential_shaping():
    # adding c_t to every logit at position t leaves the MLE policy unchanged and shapes the reward with the
    # potential c: r'_t = r_t + c_t - c_{t+1}; a response's return moves only by c_1 (a constant of its prompt),
    # so the induced reward and the log-likelihood reward rank a prompt's responses alike, token credit aside
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 6, 5, generator=g)
    ids = torch.randint(0, 5, (4, 6), generator=g)
    mask = torch.ones(4, 6)
    c = torch.randn(1, 6, generator=g).expand(4, 6)  # one shift per position, the same state for every row
    r, r2 = _from_logits(logits, ids, mask), _from_logits(logits + c[..., None], ids, mask)
    c_next = torch.cat([c[:, 1:], torch.zeros(4, 1)], 1)
    torch.testing.assert_close(r2, r + c - c_next)
    torch.testing.assert_close(r2.sum(-1) - r.sum(-1), c[:, 0])
    # the return equals the log-likelihood plus V(s_1): the log-likelihood reward shaped by V
    v = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, ids[..., None])[..., 0] - v
    torch.testing.assert_close(r.sum(-1), logp.sum(-1) + v[:, 0])
    assert (r != 0).all()  # dense: a reward at every step, unlike an outcome reward on the last token


def test_masked_positions_cut_the_chain_and_invariants():
    logp = torch.tensor([[-1.0, -2.0, -0.5, -0.3]])
    v = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    # a masked slot in the middle (an observation in a multi-turn row): V there is not read, the chain is cut
    r = advantages.induced_token_rewards(logp, v, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    # r_0 = (-1 + 1) - 2 = -2; r_1 = (-2 + 2) - 0 = 0; r_2 = 0 (masked); r_3 = (-0.3 + 4) - 0 = 3.7
    torch.testing.assert_close(r, torch.tensor([[-2.0, 0.0, 0.0, 3.7]]))
    # tf_reward with outcome_coef 1 and coef 0 is reinforce_pp on the outcome; with both, reinforce_pp on their sum
    rewards = torch.tensor([[1.0, 0.0]])
    mask = torch.ones(1, 2, 3)
    ind = torch.randn(1, 2, 3, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(advantages.compute("tf_reward", rewards, mask=mask, induced_rewards=ind, coef=0.0),
                               advantages.compute("reinforce_pp", rewards, mask=mask))
    torch.testing.assert_close(advantages.compute("tf_reward", rewards, mask=mask, induced_rewards=ind, coef=0.5),
                               advantages.compute("reinforce_pp", rewards, mask=mask, token_rewards=0.5 * ind))


def test_recipe_smoke(tmp_path, quiet):
    # two steps of recipes/tf_reward.toml on the tiny model: the frozen reference is loaded, the Learner provides
    # the induced rewards, the loss is finite
    cfg = load_config(ROOT / "recipes" / "tf_reward.toml", [
        f'out="{tmp_path / "run"}"', "train.steps=2", "log.progress=false", "log.tensorboard=false",
        "log.plot_groups=false", "checkpoint.every=0", "eval.every=0"])
    rl.train(cfg, console=quiet)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) for r in rows)


def test_config_needs_no_kl_for_the_reference():
    from posttrain.train.loop_state import Phases

    cfg = load_config(ROOT / "recipes" / "tf_reward.toml", [])
    phases = Phases.from_config(cfg)
    assert cfg.algorithm.kl_coef == 0 and cfg.algorithm.kl_reward_coef == 0
    assert phases.prepare.inputs == ("induced_rewards",) and phases.learn.needs_reference


@pytest.mark.parametrize("coef", [0.0, 1.0])
def test_zero_outcome_coef_ignores_the_verifier(coef):
    mask = torch.ones(2, 2, 3)
    ind = torch.randn(2, 2, 3, generator=torch.Generator().manual_seed(3))
    a = advantages.compute("tf_reward", torch.tensor([[1.0, 0.0], [0.0, 0.0]]), mask=mask, induced_rewards=ind,
                           outcome_coef=0.0, coef=coef + 1)
    b = advantages.compute("tf_reward", torch.tensor([[0.0, 5.0], [2.0, 0.0]]), mask=mask, induced_rewards=ind,
                           outcome_coef=0.0, coef=coef + 1)
    torch.testing.assert_close(a, b)


def test_the_reference_log_partition_forward_equals_the_whole_batch(tmp_path):
    # the Learner's forward (micro-batched by a token budget) gives the reference's log-probs and logsumexp of its
    # temperature-scaled logits, as one pass through the full [N, T, V] logits does
    from posttrain.learn.forwards import FORWARDS
    from posttrain.learn.logprobs import completion_logits
    from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer
    from posttrain.rollout import HFEngine, SamplingParams

    d = build_tiny(tmp_path / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=2))
    model, tok = load_model(str(d)).eval(), load_tokenizer(str(d))
    prompts = [encode_chat(tok, "12+34="), encode_chat(tok, "7+5=")]
    rollouts = HFEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=5, temperature=0.8, n=2), seed=0)
    rows = [p for p in prompts for _ in range(2)]
    logits = completion_logits(model, rows, rollouts.token_ids, rollouts.attention_mask, pad_id=tok.pad_token_id,
                               temperature=0.8, share_prefix=False).float()
    v = torch.logsumexp(logits, -1)
    logp = logits.gather(-1, rollouts.token_ids[..., None])[..., 0] - v
    on = rollouts.attention_mask == 1
    fn, role = FORWARDS["reference_log_partition"]
    assert role == "reference"
    for budget, packing in ((0, False), (len(rows[0]) + 6, False), (0, True)):  # one pass; ~a row a pass; packed
        got = fn(model, rows, rollouts, pad_id=tok.pad_token_id, temperature=0.8, budget=budget, packing=packing)
        assert got.shape == (*rollouts.token_ids.shape, 2)
        torch.testing.assert_close(got[..., 0][on], logp[on], atol=1e-5, rtol=0)
        torch.testing.assert_close(got[..., 1][on], v[on], atol=1e-5, rtol=0)
