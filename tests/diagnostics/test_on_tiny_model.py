"""The diagnostics' defining cases, measured through the trainer's own code on a real tiny model."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.diagnostics import affinity, effective_rank, effective_rank_dynamics, entropy_stats
from posttrain.learn.logprobs import completion_logits, completion_logprobs
from posttrain.models.load import load_model, load_tokenizer
from posttrain.models.tiny import TinySpec, build_tiny
from posttrain.rollout import HFEngine, SamplingParams
from posttrain.train.diagnose import expensive_diagnostics, final_hidden_states


@torch.no_grad()
def token_entropies(model: torch.nn.Module, rows: list[list[int]], rollouts: object, pad_id: int) -> torch.Tensor:
    """The policy's entropy at every completion token, 0 off the loss mask (what Learner.token_entropies computes)."""
    _, h = completion_logprobs(model, rows, rollouts.token_ids, rollouts.attention_mask, pad_id=pad_id,
                               with_entropy=True)
    return h.float() * rollouts.loss_mask.float()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(build_tiny(tmp_path_factory.mktemp("m"), TinySpec(alphabet="0123456789+=", hidden_size=32,
                                                                 intermediate_size=64, num_layers=2,
                                                                 max_positions=32)))
    model, tok = load_model(path).eval(), load_tokenizer(path)
    prompts = [tok("12+34=")["input_ids"], tok("7+8=")["input_ids"]]
    rollouts = HFEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=6, n=4),
                                          seed=0)
    rows = [p for p in prompts for _ in range(4)]
    return model, tok, rollouts, rows


def test_entropy_of_a_uniform_policy_is_log_v(tiny):
    model, tok, rollouts, rows = tiny
    uniform = type(model)(model.config)
    uniform.load_state_dict(model.state_dict())
    with torch.no_grad():
        uniform.lm_head.weight.zero_()  # every logit 0: the uniform distribution over the vocabulary
    h = token_entropies(uniform, rows, rollouts, tok.pad_token_id)
    log_v = math.log(model.config.vocab_size)
    assert h[rollouts.loss_mask.bool()] == pytest.approx(torch.full((int(rollouts.loss_mask.sum()),), log_v), abs=1e-5)
    logits = completion_logits(uniform, rows, rollouts.token_ids, rollouts.loss_mask, pad_id=tok.pad_token_id)
    stats = entropy_stats(logits, rollouts.loss_mask)
    assert stats["entropy_mean"] == pytest.approx(log_v, abs=1e-5)
    assert stats["entropy_top_mean"] == pytest.approx(log_v, abs=1e-5)


def test_affinity_of_the_on_policy_batch_is_one(tiny):
    model, tok, rollouts, rows = tiny
    # the trainer's recomputed log-probs against the sampler's: the same policy, so every ratio is 1
    logp, _ = completion_logprobs(model, rows, rollouts.token_ids, rollouts.loss_mask, pad_id=tok.pad_token_id)
    a = affinity(logp, rollouts.behaviour_logprobs, rollouts.loss_mask)
    assert a["eur"] == 1.0
    assert a["affinity"] == pytest.approx(1.0, abs=1e-3)


def test_effective_rank_of_the_tiny_models_hidden_states(tiny):
    model, tok, rollouts, rows = tiny
    hidden = final_hidden_states(model, rows, rollouts.token_ids, rollouts.loss_mask, tok.pad_token_id)
    assert hidden.shape[:2] == rollouts.loss_mask.shape and hidden.shape[2] == model.config.hidden_size
    er = effective_rank(hidden, rollouts.loss_mask)
    lengths = rollouts.loss_mask.sum(1)
    assert ((er >= 1.0 - 1e-6) & (er <= lengths + 1e-4)).all()  # at most the number of tokens
    # identity-like states (one token per hidden direction) have full effective rank
    eye = torch.eye(model.config.hidden_size)
    assert float(effective_rank(eye, center=False)) == pytest.approx(model.config.hidden_size, rel=1e-4)


@pytest.mark.parametrize("stride", [0, 1, 2])
def test_erv_and_era_are_each_responses_prefix_dynamics_averaged(tiny, stride):
    # VERL (catalog 3.8): ERV / ERA come from the effective rank of growing token prefixes of ONE response, then
    # average over the responses; the first call already has them (no earlier step needed)
    model, tok, rollouts, rows = tiny
    metrics, state = expensive_diagnostics(model, None, rows, rollouts.token_ids, rollouts.loss_mask,
                                           pad_id=tok.pad_token_id,
                                           temperature=1.0, samples=8, rank_state={}, stride=stride)
    hidden = final_hidden_states(model, rows, rollouts.token_ids, rollouts.loss_mask, tok.pad_token_id)
    # stride 0: max(1, T // 16) per response, 1 for these responses of at most 6 tokens
    per = [effective_rank_dynamics(hidden[i][rollouts.loss_mask[i].bool()], stride=stride or 1) for i in range(8)]
    erv = [v for _, v, _ in per if not math.isnan(v)]
    era = [a for _, _, a in per if not math.isnan(a)]
    assert erv and metrics["diag/erv"] == pytest.approx(sum(erv) / len(erv), rel=1e-5)
    if era:
        assert metrics["diag/era"] == pytest.approx(sum(era) / len(era), rel=1e-5)
    else:  # stride 2 on responses of at most 6 tokens: two prefixes, one velocity, no acceleration
        assert stride == 2 and math.isnan(metrics["diag/era"])
    assert math.isnan(metrics["diag/erv_steps"])  # across steps: one measurement so far
    assert state["count"] == 1
