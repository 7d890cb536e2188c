"""train.optimizer = "adamw_8bit" / "adamw_4bit" (posttrain/run/optim.py): torchao's block-quantized AdamW
moments, a quarter / an eighth of fp32 AdamW's state, steps close to fp32 AdamW's, and resume exact."""

from __future__ import annotations

import json

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.run.optim import make_optimizer, optimizer_state_bytes
from posttrain.train.rl import train

pytest.importorskip("torchao")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Tanh(), torch.nn.Linear(128, 64))


def _steps(kind: str, n: int = 5) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = make_optimizer(model, 1e-2, (0.9, 0.99), 0.0, kind)
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    for _ in range(n):
        (model(x) - x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize(("kind", "bits", "block", "codes"), [("adamw_8bit", 8, 256, 256), ("adamw_4bit", 4, 128, 16)])
def test_low_bit_moments_hold_a_fraction_of_fp32_state(kind, bits, block, codes):
    # two 8,192-value matrices (the 192 bias values, under 4,096, keep fp32 moments); fp32 AdamW: 2 moments x 4 B
    # = 8 B a value: 131,072 B. Quantized, each moment of an n-value tensor is n x bits / 8 B of codes, a 4 B scale
    # per block and its code book (4 B a code): 8-bit 2 x (8,192 + 128 + 1,024) = 18,688 B a matrix, 37,376 in
    # all, 0.285 of fp32 (0.254 on a large tensor, where the code book vanishes); 4-bit 2 x (4,096 + 256 + 64)
    # = 8,832 B a matrix, 0.135
    _, fp32 = _steps("adamw")
    _, low_bit = _steps(kind)
    mats = [p.numel() for g in fp32.param_groups for p in g["params"] if p.dim() == 2]
    biases = sum(p.numel() for g in fp32.param_groups for p in g["params"] if p.dim() < 2)
    assert optimizer_state_bytes(fp32) == 8 * (sum(mats) + biases) + 4 * 4  # + each tensor's 4-byte step counter
    want = sum(2 * (n * bits // 8 + 4 * n // block + 4 * codes) for n in mats) / (8 * sum(mats))
    got = (optimizer_state_bytes(low_bit) - 8 * biases) / (8 * sum(mats))
    assert got == pytest.approx(want, rel=0.01), (got, want)


@pytest.mark.parametrize(("kind", "rel", "cos"), [("adamw_8bit", 0.03, 0.999), ("adamw_4bit", 0.35, 0.95)])
def test_low_bit_steps_follow_fp32_adamw(kind, rel, cos):
    # what distinguishes the quantized moments from a cruder optimizer: after 5 steps each matrix has moved as
    # fp32 AdamW moved it (measured here: 8-bit within 1.2 % of the move, cosine 0.9999; 4-bit within 25 %,
    # cosine 0.97, its 16-level moments are coarse while v is still small)
    start = [p.detach().clone() for p in _model().parameters()]
    ref, _ = _steps("adamw")
    got, _ = _steps(kind)
    for s, a, b in zip(start, ref.parameters(), got.parameters(), strict=True):
        want, move = (a.detach() - s).flatten(), (b.detach() - s).flatten()
        assert (move - want).norm() < rel * want.norm()
        assert torch.nn.functional.cosine_similarity(move, want, dim=0) > cos


def test_an_unknown_optimizer_is_a_config_error(tiny_cfg):
    with pytest.raises(ConfigError, match="train.optimizer"):
        tiny_cfg("train.optimizer=adam_2bit")


def test_a_low_bit_run_resumes_exactly(tiny_cfg, quiet, tmp_path):
    common = ("train.optimizer=adamw_8bit", "checkpoint.every=1", "eval.every=0", "train.lr=1e-2")
    train(tiny_cfg(*common, "train.steps=3", out=str(tmp_path / "whole")), console=quiet)
    train(tiny_cfg(*common, "train.steps=2", out=str(tmp_path / "cut")), console=quiet)
    train(tiny_cfg(*common, "train.steps=3", out=str(tmp_path / "cut")), resume=True, console=quiet)
    rows = {d: [json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
            for d in ("whole", "cut")}
    assert [r["step"] for r in rows["cut"]] == [1, 2, 3]
    for key in ("loss", "optim/grad_norm", "reward/mean", "policy/entropy"):
        assert rows["cut"][2][key] == rows["whole"][2][key], key
    state = torch.load(tmp_path / "cut" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    kinds = {type(v).__name__ for s in state["optimizer"]["state"].values() for v in s.values()}
    assert "OptimState8bit" in kinds  # the quantized moments are what the checkpoint holds
