"""FiMi-RM stage 3 (provisional; arXiv:2505.12843, seed 004:85): Pearson and the two losses by hand, the fitting
model's size, the warm-up / fitting / debiasing schedule, and a tiny reward model trained on length-biased
preferences whose reward ends less correlated with length than plain Bradley-Terry's."""

import json
import math
import random
from pathlib import Path

import pytest
import torch
from torch import nn

from posttrain.algorithms.reward_fimi import LengthFitter, fimi_fit_loss, fimi_reward_loss, length_encoding
from posttrain.algorithms.reward_modeling import pearson
from posttrain.config import ConfigError
from posttrain.config.trainers import RMConfig
from posttrain.trainers.rm_heads import DEBIAS, FiMi


def test_pearson_by_hand():
    # x = [1, 0, 0, 0]: centred [0.75, -0.25, -0.25, -0.25], sum of squares 0.75
    # y = [1, 2, 3, 4]: centred [-1.5, -0.5, 0.5, 1.5], sum of squares 5
    # sum xc yc = -1.125 + 0.125 - 0.125 - 0.375 = -1.5; rho = -1.5 / sqrt(0.75 x 5) = -1.5 / 1.936492 = -0.774597
    x, y = torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert float(pearson(x, y)) == pytest.approx(-0.774597, abs=1e-6)
    # invariant to an affine map of either side with a positive scale, sign-flipped by a negative one
    assert float(pearson(3 * x + 2, y)) == pytest.approx(-0.774597, abs=1e-6)
    assert float(pearson(x, -y)) == pytest.approx(0.774597, abs=1e-6)


def test_the_two_losses_by_hand_and_where_their_gradients_go():
    # B = 2 pairs, rows (chosen 0, 1; rejected 2, 3): r = [1, 0, 0, 0], r_hat = [1, 2, 3, 4], rho = -0.774597
    r = torch.tensor([1.0, 0.0, 0.0, 0.0], requires_grad=True)
    r_hat = torch.tensor([1.0, 2.0, 3.0, 4.0], requires_grad=True)
    # reward model: BT = mean(log(1 + e^-(1 - 0)), log(1 + e^-(0 - 0))) = (0.313262 + 0.693147) / 2 = 0.503204;
    # L = 0.503204 + |-0.774597| = 1.277802
    loss, bt = fimi_reward_loss(r, r_hat)
    assert float(bt.detach()) == pytest.approx(0.503204, abs=1e-5)
    assert float(loss.detach()) == pytest.approx(1.277802, abs=1e-5)
    loss.backward()
    assert r.grad is not None and r_hat.grad is None  # sg(r_hat): the fitting model is not moved by this loss
    # fitting model: -|rho| = -0.774597; with mse_coef 0.5: + 0.5 x mean([0, 4, 9, 16]) = + 3.625 -> 2.850403
    r.grad = None
    fit = fimi_fit_loss(r, r_hat)
    assert float(fit.detach()) == pytest.approx(-0.774597, abs=1e-6)
    assert float(fimi_fit_loss(r, r_hat, mse_coef=0.5).detach()) == pytest.approx(2.850403, abs=1e-5)
    fit.backward()
    assert r.grad is None and r_hat.grad is not None  # sg(r): the reward model is not moved by this one


def test_the_fitting_model_is_the_renderings_size_on_a_sinusoidal_length_code():
    # 2 blocks x (LayerNorm 64 + Linear(32, 48) 1,584 + Linear(48, 32) 1,568) + head 33 = 6,465 (~6.4K)
    f = LengthFitter()
    assert sum(p.numel() for p in f.parameters()) == 6465
    # e(n)_0 = sin(n), e(n)_1 = cos(n) (frequency 1); e(n)_2 = sin(n / 10000^(2/32)) = sin(n / 1.778279)
    e = length_encoding(torch.tensor([0.0, 1.0, 2.0]))
    assert e.shape == (3, 32)
    torch.testing.assert_close(e[:, 0], torch.tensor([0.0, math.sin(1.0), math.sin(2.0)]))
    torch.testing.assert_close(e[:, 1], torch.tensor([1.0, math.cos(1.0), math.cos(2.0)]))
    torch.testing.assert_close(e[1, 2], torch.tensor(math.sin(1 / 10000 ** (2 / 32))))
    assert f(torch.tensor([3.0, 7.0, 120.0])).shape == (3,)


