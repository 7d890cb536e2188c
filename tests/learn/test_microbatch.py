"""Micro-batching by a token budget and chunked log-probs: the same loss and gradients as one batch."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from posttrain.config import ConfigError, LearnSettings
from posttrain.learn.chunked import token_logprobs
from posttrain.learn.logprobs import completion_logits, completion_terms, logprobs_from_logits
from posttrain.learn.parts import clip_band
from posttrain.learn.shard import plan_micro_batches
from posttrain.learn.update import aggregation_weights, policy_update
from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
from posttrain.models.load import encode_chat
from posttrain.rollout import SamplingParams, make_engine
from posttrain.train.loop_state import Phases


def test_plan_keeps_rows_in_order_within_the_budget():
    # rows of 5, 5, 5, 12, 3 tokens, budget 10: [5, 5] | [5] | [12] (over budget: alone) | [3]
    runs = plan_micro_batches([5, 5, 5, 12, 3], 10)
    assert [r.tolist() for r in runs] == [[0, 1], [2], [3], [4]]
    assert [r.tolist() for r in plan_micro_batches([5, 5], 0)] == [[0, 1]]  # 0: one run


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"])
def test_aggregation_weights_reproduce_the_aggregate(mode):
    from posttrain.algorithms import aggregation

    g = torch.Generator().manual_seed(0)
    loss, mask = torch.randn(5, 7, generator=g), (torch.rand(5, 7, generator=g) > 0.3).float()
    w = aggregation_weights(lambda x, m: aggregation.reduce(mode, x, m), mask)
    torch.testing.assert_close((w * loss).sum(), aggregation.reduce(mode, loss, mask))
    # token_mean by hand: w = mask / (number of tokens)
    if mode == "token_mean":
        torch.testing.assert_close(w, mask / mask.sum())


def test_chunked_head_equals_full_logits_values_and_gradients():
    g = torch.Generator().manual_seed(1)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5), generator=g)

    def ent_term(logits):  # an entropy bonus's shape of term: [1, C, V] -> [1, C]
        return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1)

    logp, (term,), ent = token_logprobs(head, hidden, ids, temperature=0.7, with_entropy=True, terms=[ent_term],
                                        chunk_tokens=4)  # 15 positions: chunks of 4, 4, 4, 3
    (logp.sum() + term.sum()).backward()
    got = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad, head.weight.grad = None, None
    full = head(hidden) / 0.7
    want_logp, want_ent = logprobs_from_logits(full, ids, with_entropy=True)
    (want_logp.sum() + ent_term(full).sum()).backward()
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(ent, want_ent)
    torch.testing.assert_close(term, ent_term(full))
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], head.weight.grad)


@pytest.mark.parametrize("keep_bytes", [1 << 30, 0])  # probabilities kept for the backward / recomputed there
@pytest.mark.parametrize("bias", [False, True])
def test_fused_head_equals_autograd_through_full_logits(keep_bytes, bias, monkeypatch):
    from posttrain.learn import fused_head

    monkeypatch.setattr(fused_head, "KEEP_BYTES", keep_bytes)
    g = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(8, 11, bias=bias)
    hidden = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    w = torch.randn(3, 5, generator=g)  # dL/dlogp differs per token
    logp, terms, ent = token_logprobs(head, hidden, ids, temperature=0.7, with_entropy=True, chunk_tokens=4)
    assert terms == [] and not ent.requires_grad
    (w * logp).sum().backward()
    got = [hidden.grad.clone()] + [p.grad.clone() for p in head.parameters()]
    hidden.grad = None
    head.zero_grad(set_to_none=True)
    want_logp, want_ent = logprobs_from_logits(head(hidden) / 0.7, ids, with_entropy=True)
    (w * want_logp).sum().backward()
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(ent, want_ent)
    for a, b in zip(got, [hidden.grad] + [p.grad for p in head.parameters()], strict=True):
        torch.testing.assert_close(a, b)


def test_fused_head_by_hand():
    # one position, V = 3, logits z = (0, ln 2, ln 5) (h = 1, W = z), target 1: p = (1, 2, 5) / 8,
    # log pi(1) = ln(2/8); with dL/dlogp = 1 the logits' gradient is onehot - p = (-1/8, 6/8, -5/8),
    # so dL/dW = that x h = (-0.125, 0.75, -0.625), dL/dh = sum_v (onehot - p)_v z_v
    # = 0.75 ln 2 - 0.625 ln 5; entropy = -sum p ln p = ln 8 - (2 ln 2 + 5 ln 5) / 8
    import math

    head = torch.nn.Linear(1, 3, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.tensor([[0.0], [math.log(2)], [math.log(5)]]))
    h = torch.ones(1, 1, 1, requires_grad=True)
    logp, _, ent = token_logprobs(head, h, torch.tensor([[1]]), with_entropy=True)
    logp.sum().backward()
    assert logp.item() == pytest.approx(math.log(2 / 8), abs=1e-6)
    assert ent.item() == pytest.approx(math.log(8) - (2 * math.log(2) + 5 * math.log(5)) / 8, abs=1e-6)
    torch.testing.assert_close(head.weight.grad[:, 0], torch.tensor([-0.125, 0.75, -0.625]))
    assert h.grad.item() == pytest.approx(0.75 * math.log(2) - 0.625 * math.log(5), abs=1e-6)


def test_completion_terms_match_the_models_own_logits(tmp_path):
    d = build_tiny(tmp_path / "m", TinySpec(alphabet="0123456789+="))
    model, tok = load_model(str(d)), load_tokenizer(str(d))
    prompts = [encode_chat(tok, "12+3="), encode_chat(tok, "4+55=")]
    r = make_engine("hf", model, tok).generate(prompts, SamplingParams(max_new_tokens=6, n=3), seed=0)
    rows = r.row_prompts
    for share in (True, False):
        logp, ent, _ = completion_terms(model, rows, r.token_ids, r.attention_mask, pad_id=tok.pad_token_id,
                                        temperature=0.9, with_entropy=True, share_prefix=share)
        logits = completion_logits(model, rows, r.token_ids, r.attention_mask, pad_id=tok.pad_token_id,
                                   temperature=0.9, share_prefix=share)
        want_lp, want_ent = logprobs_from_logits(logits, r.token_ids, with_entropy=True)
        m = r.attention_mask.bool()
        torch.testing.assert_close(logp[m], want_lp[m], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ent[m], want_ent[m], atol=1e-5, rtol=1e-5)


def _update_grads(cfg, tmp_path, budget: int):
    d = tmp_path / "m"
    if not d.exists():
        build_tiny(d, TinySpec(alphabet="0123456789+=", hidden_size=32, intermediate_size=64, num_layers=2))
    model, tok = load_model(str(d)), load_tokenizer(str(d))
    ref = load_model(str(d))
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    prompts = [encode_chat(tok, q) for q in ("12+3=", "4+555=", "7+8=")]
    r = make_engine("hf", model, tok).generate(prompts, SamplingParams(max_new_tokens=7, n=4), seed=3)
    adv = torch.linspace(-1, 1, 12)
    inputs = {"rewards": (adv > 0).float(), "group_ids": r.group_ids}
    cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"micro_batch_tokens": budget})})
    parts = Phases.from_config(cfg).learn
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # keep the weights: compare the gradients
    metrics = policy_update(model, ref, opt, parts, LearnSettings.of(cfg), r.row_prompts, r, r.loss_mask, adv, inputs,
                            tok.pad_token_id, 0)
    return metrics, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "overrides",
    [
        ("algorithm.aggregation=token_mean",),
        ("algorithm.aggregation=seq_mean_token_mean", "algorithm.kl_coef=0.1", 'algorithm.entropy="entropy_bonus"'),
        ("algorithm.aggregation=seq_mean_token_sum_norm", "algorithm.loss=gspo"),
    ],
)
def test_micro_batches_give_the_loss_and_gradients_of_one_batch(overrides, tiny_cfg, tmp_path):
    cfg = tiny_cfg("train.grad_clip=1e9", *overrides)
    one, g_one = _update_grads(cfg, tmp_path, budget=0)
    many, g_many = _update_grads(cfg, tmp_path, budget=20)  # a row is ~10-16 tokens: 1-2 rows a micro-batch
    assert one["loss"] == pytest.approx(many["loss"], abs=1e-5)
    assert one["policy/entropy"] == pytest.approx(many["policy/entropy"], abs=1e-5)
    for a, b in zip(g_one, g_many, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    assert any(g.abs().sum() > 0 for g in g_one)


def test_row_coupled_losses_cannot_be_micro_batched(tiny_cfg):
    with pytest.raises(ConfigError, match="couples the rows"):
        tiny_cfg("train.micro_batch_tokens=64", "algorithm.loss=drpo")
    tiny_cfg("train.micro_batch_tokens=64")  # ppo_clip: fine


def test_a_loss_alone_gets_its_own_defaults(tiny_cfg):
    # cispo's band is (1.0, 0.2), gspo's (3e-4, 4e-4): not PPO's (0.2, 0.2)
    assert Phases.from_config(tiny_cfg("algorithm.loss=cispo")).learn.clip_band == (1.0, 0.2)
    assert Phases.from_config(tiny_cfg("algorithm.loss=gspo")).learn.clip_band == (3e-4, 4e-4)
    assert clip_band("ppo_clip", {"eps_high": 0.28}) == (0.2, 0.28)
    for name in ("sapo", "reinforce"):  # were rejected: PPO's band was the default loss_params
        tiny_cfg(f"algorithm.loss={name}")


MEMORY_PROBE = """
import json, resource, torch
from posttrain.learn.chunked import token_logprobs
torch.manual_seed(0)
N, T, H, V = 64, 512, 32, 49152
head = torch.nn.Linear(H, V, bias=False)
hidden = torch.randn(N, T, H, requires_grad=True)
ids = torch.randint(0, V, (N, T))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
logp, _, ent = token_logprobs(head, hidden, ids, with_entropy=True)
(logp.sum()).backward()
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"added_mib": (after - before) / 1024, "finite": bool(torch.isfinite(hidden.grad).all())}))
"""


def test_logprobs_over_64x512_tokens_with_a_49k_vocabulary_add_under_1_gib():
    # full fp32 logits would be 64 * 512 * 49152 * 4 B = 6.4 GB (twice that with log_softmax)
    out = subprocess.run([sys.executable, "-c", MEMORY_PROBE], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["finite"]
    assert got["added_mib"] < 1024, got
