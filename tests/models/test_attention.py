"""posttrain's attention (``models/attention.py``): grouped-query attention as two matmuls under bf16 on
a CPU, HF's sdpa elsewhere."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from posttrain.learn.logprobs import completion_logprobs
from posttrain.models import load_model
from posttrain.models.attention import MAX_KEYS, NAME, SCORES_BYTES, attention, math_pays


def _module() -> nn.Module:
    m = nn.Module()
    m.is_causal, m.training = True, False
    return m


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain multi-head attention with K/V repeated per query head (``repeat_kv`` order), ``[B, Tq, H, D]``."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    return (s.masked_fill(~allowed, -1e30).softmax(-1) @ v.float()).transpose(1, 2)


def test_hand_computed_example() -> None:
    # one row, two query heads over one K/V head, one query against two keys, D = 1, scale 1:
    # head 0: q = ln 3, scores (ln 3 * 1, ln 3 * 0) -> softmax (3/4, 1/4) -> 3/4 * 10 + 1/4 * 2 = 8
    # head 1: q = 0, scores (0, 0) -> (1/2, 1/2) -> 6
    q = torch.tensor([math.log(3.0), 0.0]).view(1, 2, 1, 1).to(torch.bfloat16)
    k = torch.tensor([1.0, 0.0]).view(1, 1, 2, 1).to(torch.bfloat16)
    v = torch.tensor([10.0, 2.0]).view(1, 1, 2, 1).to(torch.bfloat16)
    assert math_pays(q, k, 0.0, {})
    out, weights = attention(_module(), q, k, v, None, scaling=1.0)
    assert weights is None and out.shape == (1, 1, 2, 1)
    # bf16 rounds ln 3 to 1.09375: 3 becomes e^1.09375 = 2.985, the weights 0.749 / 0.251
    assert out.float().flatten().tolist() == pytest.approx([8.0, 6.0], abs=0.05)


@pytest.mark.parametrize("mask_kind", ["padding", "none"])
def test_matches_plain_attention_under_autocast(mask_kind: str) -> None:
    torch.manual_seed(0)
    b, h, h_kv, tq, tk, d = 3, 6, 2, 5, 9, 16
    q, k, v = torch.randn(b, h, tq, d), torch.randn(b, h_kv, tk, d), torch.randn(b, h_kv, tk, d)
    causal = torch.arange(tk)[None] <= torch.arange(tk - tq, tk)[:, None]  # the queries are the last tq keys
    allowed = causal[None, None].expand(b, 1, tq, tk).clone()
    if mask_kind == "padding":
        allowed[1, :, :, :3] = False  # row 1 is left-padded by 3 tokens
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert math_pays(q, k, 0.0, {})
        out, _ = attention(_module(), q, k, v, allowed if mask_kind == "padding" else None, scaling=d**-0.5)
    ref = _reference(q, k, v, allowed, d**-0.5)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)  # bf16 matmuls
    # the same computation in fp32 (the path itself, not rounding) agrees to fp32 precision
    q16, k16, v16 = (t.to(torch.bfloat16).float() for t in (q, k, v))
    assert (out.float() - _reference(q16, k16, v16, allowed, d**-0.5)).abs().max() < 3e-2


def test_fully_masked_query_is_finite_in_both_directions() -> None:
    # a left-padded row's padding queries may see no key: uniform weights, no NaN in output or gradient
    q = torch.randn(1, 2, 2, 4, requires_grad=True)
    k, v = torch.randn(1, 1, 2, 4, requires_grad=True), torch.randn(1, 1, 2, 4, requires_grad=True)
    allowed = torch.tensor([[False, False], [True, True]]).view(1, 1, 2, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = attention(_module(), q, k, v, allowed, scaling=0.5)
    out.float().sum().backward()
    assert torch.isfinite(out.float()).all() and all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # the masked query averages the two values
    torch.testing.assert_close(out[0, 0].float(), v.detach().mean(2)[0].expand(2, 4), atol=2e-2, rtol=2e-2)


def test_fp32_dropout_and_large_scores_go_to_sdpa() -> None:
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
    assert not math_pays(q, k, 0.0, {})  # fp32 on a CPU: the flash kernel is as fast (bench/attention.py)
    mask = torch.ones(2, 1, 3, 5, dtype=torch.bool)
    module = _module()
    module.num_key_value_groups = 2
    out, _ = attention(module, q, k, v, mask, scaling=0.3)
    ref, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
    assert torch.equal(out, ref)  # the fallback is sdpa itself
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert math_pays(q, k, 0.0, {})
        assert not math_pays(q, k, 0.1, {})  # dropout
        assert not math_pays(q, k, 0.0, {"sliding_window": 4})
        big_q = torch.empty(1, 16, SCORES_BYTES // (4 * 16 * 64) + 1, 8)
        assert not math_pays(big_q, torch.empty(1, 4, 64, 8), 0.0, {})
        assert not math_pays(q, torch.empty(2, 2, MAX_KEYS + 1, 8), 0.0, {})  # long: flash is as fast
    assert math_pays(q.to(torch.bfloat16), k.to(torch.bfloat16), 0.0, {})  # a bf16 model without autocast


def test_loaded_models_use_it_and_agree_with_sdpa(tmp_path) -> None:
    torch.manual_seed(0)  # grouped-query attention: 4 query heads over 2 K/V heads
    config = LlamaConfig(vocab_size=40, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "m")
    model = load_model(str(tmp_path / "m"))
    assert model.config._attn_implementation == NAME
    prompts = [[5, 6, 7, 8], [5, 6, 7, 8], [9, 10, 11]]  # rows 0 and 1 share a prompt; row 2 is padded
    torch.manual_seed(1)
    completions, mask = torch.randint(3, 30, (3, 6)), torch.ones(3, 6)
    grads = {}
    for impl in (NAME, "sdpa"):
        model.set_attn_implementation(impl)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = completion_logprobs(model, prompts, completions, mask, pad_id=0)
        logp.sum().backward()
        grads[impl] = (logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()]))
    (lp_a, g_a), (lp_b, g_b) = grads[NAME], grads["sdpa"]
    assert (lp_a - lp_b).abs().max() < 0.05  # bf16 rounding, summed differently
    assert torch.nn.functional.cosine_similarity(g_a, g_b, dim=0) > 0.999