def _fimi(**kw) -> FiMi:
    return DEBIAS["fimi"](nn.Linear(4, 1), RMConfig(debias="fimi", **kw), seed=0)


def test_warm_up_then_fitting_and_debiasing_blocks_in_turn():
    # W = 2 warm-up steps, blocks of K = 3: steps 0-1 warm-up, 2-4 fit, 5-7 debias, 8-10 fit, 11 debias
    head = _fimi(fimi_warmup_steps=2, fimi_every=3)
    assert [head.phase(s) for s in range(12)] == ["warmup"] * 2 + ["fit"] * 3 + ["debias"] * 3 + ["fit"] * 3 + [
        "debias"]
    r = torch.tensor([0.5, 0.1, -0.2, 0.3], requires_grad=True)
    lengths = torch.tensor([3.0, 9.0, 4.0, 1.0])
    for step, phase in ((0, "warmup"), (2, "fit"), (5, "debias")):
        r.grad = None
        head.fitter.zero_grad(set_to_none=True)
        loss, parts = head.objective(r, torch.zeros(4, 1), lengths, step=step)
        loss.backward()
        fitter_moved = any(p.grad is not None for p in head.fitter.parameters())
        # only the part whose block it is gets a gradient (warm-up: the reward model alone, on BT)
        assert (r.grad is not None, fitter_moved) == {"warmup": (True, False), "fit": (False, True),
                                                       "debias": (True, False)}[phase]
        assert float(parts["rm/fimi_phase"]) == FiMi.PHASES.index(phase)
        if phase == "warmup":
            torch.testing.assert_close(loss, parts["rm/bt_loss"])


def test_the_fitting_model_round_trips_through_the_checkpoint_vector():
    a, b = _fimi(), _fimi()
    with torch.no_grad():
        for p in a.fitter.parameters():
            p.add_(0.1)
    saved = a.state()
    assert saved.shape == (6465,)
    b.load(saved)
    lengths = torch.tensor([2.0, 5.0, 40.0])
    torch.testing.assert_close(a.fitter(lengths), b.fitter(lengths))
    with pytest.raises(ConfigError, match="fitting model"):
        b.load(torch.zeros(1, 32))  # an ODIN length head


# ---- the distinguishing test: less correlation with length than plain BT ----


def _features(good: bool, n: int) -> list[float]:
    # what a reward model could read off a response: its quality, its length (two ways) and a constant
    return [float(good), n / 9, (n / 9) ** 2, 1.0]


