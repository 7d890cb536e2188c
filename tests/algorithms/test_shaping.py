"""Tests for posttrain.algorithms.shaping: worked numbers from the catalog, invariants, state."""

from __future__ import annotations

import math

import pytest
import torch

from posttrain.algorithms import advantages, shaping
from posttrain.algorithms.registry import UnknownNameError

T = torch.tensor


def close(x: torch.Tensor, expected: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(x, T(expected, dtype=x.dtype), atol=atol, rtol=0)


def _extra_inputs(p: int, g: int, gen: torch.Generator) -> dict[str, object]:
    k = 3
    step_mask = torch.ones(p, g, k)
    step_mask[0, 0, 2:] = 0
    return {
        "lengths": torch.randint(1, 50, (p, g), generator=gen).float(),
        "max_length": 40,
        "buffer": 10,
        "fp_rate": 0.1,
        "fn_rate": 0.2,
        "ref_rewards": torch.randn(p, 2, generator=gen),
        "step_rewards": torch.rand(p, g, k, generator=gen),
        "step_mask": step_mask,
    }


def test_registry_contract():
    assert shaping.names() == [
        "noisy_verifier_backward", "noisy_verifier_forward", "overlong", "par", "prm_clip",
        "prm_delta", "rank", "traac_length",
    ]  # fmt: skip
    with pytest.raises(UnknownNameError, match="overlong"):
        shaping.compute("overlongg", torch.zeros(1, 2))
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        shaping.compute("rank", torch.zeros(2))


@pytest.mark.parametrize("name", shaping.names())
@pytest.mark.parametrize("g", [1, 4])
def test_every_shaper_finite_with_all_inputs(name, g):
    gen = torch.Generator().manual_seed(g)
    p = 3
    rewards = (torch.rand(p, g, generator=gen) > 0.5).float()
    rewards[1] = 1.0
    out = shaping.compute(name, rewards, unused_input=1, **_extra_inputs(p, g, gen))
    assert out.shape == (p, g)
    assert torch.isfinite(out).all()


def test_overlong_dapo_ramp():
    # L_exp = 20480 - 4096 = 16384; 18432 -> -(2048/4096) = -.5; 20480 -> -1
    lengths = T([[16000.0, 16384.0, 18432.0, 20480.0]])
    out = shaping.compute("overlong", torch.ones(1, 4), lengths=lengths, max_length=20480, buffer=4096)
    close(out, [[1.0, 1.0, 0.5, 0.0]])
    out = shaping.compute(
        "overlong", torch.zeros(1, 4), lengths=lengths, max_length=20480, buffer=4096, penalty=2.0
    )
    close(out, [[0.0, 0.0, -1.0, -2.0]])
    with pytest.raises(ValueError):
        shaping.compute("overlong", torch.zeros(1, 1), lengths=T([[1.0]]), max_length=10, buffer=0)


def test_noisy_verifier_backward_and_forward():
    r = T([[1.0, 0.0, 0.0, 1.0]])
    # backward: (1 - .1)/(1 - .3) = 1.285714; (0 - .1)/.7 = -.142857
    back = shaping.compute("noisy_verifier_backward", r, fp_rate=0.1, fn_rate=0.2)
    close(back, [[1.285714, -0.142857, -0.142857, 1.285714]])
    # forward: the paper's weights (.2, -.8) rescaled to (w + .8)/.8: 1/.8 = 1.25 for an observed 1, 0 for a 0
    fwd = shaping.compute("noisy_verifier_forward", r, fp_rate=0.1, fn_rate=0.2)
    close(fwd, [[1.25, 0.0, 0.0, 1.25]])
    # both are affine: GRPO advantages are unchanged (catalog 3.3 caveat)
    base = advantages.compute("grpo", r)
    torch.testing.assert_close(advantages.compute("grpo", back), base, atol=1e-5, rtol=0)
    torch.testing.assert_close(advantages.compute("grpo", fwd), base, atol=1e-5, rtol=0)
    with pytest.raises(ValueError):
        shaping.compute("noisy_verifier_backward", r, fp_rate=0.6, fn_rate=0.5)


def test_backward_correction_is_unbiased():
    # clean R=1 is observed as 1 w.p. 1 - rho1 and 0 w.p. rho1: E[R^] = 1; clean R=0: E[R^] = 0
    rho0, rho1 = 0.1, 0.2
    hat = shaping.compute("noisy_verifier_backward", T([[1.0, 0.0]]), fp_rate=rho0, fn_rate=rho1)[0]
    assert (1 - rho1) * hat[0] + rho1 * hat[1] == pytest.approx(1.0)
    assert rho0 * hat[0] + (1 - rho0) * hat[1] == pytest.approx(0.0, abs=1e-7)


def test_par_sigmoid_against_references():
    # r=2, refs [1, 3]: (sigmoid(1) + sigmoid(-1))/2 = .5; ref [1]: sigmoid(1) = .731059
    close(shaping.compute("par", T([[2.0]]), ref_rewards=T([[1.0, 3.0]])), [[0.5]])
    close(shaping.compute("par", T([[2.0]]), ref_rewards=T([[1.0]])), [[0.731059]])
    # refs [1.5, 3.5, 1.0]: (sig(.5) + sig(-1.5) + sig(1))/3 = (.622459 + .182426 + .731059)/3
    close(shaping.compute("par", T([[2.0]]), ref_rewards=T([[1.5, 3.5, 1.0]])), [[0.511981]])
    # per-response references [P, G, M] and k
    out = shaping.compute("par", T([[2.0, 0.0]]), ref_rewards=T([[[1.0], [0.0]]]), k=2.0)
    close(out, [[1 / (1 + math.exp(-2.0)), 0.5]])


def test_rank_average_ties():
    # ranks [4, 1, 2.5, 2.5] -> (4 - rank)/3 = [0, 1, .5, .5]; then GRPO -> [-1.2247, 1.2247, 0, 0]
    out = shaping.compute("rank", T([[0.2, 0.9, 0.5, 0.5]]))
    close(out, [[0.0, 1.0, 0.5, 0.5]])
    close(advantages.compute("grpo", out), [[-1.224742, 1.224742, 0.0, 0.0]])
    close(shaping.compute("rank", T([[3.0, 3.0]])), [[0.5, 0.5]])
    close(shaping.compute("rank", T([[7.0]])), [[0.5]])


def test_traac_length_worked_number():
    # easy group (p = 1), L = 300, history [200, 400, 600]:
    # L_norm = (600 - 300)/(600 - 200) = .75; soft = 1/(1 + exp((300 - 400)/40)) = .924142
    # r_len = 1.0 * max(.75, .924142) -> 1 + .924142
    st = shaping.TRAACState(easy=((200.0, 400.0, 600.0),))
    out = shaping.compute("traac_length", T([[1.0]]), lengths=T([[300.0]]), state=st)
    close(out, [[1.924142]])
    # wrong responses get no length reward; hard bucket scale .5 (p = 1/4 < .3)
    st = shaping.TRAACState(hard=((200.0, 400.0, 600.0),))
    out = shaping.compute("traac_length", T([[1.0, 0.0, 0.0, 0.0]]), lengths=T([[300.0] * 4]), state=st)
    close(out, [[1.0 + 0.5 * 0.924142, 0.0, 0.0, 0.0]])


def test_traac_length_without_history_uses_current_batch():
    # no state: the easy bucket's history is the batch's correct lengths [100, 300]
    # L=100: L_norm 1 -> 1; L=300: L_norm 0, soft = 1/(1 + exp(100/20)) = .006693
    out = shaping.compute("traac_length", T([[1.0, 1.0]]), lengths=T([[100.0, 300.0]]))
    close(out, [[2.0, 1.006693]])


def test_traac_state_update_window():
    r = T([[1.0, 1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    lengths = T([[1.0, 2.0, 3.0, 4.0, 5.0], [6.0, 7.0, 8.0, 9.0, 10.0]])
    st = shaping.traac_length_update_state(None, r, lengths)
    # group 0 easy (p=1), group 1 hard (p=.2); only correct lengths are kept
    assert st == shaping.TRAACState(easy=((1.0, 2.0, 3.0, 4.0, 5.0),), hard=((6.0,),))
    for _ in range(3):
        st = shaping.traac_length_update_state(st, r, lengths, window=2)
    assert len(st.easy) == 2 and len(st.hard) == 2 and st.medium == ()


def test_prm_clip_and_delta():
    steps = T([[[0.9, 0.2, 0.6, 0.8]]])
    # clip (eta .5): min(r - .5, 0) = [0, -.3, 0, 0] -> sum -.3
    close(shaping.prm_clip_steps(steps), [[[0.0, -0.3, 0.0, 0.0]]])
    close(shaping.compute("prm_clip", T([[1.0]]), step_rewards=steps), [[0.7]])
    # delta: [.9-.2, .2-.6, .6-.8, 0] = [.7, -.4, -.2, 0] -> returns-to-go [.1, -.6, -.2, 0]
    delta = shaping.prm_delta_steps(steps)
    close(delta, [[[0.7, -0.4, -0.2, 0.0]]])
    close(delta.flip(-1).cumsum(-1).flip(-1), [[[0.1, -0.6, -0.2, 0.0]]])
    close(shaping.compute("prm_delta", T([[1.0]]), step_rewards=steps), [[1.1]])  # 1 + (.9 - .8)


def test_prm_step_mask():
    # the last real step is index 1: delta = [.9 - .2, 0, 0, 0]; clip ignores masked steps
    steps = T([[[0.9, 0.2, 0.1, 0.1]]])
    mask = T([[[1.0, 1.0, 0.0, 0.0]]])
    close(shaping.prm_delta_steps(steps, mask), [[[0.7, 0.0, 0.0, 0.0]]])
    close(shaping.compute("prm_clip", T([[0.0]]), step_rewards=steps, step_mask=mask), [[-0.3]])
