"""fp32 linears on oneDNN-packed weights (models/onednn.py): same outputs and gradients as the plain ones."""

import pytest
import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.learn.logprobs import completion_terms
from posttrain.models import onednn
from posttrain.models.precision import compute

needs_ops = pytest.mark.skipif(onednn.OPS is None, reason="this torch build has no oneDNN weight packing")


def _grads(mod: nn.Module, x: torch.Tensor, packed: bool) -> tuple[torch.Tensor, ...]:
    mod.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    if packed:
        with onednn.packed_linears(mod):
            y = mod(x)
    else:
        y = mod(x)
    # a weighted sum, so that every output position has its own gradient
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()  # the backward runs after the block
    grads = [p.grad for p in mod.parameters() if p.requires_grad]
    return (y.detach(), x.grad, *grads)


@needs_ops
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_matches_the_plain_one_forward_and_backward(bias):
    torch.manual_seed(0)
    mod = nn.Sequential(nn.Linear(96, 160, bias=bias), nn.SiLU(), nn.Linear(160, 48, bias=bias))
    x = torch.randn(3, 7, 96)  # leading dims, as a decoder's [B, S, H]
    want, got = _grads(mod, x, False), _grads(mod, x, True)
    assert len(want) == len(got) == 2 + (4 if bias else 2)
    for w, g in zip(want, got, strict=True):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@needs_ops
def test_the_packed_kernel_runs_inside_the_block_and_the_module_is_restored_after_it(monkeypatch):
    mod = nn.Linear(8, 4)
    calls = []
    real = onednn.mm
    monkeypatch.setattr(onednn, "mm", lambda *a: calls.append(1) or real(*a))
    x = torch.randn(2, 8, requires_grad=True)
    with onednn.packed_linears(mod):
        assert "forward" in mod.__dict__
        y = mod(x)
    assert calls == [1]  # x W^T on the packed weight
    y.sum().backward()
    assert calls == [1, 1]  # dY W on the packed transpose, after the block
    assert "forward" not in mod.__dict__  # the class's forward again
    mod(x)
    assert calls == [1, 1]


@needs_ops
def test_a_frozen_weight_gets_no_gradient_and_its_input_gets_the_right_one():
    torch.manual_seed(1)
    mod = nn.Linear(32, 16)
    mod.weight.requires_grad_(False)
    x = torch.randn(5, 32)
    want, got = _grads(mod, x, False), _grads(mod, x, True)
    assert mod.weight.grad is None
    for w, g in zip(want, got, strict=True):  # output, dx, db
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


@needs_ops
def test_packs_are_made_per_block_so_a_changed_weight_is_seen_by_the_next_block():
    torch.manual_seed(2)
    mod = nn.Linear(16, 8, bias=False)
    x = torch.randn(4, 16)
    with torch.no_grad(), onednn.packed_linears(mod):
        before = mod(x)
        mod.weight.mul_(2.0)  # inside a block the weights must not change: its pack is still the old one
        stale = mod(x)
    torch.testing.assert_close(stale, before)
    with torch.no_grad(), onednn.packed_linears(mod):
        torch.testing.assert_close(mod(x), 2 * before, atol=1e-5, rtol=1e-5)


def test_linears_it_cannot_run_are_left_alone():
    hooked = nn.Linear(4, 4)
    hooked.register_forward_hook(lambda m, i, o: o)
    half = nn.Linear(4, 4).to(torch.bfloat16)
    model = nn.Sequential(hooked, half)
    with onednn.packed_linears(model):
        assert "forward" not in hooked.__dict__ and "forward" not in half.__dict__
    plain = nn.Linear(4, 4)
    with compute("cpu", torch.bfloat16), onednn.packed_linears(plain):  # bf16 matmuls are oneDNN's already
        assert "forward" not in plain.__dict__
        assert plain(torch.randn(2, 4)).dtype == torch.bfloat16


def test_linear_of_equals_f_linear_and_keeps_autocast():
    torch.manual_seed(3)
    w, b, x = torch.randn(50, 24), torch.randn(50), torch.randn(6, 24)
    torch.testing.assert_close(onednn.linear_of(w, b)(x), torch.nn.functional.linear(x, w, b), atol=1e-5, rtol=1e-5)
    with compute("cpu", torch.bfloat16):
        assert onednn.linear_of(w, b)(x).dtype == torch.bfloat16


def test_completion_log_probs_and_gradients_are_the_same_with_and_without_packing(monkeypatch):
    cfg = LlamaConfig(vocab_size=120, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(4)
    model = LlamaForCausalLM(cfg)
    prompts = [[1, 2, 3, 4], [5, 6, 7], [1, 2, 3, 4]]  # two rows share a prompt (the shared-prefix path)
    ids, mask = torch.randint(3, 120, (3, 5)), torch.ones(3, 5)

    def run() -> tuple[torch.Tensor, dict]:
        model.zero_grad(set_to_none=True)
        lp, _, _ = completion_terms(model, prompts, ids, mask, pad_id=0)
        (lp * torch.arange(15.0).view(3, 5)).sum().backward()
        return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    lp, grads = run()
    monkeypatch.setattr(onednn, "OPS", None)  # the plain linears
    lp_plain, grads_plain = run()
    torch.testing.assert_close(lp, lp_plain, atol=1e-5, rtol=1e-5)
    for name, g in grads_plain.items():
        torch.testing.assert_close(grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_a_gradient_checkpointed_model_is_left_alone():
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg)
    assert onednn.usable(model) == (onednn.OPS is not None)
    model.gradient_checkpointing_enable()  # its recomputation would save other tensors than the packed forward
    assert not onednn.usable(model)
