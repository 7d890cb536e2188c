"""VESPO (arXiv:2602.10693; posttrain/algorithms/losses_soft.py): hand example, invariants, TRL 1.16's own
``GRPOTrainer.get_gamma_weights`` on random inputs, and a two-step run where it updates unlike ppo_clip."""

from __future__ import annotations

import json
import math

import pytest
import torch

from posttrain.algorithms import aggregation, losses, offpolicy
from posttrain.algorithms.losses_soft import gamma_weights
from posttrain.config import ConfigError

DEFAULTS = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}  # TRL's and the paper's


def _phi(log_w: float, k: float, lam: float) -> float:
    return math.exp(lam + k * log_w - lam * math.exp(log_w))


def _loss_and_grad(logp, old, adv, mask, **kw):
    x = logp.clone().requires_grad_(True)
    out = losses.compute("vespo", x, old, adv, mask, **kw)
    (g,) = torch.autograd.grad(out.sum(), x)
    return out.detach(), g


# --- (a) hand-computed example ----------------------------------------------------------------------


def test_hand_example():
    # one response of two tokens, log pi = [-1, -2], log-ratios to pi_old [0.1, 0.2]:
    # log w = 0.1 + 0.2 = 0.3 (a sum: no length normalization), w = e^0.3 = 1.349859
    # A = +1 (k = 2, lam = 3): log phi = 3 + 2 * 0.3 - 3 * 1.349859 = 3.6 - 4.049576 = -0.449576, phi = 0.637898
    #   l_t = -phi * A * log pi_t = [0.637898, 1.275797]; d l_t / d log pi_t = -phi A = -0.637898
    # A = -1 (k = 3, lam = 2): log phi = 2 + 3 * 0.3 - 2 * 1.349859 = 2.9 - 2.699718 = 0.200282, phi = 1.221748
    #   l_t = -phi * (-1) * log pi_t = [-1.221748, -2.443495]; gradient +1.221748
    logp = torch.tensor([[-1.0, -2.0]])
    old = logp - torch.tensor([[0.1, 0.2]])
    mask = torch.ones(1, 2)
    out, g = _loss_and_grad(logp, old, torch.tensor([1.0]), mask)
    assert out.flatten().tolist() == pytest.approx([0.637898, 1.275797], abs=1e-6)
    assert g.flatten().tolist() == pytest.approx([-0.637898] * 2, abs=1e-6)
    out, g = _loss_and_grad(logp, old, torch.tensor([-1.0]), mask)
    assert out.flatten().tolist() == pytest.approx([-1.221748, -2.443495], abs=1e-6)
    assert g.flatten().tolist() == pytest.approx([1.221748] * 2, abs=1e-6)
    # the docstring's numbers are these
    assert _phi(0.3, 2, 3) == pytest.approx(0.637898, abs=1e-6)
    assert _phi(0.3, 3, 2) == pytest.approx(1.221748, abs=1e-6)


def test_kernel_shape_peak_and_decay():
    # phi(w) = e^lam w^k e^-lam w peaks at w = k / lam: 2/3 for A >= 0, 3/2 for A < 0, and vanishes far away
    mask = torch.ones(1, 1)
    for adv, k, lam in ((1.0, 2.0, 3.0), (-1.0, 3.0, 2.0)):
        logs = torch.linspace(-6, 3, 901)
        phis = torch.stack([gamma_weights(torch.tensor([[x]]), torch.tensor([[adv]]), mask, **DEFAULTS)[0, 0]
                            for x in logs])
        assert math.exp(float(logs[phis.argmax()])) == pytest.approx(k / lam, abs=0.02)
        assert float(phis[0]) < 1e-3 and float(phis[-1]) < 1e-3  # w = e^-6: <= e^(3 - 12); w = e^3: e^(3 + 6 - 60)
        assert (phis >= 0).all()


# --- (b) invariants ------------------------------------------------------------------------------------


def _random(seed: int, n: int = 6, t: int = 8):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g) * 3
    logp = old + 0.2 * torch.randn(n, t, generator=g)
    mask = (torch.rand(n, t, generator=g) > 0.25).float()
    mask[:, 0] = 1.0
    return logp, old, torch.randn(n, generator=g), mask, g


def test_ratio_one_gives_the_policy_gradient():
    # w = 1 -> phi = e^lam * 1 * e^-lam = 1 for either sign: d l / d log pi = -A, and with token_mean -A m / sum m
    _, old, adv, mask, _ = _random(0)
    out, g = _loss_and_grad(old, old, adv, mask)
    torch.testing.assert_close(g, -adv[:, None] * mask)
    x = old.clone().requires_grad_(True)
    aggregation.reduce("token_mean", losses.compute("vespo", x, old, adv, mask), mask).backward()
    torch.testing.assert_close(x.grad, -adv[:, None] * mask / mask.sum())


