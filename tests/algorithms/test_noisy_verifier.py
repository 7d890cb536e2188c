"""The noisy-verifier corrections (arXiv:2510.00915) under each kind of advantage estimator.

Both corrections are affine in the verifier's reward (r -> a r + b, a > 0). Group std normalisation
undoes that (grpo, reinforce_pp: the corrected run makes the uncorrected updates), so the config
rejects it; a mean baseline keeps the factor a (rloo, dr_grpo: the clean advantage's scale); the
0.5-threshold estimators must read a corrected correct answer as correct (mapo used to flip signs).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from posttrain.algorithms import advantages, shaping
from posttrain.config import ConfigError, load_config

T = torch.tensor
RATES = {"fp_rate": 0.1, "fn_rate": 0.2}
CORRECTIONS = ("noisy_verifier_backward", "noisy_verifier_forward")
RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "noisy_verifier.toml"


def close(x: torch.Tensor, expected: list | torch.Tensor, atol: float = 1e-5) -> None:
    """Assert ``x`` equals ``expected`` to ``atol``."""
    torch.testing.assert_close(x, torch.as_tensor(expected, dtype=x.dtype), atol=atol, rtol=0)


def pm(v: float) -> list[list[float]]:
    """The advantages [[v, -v, -v, v]] of the group [1, 0, 0, 1]."""
    return [[v, -v, -v, v]]


def shaped(name: str, r: torch.Tensor, **rates: float) -> torch.Tensor:
    """``r`` through the correction ``name`` (rates default to fp 0.1, fn 0.2)."""
    return shaping.compute(name, r, **(rates or RATES))


@pytest.mark.parametrize("name", CORRECTIONS)
def test_grpo_and_reinforce_pp_cancel_the_correction(name):
    # grpo on [1, 0, 0, 1]: (r - .5) / std_unbiased = +-.5 / .57735 = +-.866025, corrected or not (the
    # std scales by a too); reinforce_pp whitens the same returns over the batch's tokens
    r = T([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    c = shaped(name, r)
    assert not torch.allclose(c, r)
    close(advantages.compute("grpo", c), advantages.compute("grpo", r))
    close(advantages.compute("grpo", c)[0], [0.866025, -0.866025, -0.866025, 0.866025])
    mask = torch.ones(2, 4, 3)
    mask[0, 1, 2] = 0.0
    close(advantages.compute("reinforce_pp", c, mask=mask), advantages.compute("reinforce_pp", r, mask=mask))


@pytest.mark.parametrize("name", CORRECTIONS)
@pytest.mark.parametrize("advantage", ["grpo", "reinforce_pp", "mapo", "w_reinforce", "passk", "lens"])
def test_config_rejects_a_correction_the_estimator_loses(name, advantage, tiny_cfg):
    shaper = f'algorithm.shapers=[{{name="{name}", params={{fp_rate=0.1, fn_rate=0.2}}}}]'
    why = {"grpo": "cancels exactly", "reinforce_pp": "cancels exactly", "mapo": "flipping the signs",
           "w_reinforce": "reads only whether reward > 0.5", "passk": "reads only whether reward > 0.5",
           "lens": "not a mean baseline"}[advantage]  # fmt: skip
    with pytest.raises(ConfigError, match=rf"shapers\[0\]: '{name}' is an affine map.*{why}.*'dr_grpo', 'opo', 'rloo'"):
        tiny_cfg(shaper, f'algorithm.advantage="{advantage}"', "algorithm.advantage_params={}")


@pytest.mark.parametrize("name", CORRECTIONS)
@pytest.mark.parametrize("advantage", ["rloo", "dr_grpo", "opo", "grpo_std_none", "remax"])
def test_config_accepts_a_mean_baseline(name, advantage, tiny_cfg):
    # remax: its greedy baseline is corrected too (prepare/providers.py):
    # A = (a r_i + b) - (a r_g + b) = a (r_i - r_g)
    shaper = f'algorithm.shapers=[{{name="{name}", params={{fp_rate=0.1, fn_rate=0.2}}}}]'
    adv = ['algorithm.advantage="grpo"', 'algorithm.advantage_params={std="none"}'] if advantage == "grpo_std_none" \
        else [f'algorithm.advantage="{advantage}"']  # fmt: skip
    cfg = tiny_cfg(shaper, *adv)
    assert cfg.algorithm.shapers[0].name == name
    # and the other shapers stay free to go with grpo
    assert tiny_cfg('algorithm.shapers=[{name="overlong", params={max_length=6, buffer=2}}]')


def test_a_mean_baseline_keeps_the_correction_hand_computed():
    r = T([[1.0, 0.0, 0.0, 1.0]])
    # rloo = G/(G-1) (r - mean): uncorrected 4/3 * +-.5 = +-.666667
    close(advantages.compute("rloo", r), pm(0.666667))
    # backward: R^ = [9/7, -1/7, -1/7, 9/7], mean 4/7, r - mean = +-5/7; * 4/3 = +-.952381 (= .666667 / .7)
    close(advantages.compute("rloo", shaped("noisy_verifier_backward", r)), pm(0.952381))
    # forward: R' = [1.25, 0, 0, 1.25], mean .625, * 4/3 = +-.833333 (= .666667 / .8); the paper's weights
    # (.2, -.8) as rewards would give +-.666667, the uncorrected advantages
    close(advantages.compute("rloo", shaped("noisy_verifier_forward", r)), pm(0.833333))
    # dr_grpo = r - mean: +-.5 uncorrected, +-5/7 = +-.714286 backward, +-.625 forward
    close(advantages.compute("dr_grpo", r), pm(0.5))
    close(advantages.compute("dr_grpo", shaped("noisy_verifier_backward", r)), pm(0.714286))
    close(advantages.compute("dr_grpo", shaped("noisy_verifier_forward", r)), pm(0.625))


def test_mapo_reads_a_corrected_correct_answer_as_correct():
    # the paper's forward weights scored a correct answer rho1 = .2 < .5: mapo then counted p = 0 (lambda = 1)
    # and divided by the mean -.3: [1, 0, 0, 1] -> [-1.67, 1.67, 1.67, -1.67]. Now 1.25 > .5: p = .5, lambda
    # = 1 - 4 * .5 * .5 = 0, so A = grpo = +-.866025, correct answers up
    r = T([[1.0, 0.0, 0.0, 1.0]])
    for name in CORRECTIONS:
        adv = advantages.compute("mapo", shaped(name, r))
        close(adv, pm(0.866025))
        assert (adv[r > 0.5] > 0).all() and (adv[r < 0.5] < 0).all()
    # forward keeps the bit and only rescales, and mapo's two parts are scale-free: the uncorrected advantages
    r2 = T([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    fwd = shaped("noisy_verifier_forward", r2)
    for estimator in ("mapo", "nsr", "w_reinforce", "passk"):
        kw = {"k": 2} if estimator == "passk" else {}
        close(advantages.compute(estimator, fwd, **kw), advantages.compute(estimator, r2, **kw))


def test_backward_under_mapo_flips_when_the_pass_rate_is_below_fp_rate():
    # why the config rejects mapo: rho0 = .3, rho1 = .2: R^(1) = .7/.5 = 1.4, R^(0) = -.3/.5 = -.6. Group
    # [1, 0, 0, 0]: mean = (1.4 - 1.8)/4 = -.1 < 0; grpo part [1.5, -.5, -.5, -.5] (std 1); percent part
    # (r - mean)/mean = [-15, 5, 5, 5]; lambda = 1 - 4 * .25 * .75 = .25:
    # correct .75 * 1.5 + .25 * -15 = -2.625, wrong .75 * -.5 + .25 * 5 = .875
    r = T([[1.0, 0.0, 0.0, 0.0]])
    adv = advantages.compute("mapo", shaped("noisy_verifier_backward", r, fp_rate=0.3, fn_rate=0.2))
    close(adv, [[-2.625, 0.875, 0.875, 0.875]], atol=1e-3)
    assert (advantages.compute("mapo", r)[0, 0] > 0).item()  # uncorrected: correct up


def test_forward_is_a_positive_affine_image_of_the_papers_weights():
    rho0, rho1 = 0.1, 0.2
    r = T([[1.0, 0.0]])
    fwd = shaped("noisy_verifier_forward", r, fp_rate=rho0, fn_rate=rho1)[0]
    w = T([rho1, rho1 - 1.0])  # the paper's weights for an observed 1 and 0
    close(fwd, w / (1.0 - rho1) + 1.0)
    # E[R' | clean 1] = (1 - rho1) * 1.25 = 1; E[R' | clean 0] = rho0 * 1.25 = .125 (0 without false positives):
    # slope (1 - rho0 - rho1)/(1 - rho1) = .875 > 0, the clean direction
    assert (1 - rho1) * fwd[0] + rho1 * fwd[1] == pytest.approx(1.0)
    assert rho0 * fwd[0] + (1 - rho0) * fwd[1] == pytest.approx(0.125)
    # the paper's weights used as advantages are (1 - rho1) x w_reinforce with lam = rho1 / (1 - rho1) = .25
    close((1.0 - rho1) * advantages.compute("w_reinforce", r, lam=rho1 / (1.0 - rho1))[0], w)


def test_the_preset_applies_the_forward_weights_which_no_constant_factor_gives():
    # issue 38, D1: the backward correction under RLOO (the old preset) is 1 / (1 - .1 - .2) = 1 / .7 times the
    # uncorrected RLOO advantage on every sample, one constant factor that Adam and clipping cancel. The preset now
    # uses the paper's forward weights, w = rho1 (says 1), rho1 - 1 (says 0), no baseline, as w_reinforce with
    # lam = rho1 / (1 - rho1) = .25 (w / (1 - rho1); rho1 = .2).
    r = T([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    rloo = advantages.compute("rloo", r)  # [[2/3, -2/3, -2/3, 2/3], [1, -1/3, -1/3, -1/3], [0, 0, 0, 0]]
    back = advantages.compute("rloo", shaping.compute("noisy_verifier_backward", r, **RATES))
    close(back, rloo / 0.7)  # the inert correction: one factor, 1 / .7
    cfg = load_config(RECIPE, [])
    a = cfg.algorithm
    assert a.shapers == [] and a.advantage == "w_reinforce"
    lam = a.advantage_params["lam"]
    assert lam == pytest.approx(0.2 / 0.8)
    adv = advantages.compute(a.advantage, r, **a.advantage_params)
    # correct -> lam = .25, wrong -> -1, in every group, the all-wrong one included (RLOO: 0 there)
    close(adv, [[0.25, -1, -1, 0.25], [0.25, -1, -1, -1], [-1, -1, -1, -1]])
    close((1 - 0.2) * adv, [[0.2, -0.8, -0.8, 0.2], [0.2, -0.8, -0.8, -0.8], [-0.8, -0.8, -0.8, -0.8]])  # w
    # no constant c makes adv = c x rloo: row 0 needs c = .25 / (2/3) = .375 and c = -1 / (-2/3) = 1.5
    for unc in (rloo, r):  # nor c x the raw reward (REINFORCE without a baseline: a wrong answer's 0 maps to -1)
        c = float((adv * unc).sum() / (unc * unc).sum())
        assert float((adv - c * unc).norm()) > 0.5
