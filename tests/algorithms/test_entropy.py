"""Entropy: stable token entropy, AEnt clamped entropy (catalog L219), bonus entries, AEnt state."""

import math

import pytest
import torch

from posttrain.algorithms import entropy

# catalog L219: 10 logits; clamp_p = 0.3 drops the 3 lowest (-1, -2, -3)
LOGITS = torch.tensor([[[3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0]]])


def test_names():
    assert entropy.names() == ["aent", "entropy_bonus"]


def test_token_entropy_uniform_and_shift_invariant():
    # uniform over V = 8 -> log 8 = 2.079442, whatever the common offset (1e4 would overflow exp)
    logits = torch.full((2, 3, 8), 1e4)
    assert torch.allclose(entropy.token_entropy(logits), torch.full((2, 3), math.log(8)))
    # one-hot-like logits -> ~0
    peaked = torch.tensor([[[0.0, -1e9, -1e9]]])
    assert entropy.token_entropy(peaked).item() == pytest.approx(0.0, abs=1e-6)


def test_token_entropy_catalog_full_value():
    # -sum p log p over the 10 logits = 1.4954 (catalog L219)
    assert entropy.token_entropy(LOGITS).item() == pytest.approx(1.4954, abs=1e-4)


def test_token_entropy_with_minus_inf_logits_is_finite_with_finite_gradient():
    logits = torch.tensor([[[1.0, 2.0, float("-inf")]]], requires_grad=True)
    h = entropy.token_entropy(logits)
    # two live logits [1, 2]: p = [0.268941, 0.731059], H = 0.582203
    assert h.item() == pytest.approx(0.582203, abs=1e-6)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all() and logits.grad[0, 0, 2] == 0


def test_token_entropy_gradient_matches_formula():
    # dH/dz_v = -p_v (log p_v + H)
    z = torch.tensor([[[0.3, -0.2, 1.1, 0.0]]], dtype=torch.float64, requires_grad=True)
    h = entropy.token_entropy(z)
    h.sum().backward()
    p = torch.softmax(z.detach().float(), -1).double()
    expected = -p * (torch.log(p) + h.detach()[..., None])
    assert torch.allclose(z.grad, expected, atol=1e-6)


def test_clamped_entropy_catalog_l219():
    # keep the 7 highest logits, renormalize: H_c = 1.4377 (< full 1.4954)
    assert entropy.clamped_entropy(LOGITS, clamp_p=0.3).item() == pytest.approx(1.4377, abs=1e-4)
    # clamp_p = 0 keeps everything
    assert entropy.clamped_entropy(LOGITS, clamp_p=0.0).item() == pytest.approx(1.4954, abs=1e-4)
    with pytest.raises(ValueError):
        entropy.clamped_entropy(LOGITS, clamp_p=1.0)


def test_clamped_entropy_gives_no_gradient_to_dropped_logits():
    z = LOGITS.clone().requires_grad_(True)
    entropy.clamped_entropy(z, clamp_p=0.3).sum().backward()
    assert torch.all(z.grad[0, 0, 7:] == 0) and torch.any(z.grad[0, 0, :7] != 0)


def test_entries_are_negative_coef_times_entropy():
    # a bonus is a negative loss term: -coef H
    assert entropy.compute("entropy_bonus", LOGITS).item() == pytest.approx(-1e-3 * 1.4954, abs=1e-7)
    assert entropy.compute("entropy_bonus", LOGITS, coef=0.5).item() == pytest.approx(-0.5 * 1.4954, abs=1e-4)
    assert entropy.compute("aent", LOGITS).item() == pytest.approx(-2e-4 * 1.4377, abs=1e-7)
    with pytest.raises(TypeError, match="unknown parameter"):
        entropy.compute("aent", LOGITS, beta=1.0)


