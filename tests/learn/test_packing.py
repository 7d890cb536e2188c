"""train.packing (posttrain/learn/packing.py): a micro-batch's rows packed into one sequence, with per-row
positions and attention that never crosses rows, give the unpacked log-probs, loss and gradients."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AttentionInterface, LlamaConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import create_causal_mask

from posttrain.config import ConfigError, LearnSettings, load_config
from posttrain.learn.logprobs import completion_logits, completion_terms, mean_log_softmax
from posttrain.learn.packing import check_packing, pack_rows, real_lengths, row_tokens, to_rows, unpack
from posttrain.learn.update import batched_logprobs, policy_update
from posttrain.models import TinySpec, build_tiny, load_model, load_tokenizer
from posttrain.models.attention import attention
from posttrain.models.checkpointing import enable_checkpointing
from posttrain.models.load import encode_chat
from posttrain.planning.plan import Arch, estimate
from posttrain.rollout import SamplingParams, make_engine
from posttrain.train.loop_state import Phases
from posttrain.train.rl import train


@pytest.fixture(scope="module")
def tiny_batch(tmp_path_factory):
    """A tiny model and one sampled batch of 3 prompts x 4 completions of mixed lengths (a group shares a prompt)."""
    d = tmp_path_factory.mktemp("pack") / "m"
    build_tiny(d, TinySpec(alphabet="0123456789+=", hidden_size=32, intermediate_size=64, num_layers=3))
    model, tok = load_model(str(d)), load_tokenizer(str(d))
    prompts = [encode_chat(tok, q) for q in ("12+3=", "4+555=", "7+8=")]
    r = make_engine("hf", model, tok).generate(prompts, SamplingParams(max_new_tokens=7, n=4), seed=3)
    lengths = r.attention_mask.sum(1)
    assert lengths.min() < lengths.max() == r.token_ids.shape[1], lengths  # padded rows beside full ones
    return str(d), tok.pad_token_id, r


def test_pack_rows_hand_example():
    # prompts [5, 6] and [7]; completions [1, 2, 3] and [4] (then padding): row 0 packs as 5 6 1 2 (its last token 3
    # predicts nothing), row 1 as 7; completion token t of a row is predicted at its prompt's last position + t
    pack = pack_rows([[5, 6], [7]], torch.tensor([[1, 2, 3], [4, 0, 0]]), torch.tensor([[1.0, 1, 1], [1, 0, 0]]))
    assert pack.ids_1S.tolist() == [[5, 6, 1, 2, 7]]
    assert pack.positions_1S.tolist() == [[0, 1, 2, 3, 0]]
    assert pack.cu_seqlens.tolist() == [0, 4, 5] and pack.longest == 4
    assert list(zip(pack.rows.tolist(), pack.cols.tolist(), pack.src.tolist(), strict=True)) == [
        (0, 0, 1), (0, 1, 2), (0, 2, 3), (1, 0, 4)]
    # outputs 10 * position at the pack's positions land at (row, t), zeros on padding
    out = unpack(torch.arange(5.0)[None, :, None] * 10, pack)
    assert out[..., 0].tolist() == [[10.0, 20.0, 30.0], [40.0, 0.0, 0.0]]
    # the head's per-token outputs of the 4 predicted tokens, in (row, t) order, back to [2, 3]
    assert to_rows(torch.tensor([[1.0, 2.0, 3.0, 4.0]]), pack).tolist() == [[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]]


def test_an_empty_completion_packs_its_prompt_alone():
    pack = pack_rows([[5], [6, 7]], torch.tensor([[0, 0], [8, 9]]), torch.tensor([[0.0, 0], [1, 1]]))
    assert pack.ids_1S.tolist() == [[5, 6, 7, 8]] and pack.positions_1S.tolist() == [[0, 0, 1, 2]]
    assert pack.rows.tolist() == [1, 1] and pack.src.tolist() == [2, 3]


def test_rows_must_be_right_padded_and_the_planner_counts_real_tokens():
    mask = torch.tensor([[1.0, 1, 0, 0], [1, 1, 1, 1]])
    assert real_lengths(mask) == [2, 4]
    assert row_tokens([[1, 2, 3], [4]], mask, packed=True) == [3 + 2, 1 + 4]
    assert row_tokens([[1, 2, 3], [4]], mask, packed=False) == [3 + 4, 1 + 4]
    with pytest.raises(ValueError, match="train.packing: completion rows \\[0\\] are not right-padded"):
        real_lengths(torch.tensor([[1.0, 0, 1], [1, 1, 0]]))


def test_transformers_builds_the_block_diagonal_mask_from_restarting_positions(tiny_batch):
    # transformers 5.x masking_utils: attention_mask None, no cache, positions 0 1 2 | 0 1 -> rows [0, 3) and [3, 5)
    model = load_model(tiny_batch[0])
    model.set_attn_implementation("sdpa")
    mask = create_causal_mask(config=model.config, inputs_embeds=torch.zeros(1, 5, 32), attention_mask=None,
                              cache=None, position_ids=torch.tensor([[0, 1, 2, 0, 1]]))
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [1, 1, 1, 0, 0],
                             [0, 0, 0, 1, 0],
                             [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask[0, 0], expected)


@pytest.mark.parametrize("window", [None, 2])
def test_posttrain_attention_runs_each_row_as_the_block_diagonal_mask_does(window):
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 7, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    cu = torch.tensor([0, 4, 5, 7], dtype=torch.int32)
    got, _ = attention(module, q, k, v, None, scaling=0.3, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4,
                       max_length_k=4, sliding_window=window)
    seg = torch.tensor([0, 0, 0, 0, 1, 2, 2])  # rows of 4, 1 and 2 tokens
    i = torch.arange(7)
    allowed = (seg[:, None] == seg[None]) & (i[None] <= i[:, None])
    if window is not None:  # row 0 (4 tokens) is longer than the window: q - 2 < k
        allowed &= i[None] > i[:, None] - window
    want, _ = sdpa_attention_forward(module, q, k, v, allowed[None, None], scaling=0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    g1 = torch.autograd.grad(got.square().sum(), (q, k, v))
    g2 = torch.autograd.grad(want.square().sum(), (q, k, v))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _terms(model, r, packed: bool):
    """Masked log-probs, entropies and a logit term of every row, and the gradients of a loss on them."""
    model.zero_grad(set_to_none=True)
    prompts = [r.prompt_ids[i // r.n] for i in range(r.token_ids.shape[0])]
    mask = r.attention_mask
    logp, ent, (term,) = completion_terms(model, prompts, r.token_ids, mask, pad_id=0, temperature=0.7,
                                          with_entropy=True, terms=[mean_log_softmax], packed=packed)
    adv = torch.linspace(-1, 1, logp.shape[0])[:, None]
    ((logp * adv * mask).sum() + (term * mask).sum() * 0.1).backward()
    return [x * mask for x in (logp, ent, term)], [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("impl", ["posttrain", "sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_the_unpacked(tiny_batch, impl):
    path, _, r = tiny_batch
    model = load_model(path).float()
    if impl != "posttrain":
        model.set_attn_implementation(impl)
    assert model.config._attn_implementation == impl
    plain, plain_g = _terms(model, r, packed=False)  # a group's prompt shared through the KV cache
    packed, packed_g = _terms(model, r, packed=True)
    for a, b in zip(plain, packed, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)
    for a, b in zip(plain_g, packed_g, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_a_models_own_forward_packs_too(tiny_batch):
    # the path of a model whose head transforms its logits (head_of(model) is None): logits [N, T, V] from a pack
    path, _, r = tiny_batch
    model = load_model(path).float()
    prompts = [r.prompt_ids[i // r.n] for i in range(r.token_ids.shape[0])]
    mask = r.attention_mask.bool()
    with torch.no_grad():
        a, b = (completion_logits(model, prompts, r.token_ids, r.attention_mask, pad_id=0, packed=p)
                for p in (False, True))
    torch.testing.assert_close(b[mask], a[mask], rtol=1e-5, atol=1e-5)
    assert (b[~mask] == 0).all()


def _update(tiny_cfg, tiny_batch, packing: bool, budget: int, checkpointed: bool = False):
    """One lr-0 update: its metrics, the gradients, and how many passes the trunk made."""
    path, pad_id, r = tiny_batch
    model = load_model(path)
    if checkpointed:
        enable_checkpointing(model)
    passes = []
    model.model.register_forward_pre_hook(lambda m, a, kw: passes.append(1), with_kwargs=True)
    cfg = tiny_cfg(f"train.micro_batch_tokens={budget}", f"train.packing={str(packing).lower()}",
                   "train.minibatches=2", "train.epochs=2")  # off-policy: pi_old's pass runs (packed) too
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    adv = torch.linspace(-1, 1, 12)
    metrics = policy_update(model, None, opt, Phases.from_config(cfg).learn, LearnSettings.of(cfg), r.row_prompts, r,
                            r.loss_mask, adv, {}, pad_id, 0)
    return metrics, [p.grad.clone() for p in model.parameters()], len(passes)


@pytest.mark.parametrize("budget", [0, 60])
def test_a_packed_update_equals_the_unpacked_one(tiny_cfg, tiny_batch, budget):
    plain_m, plain_g, plain_passes = _update(tiny_cfg, tiny_batch, False, budget)
    packed_m, packed_g, packed_passes = _update(tiny_cfg, tiny_batch, True, budget)
    for a, b in zip(plain_g, packed_g, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    for k in ("loss", "optim/grad_norm", "policy/entropy"):
        assert packed_m[k] == pytest.approx(plain_m[k], rel=1e-5, abs=1e-7), k
    if budget:  # the planner counts real tokens: fewer, fuller micro-batches (and no shared-prompt passes)
        assert packed_passes < plain_passes


def test_packing_with_checkpointed_layers(tiny_cfg, tiny_batch):
    plain_m, plain_g, _ = _update(tiny_cfg, tiny_batch, False, 60)
    both_m, both_g, _ = _update(tiny_cfg, tiny_batch, True, 60, checkpointed=True)
    for a, b in zip(plain_g, both_g, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert both_m["loss"] == pytest.approx(plain_m["loss"], rel=1e-5, abs=1e-7)


def test_no_grad_log_probs_pack(tiny_batch):
    # the reference's / pi_old's pass (learn/forwards.py reference_logprobs calls this)
    path, pad_id, r = tiny_batch
    model = load_model(path).float()
    prompts = r.row_prompts
    a, b = (batched_logprobs(model, prompts, r, pad_id=pad_id, temperature=1.0, budget=50, packing=p)
            for p in (False, True))
    mask = r.attention_mask
    torch.testing.assert_close(b * mask, a * mask, rtol=1e-5, atol=1e-5)


def _plain_causal(module, query, key, value, attention_mask, **kwargs):
    """An attention that ignores every mask and keyword (a custom implementation a user might register)."""
    kwargs.pop("is_causal", None)
    return sdpa_attention_forward(module, query, key, value, None, is_causal=True, **kwargs)


def test_an_attention_that_lets_rows_mix_is_refused(tiny_batch):
    model = load_model(tiny_batch[0]).float()
    assert "varlen" in check_packing(model)  # posttrain's attention: each row on its own
    AttentionInterface.register("test_plain_causal", _plain_causal)
    model.set_attn_implementation("test_plain_causal")
    with pytest.raises(ConfigError, match="train.packing: with attention 'test_plain_causal'"):
        check_packing(model)


# plain; a LoRA adapter; a parameterization that wraps the policy (its own forward: the [N, T, V] logits path)
@pytest.mark.parametrize("extra", [(), ("model.lora.rank=4",), ("algorithm.parameterization=ref_logit_mix",)])
def test_a_packed_run_matches_the_unpacked_run(tiny_cfg, quiet, tmp_path, extra):
    runs = {}
    for flag in (False, True):
        out = tmp_path / f"run-{flag}"
        cfg = tiny_cfg("train.steps=2", "checkpoint.every=0", "eval.every=0", "train.micro_batch_tokens=60",
                       f"train.packing={str(flag).lower()}", *extra, out=str(out))
        train(cfg, console=quiet)
        runs[flag] = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(runs[True]) == 2
    for plain, packed in zip(runs[False], runs[True], strict=True):
        for key in ("loss", "optim/grad_norm", "reward/mean"):
            assert packed[key] == pytest.approx(plain[key], rel=1e-4, abs=1e-6), key


def test_the_plan_runs_every_rows_prompt_when_packed():
    # 4 prompts x 4 completions of 512 tokens, prompts of 50 tokens, fp32, one minibatch, SmolLM2-135M's shape:
    # unpacked a group shares its prompt, 4 x 50 + 16 x 512 = 8,392 positions; packed each row carries its own,
    # 16 x (50 + 512) = 8,992 (a bound: the rows' real tokens, every completion at max_new_tokens), each
    # 30 x 13,824 elements x 4 bytes
    arch = Arch.of(LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                               num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True))
    base = ["rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=512"]
    plain, packed = (next(p for p in estimate(load_config(None, [*base, f"train.packing={flag}"]), arch, 50)
                          if p.name == "activations") for flag in ("false", "true"))
    assert plain.bytes == 8_392 * 30 * 13_824 * 4
    assert packed.bytes == 8_992 * 30 * 13_824 * 4 and "packed" in packed.note


@pytest.mark.slow
def test_two_packed_ranks_train_as_one_unpacked_process(tiny_cfg, quiet, tmp_path):
    if (torch.get_num_threads() or 1) < 2:
        pytest.skip("two ranks need two cores")
    common = ("train.steps=2", "checkpoint.every=0", "eval.every=0", "train.micro_batch_tokens=40")
    train(tiny_cfg(*common, out=str(tmp_path / "one")), console=quiet)
    train(tiny_cfg(*common, "train.processes=2", "train.packing=true", out=str(tmp_path / "two")), console=quiet)
    one, two = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                for d in ("one", "two"))
    for a, b in zip(one, two, strict=True):
        assert a["reward/mean"] == b["reward/mean"]
        for k in ("loss", "optim/grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), k