def test_gradient_keeps_the_policy_gradient_sign_and_one_scale_per_response():
    # phi >= 0 and is one number per response: the gradient is -phi_i A_i on every token of response i, never
    # reversed (unlike a clip it never drops a token either, unless phi underflows far from w = 1)
    logp, old, adv, mask, _ = _random(1)
    _, g = _loss_and_grad(logp, old, adv, mask)
    scale = g / (-adv[:, None])
    for i in range(len(adv)):
        on = mask[i].bool()
        assert (scale[i, on] >= 0).all()
        torch.testing.assert_close(scale[i, on], scale[i, on][0].expand(int(on.sum())))
    assert (g[mask == 0] == 0).all()


def test_padding_never_enters_the_sequence_ratio():
    logp, old, adv, mask, _ = _random(2)
    garbage = torch.where(mask > 0, old, old + 50.0)  # a huge log-ratio under the mask
    torch.testing.assert_close(losses.compute("vespo", logp, garbage, adv, mask),
                               losses.compute("vespo", logp, old, adv, mask))


def test_behaviour_weights_fold_into_the_sequence_ratio_instead_of_multiplying():
    # with correction weights c_t = pi_old / mu: log w = sum(log pi - log pi_old) + sum log c = sum(log pi - log mu),
    # i.e. the same as moving pi_old to mu; the per-token loss is not multiplied by c
    logp, old, adv, mask, g = _random(3)
    c = torch.exp(0.3 * torch.randn(old.shape, generator=g)) * mask
    folded = losses.compute("vespo", logp, old, adv, mask, weights=c)
    torch.testing.assert_close(folded, losses.compute("vespo", logp, old - torch.log(c.clamp(min=1e-30)), adv, mask))
    assert not torch.allclose(folded, losses.compute("vespo", logp, old, adv, mask) * c)
    assert losses.FOLDED_WEIGHTS in losses.REGISTRY.params("vespo")


def test_bad_parameters_are_rejected_by_the_loss_and_the_config(tiny_cfg):
    logp, old, adv, mask, _ = _random(4)
    with pytest.raises(ValueError, match="k_neg"):
        losses.compute("vespo", logp, old, adv, mask, k_neg=-1.0)
    with pytest.raises(ValueError, match="lambda_pos"):
        losses.compute("vespo", logp, old, adv, mask, lambda_pos=0.0)
    with pytest.raises(ConfigError, match=r"rejected by 'vespo': k_pos \(VESPO's power exponent\) must be"):
        tiny_cfg("algorithm.loss=vespo", "algorithm.loss_params={k_pos=-2}")
    with pytest.raises(ConfigError, match=r"lambda_neg \(VESPO's decay rate\) must be a finite number > 0"):
        tiny_cfg("algorithm.loss=vespo", "algorithm.loss_params={lambda_neg=0}")
    with pytest.raises(ConfigError, match="has no parameter"):
        tiny_cfg("algorithm.loss=vespo", "algorithm.loss_params={k=2}")
    with pytest.raises(ConfigError, match="'behaviour_weights' is an input"):
        tiny_cfg("algorithm.loss=vespo", "algorithm.loss_params={behaviour_weights=1.0}")
    # TRL accepts only token-level IS modes with VESPO; 'mis' repeats a sequence ratio on every token
    with pytest.raises(ConfigError, match="'mis' repeats a sequence's ratio"):
        tiny_cfg("algorithm.loss=vespo", "algorithm.behaviour_correction=mis")
    assert tiny_cfg("algorithm.loss=vespo", "algorithm.behaviour_correction=tis").algorithm.loss == "vespo"


# --- (c) TRL 1.16's own code --------------------------------------------------------------------------


def _trl_is_ratio(old, sampling, mask, mode: str, cap: float, low: float | None = None):
    """TRL 1.16 ``_generate_and_score_completions``' vLLM importance-sampling ratio, token modes, transcribed:
    exp((old - sampling) * mask), clamped above (token_truncate) or zeroed outside [low, cap] (token_mask)."""
    r = torch.exp((old - sampling) * mask)
    if mode == "token_truncate":
        return torch.clamp(r, max=cap)
    return r.masked_fill((r < (low if low is not None else -math.inf)) | (r > cap), 0.0)