@pytest.mark.parametrize("name", entropy.names())
def test_entries_shape_and_finite_gradient(name):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g).requires_grad_(True)
    out = entropy.compute(name, logits)
    assert out.shape == (2, 3)
    out.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_aent_update_state_rule():
    s = entropy.AEntState(coef=2e-3, step=1)  # past AReaL's first step (global_step 0 never updates)
    # below the band [0.1, 0.5]: coef - lr (H - low) = 2e-3 - 1e-3 * (0.05 - 0.1) = 2.05e-3
    s1 = entropy.aent_update_state(s, 0.05)
    assert s1.coef == pytest.approx(2.05e-3) and s1.step == 2
    # above: 2e-3 - 1e-3 * (0.9 - 0.5) = 1.6e-3
    assert entropy.aent_update_state(s, 0.9).coef == pytest.approx(1.6e-3)
    # inside: unchanged
    assert entropy.aent_update_state(s, 0.3).coef == pytest.approx(2e-3)
    # box: 2e-3 - 1e-3 * (100 - 0.5) < 1e-5 -> 1e-5; far below -> capped at 1e-2
    assert entropy.aent_update_state(s, 100.0).coef == pytest.approx(1e-5)
    assert entropy.aent_update_state(s, 0.0, coef_lr=10.0).coef == pytest.approx(1e-2)
    # pure: the old state is unchanged
    assert s.coef == 2e-3 and s.step == 1


def test_aent_update_state_warmup_as_areal():
    # AReaL updates when global_step > warmup_steps, global_step = 0, 1, 2, ...: with warmup 2 the
    # calls at global steps 0, 1, 2 leave the coefficient alone, the fourth (global step 3) moves it
    s = entropy.AEntState(coef=2e-3)
    for _ in range(3):
        s = entropy.aent_update_state(s, 0.0, warmup_steps=2)
    assert s.coef == 2e-3 and s.step == 3
    assert entropy.aent_update_state(s, 0.0, warmup_steps=2).coef == pytest.approx(2e-3 + 1e-3 * 0.1)
    # warmup 0 still skips global step 0
    first = entropy.aent_update_state(entropy.AEntState(coef=2e-3), 0.0)
    assert first == entropy.AEntState(coef=2e-3, step=1)
    assert entropy.aent_update_state(first, 0.0).coef == pytest.approx(2e-3 + 1e-3 * 0.1)


def test_aent_state_starts_from_the_recipes_coef_and_replaces_it():
    # no state yet: the rule starts from coef (the first call, global step 0, does not move it);
    # 0.05 is below the band: 3e-3 + 1e-3 * 0.05 = 3.05e-3
    s = entropy.aent_update_state(None, 0.05, coef=3e-3)
    assert s == entropy.AEntState(coef=3e-3, step=1)
    s = entropy.aent_update_state(s, 0.05, coef=3e-3)
    assert s == entropy.AEntState(coef=pytest.approx(3.05e-3), step=2)
    # the entry reads the state's coefficient once there is one: -1e-2 * 1.4377 (catalog L219)
    term = entropy.compute("aent", LOGITS, coef=5.0, state=entropy.AEntState(coef=1e-2))
    assert term.item() == pytest.approx(-1e-2 * 1.4377, abs=1e-6)


@pytest.mark.parametrize("name", entropy.names())
def test_term_is_minus_coef_times_the_measure(name):
    # measure() is the H_t the entry regularizes (full for entropy_bonus, clamped for aent)
    assert set(entropy.MEASURES) == set(entropy.names())
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 3, 11, generator=g)
    h = entropy.measure(name, logits, coef=0.3, clamp_p=0.3)
    torch.testing.assert_close(entropy.compute(name, logits, coef=0.3), -0.3 * h)
    assert entropy.measure("aent", LOGITS).item() == pytest.approx(1.4377, abs=1e-4)
    assert entropy.measure("entropy_bonus", LOGITS).item() == pytest.approx(1.4954, abs=1e-4)


def test_every_entry_is_documented():
    for name in entropy.names():
        doc = " ".join(entropy.REGISTRY.doc(name).split())
        assert ("arXiv" in doc or "papers/" in doc) and "Nearest neighbour" in doc, name