def _length_biased_pairs(rng: random.Random, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k pairs ranked by 3 quality + 0.5 length (as test_rm.py's ODIN set): features [2k, 4] (chosen first) and
    lengths [2k]; quality and length drawn independently, so a reward that ignores length can rank most pairs."""
    chosen, rejected = [], []
    while len(chosen) < k:
        a, b = [(rng.random() < 0.5, rng.randint(1, 9)) for _ in range(2)]
        if 3 * a[0] + 0.5 * a[1] != 3 * b[0] + 0.5 * b[1]:
            w, lo = sorted([a, b], key=lambda x: 3 * x[0] + 0.5 * x[1], reverse=True)
            chosen.append(w)
            rejected.append(lo)
    rows = chosen + rejected
    return torch.tensor([_features(g, n) for g, n in rows]), torch.tensor([float(n) for _, n in rows])


def _train(debias: str, pool: tuple[torch.Tensor, torch.Tensor], steps: int = 160) -> tuple[float, float]:
    """A linear reward model on the four features, trained on batches of 32 length-biased pairs of ``pool`` with
    ``debias``; its reward's Pearson correlation with length and with quality on independent probes."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1, bias=False)
    d = RMConfig(debias=debias, **({"fimi_warmup_steps": 40, "fimi_every": 8} if debias == "fimi" else {}))
    head = DEBIAS[debias](model, d, seed=1)
    opt = torch.optim.Adam([*model.parameters(), *(p for m in head.modules for p in m.parameters())], lr=0.05)
    feats_all, lengths_all = pool
    k = feats_all.shape[0] // 2
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        pick = torch.randperm(k, generator=gen)[:32]
        rows = torch.cat([pick, pick + k])  # chosen rows first, then their rejected
        feats, lengths = feats_all[rows], lengths_all[rows]
        loss, _ = head.objective(model(feats)[:, 0], feats, lengths, step=step)
        opt.zero_grad()
        loss.backward()
        opt.step()
    probe = random.Random(1)
    probes = [(probe.random() < 0.5, probe.randint(1, 9)) for _ in range(400)]
    with torch.no_grad():
        reward = model(torch.tensor([_features(g, n) for g, n in probes]))[:, 0]
    return (float(pearson(reward, torch.tensor([float(n) for _, n in probes]))),
            float(pearson(reward, torch.tensor([float(g) for g, _ in probes]))))


def test_fimi_leaves_the_reward_less_correlated_with_length_than_plain_bt():
    pool = _length_biased_pairs(random.Random(0), 1000)
    (corr, quality) = zip(*(_train(debias, pool) for debias in ("none", "fimi")), strict=True)
    print(f"\ncorrelation of the reward with length / quality on independent probes: none {corr[0]:.3f} / "
          f"{quality[0]:.3f}, fimi {corr[1]:.3f} / {quality[1]:.3f}")
    assert corr[0] > 0.3  # plain BT learns the length shortcut
    assert abs(corr[1]) < corr[0] / 2
    assert quality[1] > 0.8  # ... and the debiased reward still ranks by quality


# ---- through `posttrain rm`: exact resume across the phases ----


def test_resume_equals_an_uninterrupted_run(tmp_path, quiet):
    # cut after step 3 (warm-up, fit, fit | debias, debias): the resumed run restores the fitting model from the loop
    # state and the phase from the step count, and ends where the uninterrupted one does
    from safetensors.torch import load_file

    from posttrain.config import load_config
    from posttrain.run.checkpoint import latest_checkpoint, load_trainer_state
    from posttrain.trainers.rm import rm_train

    root = Path(__file__).resolve().parents[2]
    common = ["rm.debias=fimi", "rm.fimi_warmup_steps=1", "rm.fimi_every=2", "rm.prompts=24", "rm.eval_prompts=8",
              "rm.batch_size=8", "rm.eval_every=0", "rm.warmup_steps=0", "checkpoint.every=0", "log.progress=false",
              "log.tensorboard=false", "log.plot_groups=false", "model.tiny.hidden_size=32",
              "model.tiny.intermediate_size=64", "model.tiny.num_layers=1", "model.tiny.max_positions=32"]

    def cfg(run: str, steps: int):
        return load_config(root / "recipes" / "rm_fimi.toml", [f'out="{tmp_path / run}"', f"rm.steps={steps}", *common])

    rm_train(cfg("full", 5), console=quiet)
    rm_train(cfg("cut", 3), console=quiet)
    rm_train(cfg("cut", 5), resume=True, console=quiet)
    full, cut = (load_file(tmp_path / r / "reward_model" / "model.safetensors") for r in ("full", "cut"))
    assert full.keys() == cut.keys() and all(torch.equal(full[k], cut[k]) for k in full)
    fitters = [load_trainer_state(latest_checkpoint(tmp_path / r / "checkpoints"))["loop"]["length_head"]
               for r in ("full", "cut")]
    assert torch.equal(fitters[0], fitters[1])
    rows = [[json.loads(x) for x in (tmp_path / r / "metrics.jsonl").read_text().splitlines()] for r in ("full", "cut")]
    assert [x["rm/fimi_phase"] for x in rows[1]] == [0, 1, 1, 2, 2]
    assert [x["rm/loss"] for x in rows[0]] == [x["rm/loss"] for x in rows[1]]