@pytest.mark.parametrize("case", ["on_old", "token_truncate", "token_mask", "token_advantages", "params"])
def test_matches_trl_get_gamma_weights_on_random_inputs(case):
    trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
    worst = 0.0
    for seed in range(5):
        logp, old, adv, mask, g = _random(10 + seed, n=8, t=12)
        logp = old + 0.15 * torch.randn(old.shape, generator=g)  # some w far from 1, some near
        sampling = old + 0.1 * torch.randn(old.shape, generator=g)
        params = dict(DEFAULTS)
        if case == "params":
            params = {"k_pos": 1.5, "lambda_pos": 0.7, "k_neg": 0.0, "lambda_neg": 4.0}
        adv_trl = adv[:, None]
        if case == "token_advantages":
            adv_trl = torch.randn(old.shape, generator=g)
        is_ratio, w = None, None
        if case == "token_truncate":
            is_ratio = _trl_is_ratio(old, sampling, mask, "token_truncate", cap=1.1)
            w = offpolicy.weights("tis", old, sampling, mask, cap=1.1)
        if case == "token_mask":
            is_ratio = _trl_is_ratio(old, sampling, mask, "token_mask", cap=1.1, low=0.9)
            w = offpolicy.weights("icepop", old, sampling, mask, low=0.9, high=1.1)
        x = logp.clone().requires_grad_(True)
        ours = losses.compute("vespo", x, old, adv_trl.squeeze(1) if adv_trl.shape[1] == 1 else adv_trl, mask,
                              weights=w, **params)
        ours_scalar = aggregation.reduce("token_mean", ours, mask)
        (ours_grad,) = torch.autograd.grad(ours_scalar, x)
        # TRL: phi from its static method, then _compute_loss' lines for loss_type="vespo" (transcribed):
        # per_token_loss = -phi_seq * advantages * per_token_logps; loss = (per_token_loss * mask).sum() / num_items
        y = logp.clone().requires_grad_(True)
        phi = trl_grpo.GRPOTrainer.get_gamma_weights(
            advantages=adv_trl, log_ratio_per_token=y - old, mask=mask, importance_sampling_ratio=is_ratio,
            k_pos=params["k_pos"], lambda_pos=params["lambda_pos"], k_neg=params["k_neg"],
            lambda_neg=params["lambda_neg"],
        )
        per_token = -phi * adv_trl * y
        trl_scalar = (per_token * mask).sum() / mask.sum()
        (trl_grad,) = torch.autograd.grad(trl_scalar, y)
        for a, b in ((ours, per_token.detach() * mask), (ours_scalar, trl_scalar), (ours_grad, trl_grad)):
            worst = max(worst, float((a.detach() - b.detach()).abs().max()))
        if case == "on_old":
            assert float((phi - 1).abs().max()) > 0.05  # the inputs do move w off 1
    print(f"\nvespo vs TRL ({case}): max abs difference {worst:.3g}")
    assert worst <= 1e-5


# --- (d) the real loop --------------------------------------------------------------------------------


def test_a_run_updates_unlike_ppo_clip_on_the_same_batch(tiny_cfg, quiet, tmp_path, test_entries, monkeypatch):
    # two minibatches: the first is on-policy (w = 1, phi = 1, the same gradient as ppo_clip at ratio 1); on the
    # second the policy has moved and phi(w_i) weights each response, so the update differs from ppo_clip's
    import posttrain.algorithms.losses_soft as soft
    from posttrain.train.rl import train

    phis: list[torch.Tensor] = []
    real = soft.gamma_weights

    def spy(*args, **kwargs):
        out = real(*args, **kwargs)
        phis.append(out.detach().clone())
        return out

    def run(name: str, loss: str) -> list[dict]:
        cfg = tiny_cfg(f"algorithm.loss={loss}", "algorithm.loss_params={}", "train.steps=2", "train.minibatches=2",
                       "checkpoint.every=0", "eval.every=0", 'reward=[{name="test_length"}]', "train.lr=1e-2",
                       out=str(tmp_path / name))
        train(cfg, console=quiet)
        return [json.loads(x) for x in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    monkeypatch.setattr(soft, "gamma_weights", spy)
    vespo = run("vespo", "vespo")
    ppo = run("ppo", "ppo_clip")
    phis = [p for p in phis if p.numel() > 1]  # not the config's 1 x 1 parameter probe
    assert len(phis) == 4  # 2 steps x 2 minibatches
    assert torch.allclose(phis[0], torch.ones_like(phis[0]), atol=1e-4)  # on-policy: w = 1 up to rounding
    assert max(float((p - 1).abs().max()) for p in phis[1:]) > 1e-3  # off-policy minibatches reweighted
    assert all(math.isfinite(r["loss"]) and r["train/nonfinite"] == 0 for r in vespo)
    assert vespo[0]["reward/mean"] == ppo[0]["reward/mean"]  # the same first batch
    assert vespo[0]["optim/grad_norm"] != pytest.approx(ppo[0]["optim/grad_norm"], rel=1e-4)
