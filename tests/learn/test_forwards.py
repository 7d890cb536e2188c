"""The Learner's forward passes for the other phases (token entropies, prompt and reference log-probs, the
critic's values): equal to one whole-batch computation through the full logits, at any
``train.micro_batch_tokens``, with no forward holding more rows than the budget allows."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from posttrain.config import LearnSettings
from posttrain.learn.critic import Critic, completion_values, load_value_model
from posttrain.learn.learner import Learner
from posttrain.learn.logprobs import completion_logits, logprobs_from_logits
from posttrain.learn.shard import plan_micro_batches
from posttrain.models import TinySpec, build_tiny, encode_chat, load_model, load_tokenizer
from posttrain.rollout import HFEngine, SamplingParams
from posttrain.rollout.hf import left_pad
from posttrain.train.loop_state import Phases

TEMPERATURE = 0.8
G = 3


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A tiny policy, a reference that differs from it, a critic with a non-zero head, and a sampled batch of
    three prompts of different lengths, G = 3 responses each."""
    d = build_tiny(tmp_path_factory.mktemp("m") / "m", TinySpec(hidden_size=32, intermediate_size=64, num_layers=2))
    model, tok = load_model(str(d)).eval(), load_tokenizer(str(d))
    ref = load_model(str(d)).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    critic, _ = load_value_model(str(d))
    with torch.no_grad():
        critic.score.weight.normal_(generator=torch.Generator().manual_seed(0))
    prompts = [encode_chat(tok, "12+34="), encode_chat(tok, "7+5="), encode_chat(tok, "123+4567=")]
    rollouts = HFEngine(model, tok).generate(prompts, SamplingParams(max_new_tokens=6, temperature=TEMPERATURE, n=G),
                                          seed=0)
    rows = [p for p in prompts for _ in range(G)]
    return model, ref, critic, tok, prompts, rows, rollouts


def learner(tiny_cfg, world, budget: int) -> Learner:
    """A learner over the world's models whose forwards hold at most ``budget`` tokens."""
    model, ref, critic, tok, *_ = world
    cfg = tiny_cfg(f"train.micro_batch_tokens={budget}", f"rollout.temperature={TEMPERATURE}")
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    learn = Phases.from_config(cfg).learn
    settings = LearnSettings.of(cfg)
    return Learner(model, opt, sched, learn, settings, tok.pad_token_id, ref, Critic.around(critic, settings))


def full_logprobs(model, rows, rollouts, pad_id):
    """Log-probs and entropies ``[N, T]`` from the whole batch's ``[N, T, V]`` logits (one forward, no sharing)."""
    logits = completion_logits(model, rows, rollouts.token_ids, rollouts.attention_mask, pad_id=pad_id,
                               temperature=TEMPERATURE, share_prefix=False)
    return logprobs_from_logits(logits, rollouts.token_ids, with_entropy=True)


def budgets(world) -> list[int]:
    """0 (one pass) and a budget of about two rows (several micro-batches, groups cut in the middle)."""
    *_, rows, rollouts = world
    width = rollouts.token_ids.shape[1]
    small = 2 * min(len(p) for p in rows) + 2 * width
    runs = plan_micro_batches([len(p) + width for p in rows], small)
    assert len(runs) >= 4 and any(len(r) % G for r in runs)  # several micro-batches, some splitting a group
    return [0, small]


def test_token_entropies_equal_the_whole_batch(tiny_cfg, world):
    model, _, _, tok, _, rows, rollouts = world
    _, want = full_logprobs(model, rows, rollouts, tok.pad_token_id)
    want = want * rollouts.loss_mask  # 0 off the loss mask
    for budget in budgets(world):
        got = learner(tiny_cfg, world, budget).token_entropies(rows, rollouts)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (want[rollouts.loss_mask == 1] > 0).all()


def test_reference_logprobs_equal_the_whole_batch(tiny_cfg, world):
    model, ref, _, tok, _, rows, rollouts = world
    want, _ = full_logprobs(ref, rows, rollouts, tok.pad_token_id)
    on = rollouts.attention_mask == 1
    for budget in budgets(world):
        got = learner(tiny_cfg, world, budget).reference_logprobs(rows, rollouts)
        torch.testing.assert_close(got[on], want[on], atol=1e-5, rtol=0)
    policy, _ = full_logprobs(model, rows, rollouts, tok.pad_token_id)  # the reference's, not the policy's
    assert (policy[on] - want[on]).abs().max() > 1e-3


def test_values_equal_the_whole_batch(tiny_cfg, world):
    _, _, critic, tok, _, rows, rollouts = world
    mask = rollouts.loss_mask.float()
    mask[1] = 0.0  # a row whose reward is invalid: no values
    want = completion_values(critic, rows, rollouts.token_ids, rollouts.attention_mask, pad_id=tok.pad_token_id) * mask
    for budget in budgets(world):
        got = learner(tiny_cfg, world, budget).values(rows, rollouts, mask)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert (got[1] == 0).all() and got[0].abs().sum() > 0


def test_prompt_logprobs_equal_the_whole_batch(tiny_cfg, world):
    model, _, _, tok, prompts, *_ = world
    # the whole batch: left-padded to the longest prompt, [P, L, V] logits, log-prob of each next token
    ids, attn = left_pad(prompts, tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0)).logits
    want = (logits[:, :-1].float() / TEMPERATURE).log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    want_mask = attn[:, 1:] * attn[:, :-1]
    shortest = min(map(len, prompts))
    for budget in (0, shortest + 1):  # one prompt per micro-batch, each padded to its own length
        lp, mask = learner(tiny_cfg, world, budget).prompt_logprobs(prompts)
        assert torch.equal(mask, want_mask)
        torch.testing.assert_close(lp, want * want_mask, atol=1e-5, rtol=0)
    assert [int(m.sum()) for m in want_mask] == [len(p) - 1 for p in prompts]


def rows_per_forward(module: torch.nn.Module, call) -> list[int]:
    """The batch size of every forward of ``module``'s transformer body while ``call()`` runs (a hook that only
    observes)."""
    seen: list[int] = []

    def hook(mod, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        seen.append(int(ids.shape[0]))

    handle = module.base_model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        call()
    finally:
        handle.remove()
    return seen


def test_no_forward_holds_more_rows_than_the_budget(tiny_cfg, world):
    model, ref, critic, _, prompts, rows, rollouts = world
    width = rollouts.token_ids.shape[1]
    shortest = min(len(p) for p in rows) + width  # the fewest tokens a row has
    budget = budgets(world)[1]
    fit = budget // shortest  # no micro-batch can hold more rows than this
    mask = rollouts.loss_mask.float()
    for b, bound in ((0, len(rows)), (budget, fit)):
        lrn = learner(tiny_cfg, world, b)
        for module, call in ((model, partial(lrn.token_entropies, rows, rollouts)),
                             (ref, partial(lrn.reference_logprobs, rows, rollouts)),
                             (critic, partial(lrn.values, rows, rollouts, mask))):
            seen = rows_per_forward(module, call)
            assert seen and max(seen) <= bound, (b, seen)
            if b == 0:
                assert max(seen) == len(rows)  # one pass over every row
            else:
                assert len(seen) > 2  # several passes
    # prompts: a budget of the shortest prompt + 1 tokens holds one prompt per forward
    for b, bound in ((0, len(prompts)), (min(map(len, prompts)) + 1, 1)):
        seen = rows_per_forward(model, partial(learner(tiny_cfg, world, b).prompt_logprobs, prompts))
        assert max(seen) == bound and len(seen) == len(prompts) // bound
