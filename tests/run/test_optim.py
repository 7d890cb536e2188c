"""The optimizer and schedule of every trainer (``run/optim.py``)."""

from __future__ import annotations

import torch

from posttrain.run.optim import make_optimizer, make_scheduler


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def test_fused_adamw_steps_like_the_reference_implementation():
    fused_model, ref_model = _model(0), _model(0)
    opt = make_optimizer(fused_model, 1e-2, (0.9, 0.99), 0.1)
    assert opt.defaults["fused"] is True  # the CPU has the fused kernel for fp32
    ref_groups = [  # the same groups: weight decay on matrices only
        {"params": [p for p in ref_model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in ref_model.parameters() if p.dim() < 2], "weight_decay": 0.0},
    ]
    ref = torch.optim.AdamW(ref_groups, lr=1e-2, betas=(0.9, 0.99), foreach=False)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for model, o in ((fused_model, opt), (ref_model, ref)):
            o.zero_grad()
            model(x).pow(2).mean().backward()
            o.step()
    for a, b in zip(fused_model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert not torch.equal(fused_model[0].weight, _model(0)[0].weight)  # it moved


def test_norms_and_biases_get_no_weight_decay():
    opt = make_optimizer(_model(0), 1e-3, (0.9, 0.99), 0.5)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.5 and all(p.dim() >= 2 for p in decay["params"])
    assert no_decay["weight_decay"] == 0.0 and all(p.dim() < 2 for p in no_decay["params"])


def test_warmup_then_cosine_schedule():
    # warm-up 2 of 10 steps: lr x 1/2, 2/2, then cosine from 1 to 0 over the remaining 8
    opt = make_optimizer(_model(0), 1.0, (0.9, 0.99), 0.0)
    sched = make_scheduler(opt, 2, 10, "cosine")
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[0] == 0.5 and lrs[1] == 1.0
    assert all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))
