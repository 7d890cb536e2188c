"""Behaviour corrections (posttrain/algorithms/offpolicy.py): hand examples, masks, and what sets
each apart (capping vs dropping tokens vs dropping sequences)."""

import math

import pytest
import torch

from posttrain.algorithms import losses, offpolicy


def logs(*ratios):
    return torch.tensor([[math.log(r) for r in row] for row in ratios])


def test_tis_caps_the_ratio():
    # r = [0.5, 1.5, 4] -> min(r, 2) = [0.5, 1.5, 2.0]
    old = logs([0.5, 1.5, 4.0])
    w = offpolicy.weights("tis", old, torch.zeros_like(old), torch.ones_like(old))
    torch.testing.assert_close(w, torch.tensor([[0.5, 1.5, 2.0]]))


def test_icepop_drops_tokens_outside_the_band():
    # band [0.5, 2]: r = [0.4, 1.0, 1.9, 2.5] -> [0, 1.0, 1.9, 0]
    old = logs([0.4, 1.0, 1.9, 2.5])
    w = offpolicy.weights("icepop", old, torch.zeros_like(old), torch.ones_like(old))
    torch.testing.assert_close(w, torch.tensor([[0.0, 1.0, 1.9, 0.0]]))


def test_seq_mask_drops_whole_sequences_on_the_geometric_mean():
    # rows log r = [[0, 0.1], [0.3, 0.3]]: mean 0.05 -> exp 1.051 in [0.9, 1.1], kept with token TIS
    # [1, e^0.1 = 1.10517]; mean 0.3 -> exp 1.350, dropped
    log_r = torch.tensor([[0.0, 0.1], [0.3, 0.3]])
    w = offpolicy.weights("seq_mask", log_r, torch.zeros_like(log_r), torch.ones_like(log_r))
    torch.testing.assert_close(w, torch.tensor([[1.0, math.exp(0.1)], [0.0, 0.0]]))


def test_mis_weights_a_sequence_by_its_ratio_product_and_masks_above_the_cap():
    # R = exp(0.2 + 0.3) = 1.6487 kept on both tokens; exp(0.8 + 0.5) = 3.669 > 3 -> dropped
    log_r = torch.tensor([[0.2, 0.3], [0.8, 0.5]])
    w = offpolicy.weights("mis", log_r, torch.zeros_like(log_r), torch.ones_like(log_r))
    torch.testing.assert_close(w, torch.tensor([[math.exp(0.5)] * 2, [0.0, 0.0]]))


def test_padding_is_zero_and_never_enters_a_sequence_ratio():
    # row 0 has one real token (log r = 0.2) and a padded one whose huge log-ratio must not count
    log_r = torch.tensor([[0.2, 50.0]])
    mask = torch.tensor([[1.0, 0.0]])
    for name in offpolicy.names():
        w = offpolicy.weights(name, log_r, torch.zeros_like(log_r), mask)
        assert w[0, 1] == 0, name
    assert offpolicy.weights("mis", log_r, torch.zeros_like(log_r), mask)[0, 0] == pytest.approx(math.exp(0.2))
    assert offpolicy.weights("seq_mask", log_r, torch.zeros_like(log_r), mask)[0, 0] == 0  # e^0.2 = 1.22 > 1.1


def test_on_policy_tokens_get_weight_one_everywhere():
    lp = torch.randn(3, 5)
    for name in offpolicy.names():
        torch.testing.assert_close(offpolicy.weights(name, lp, lp.clone(), torch.ones(3, 5)), torch.ones(3, 5))


def test_the_distinguishing_behaviour_on_one_batch():
    # one far-off token (r = 10) in row 0, row 1 mildly off everywhere (r = 1.2):
    # tis keeps it capped, icepop drops the token, seq_mask drops row 0 and row 1, mis drops row 0 only
    old = logs([1.0, 10.0, 1.0], [1.2, 1.2, 1.2])
    args = (old, torch.zeros_like(old), torch.ones_like(old))
    tis, ice, seq, mis = (offpolicy.weights(n, *args) for n in ("tis", "icepop", "seq_mask", "mis"))
    assert tis[0, 1] == 2.0 and ice[0, 1] == 0 and ice[0, 0] == 1.0
    assert seq[0].sum() == 0 and seq[1].sum() == 0  # geometric means 2.154 and 1.2, both > 1.1
    assert mis[0].sum() == 0  # R = 10 > 3
    assert mis[1, 0] == pytest.approx(1.2**3)  # R = 1.728 <= 3, on every token of the row


def test_mismatch_stats_hand_example():
    # r = [1, 2]: mean 1.5, max 2, k3 = (0 + (2 - 1 - log 2)) / 2 = 0.153426; tis with cap 1.5 caps one of 2
    old = logs([1.0, 2.0])
    mu, mask = torch.zeros_like(old), torch.ones_like(old)
    w = offpolicy.weights("tis", old, mu, mask, cap=1.5)
    s = offpolicy.mismatch_stats(old, mu, mask, w)
    assert s["ratio_mean"] == pytest.approx(1.5) and s["ratio_max"] == pytest.approx(2.0)
    assert s["mismatch_k3"] == pytest.approx(0.153426, abs=1e-6)
    assert s["clipped_frac"] == pytest.approx(0.5)
    assert offpolicy.mismatch_stats(old, mu, mask, None)["clipped_frac"] == 0.0


def test_weights_reach_the_loss_and_zero_weight_tokens_get_no_gradient():
    lp = torch.zeros(1, 3, requires_grad=True)
    old = logs([1.0, 3.0, 1.0])  # token 1 is out of icepop's band
    w = offpolicy.weights("icepop", old, torch.zeros_like(old), torch.ones_like(old))
    loss = losses.compute("ppo_clip", lp, old, torch.ones(1), torch.ones(1, 3), weights=w).sum()
    loss.backward()
    assert lp.grad[0, 1] == 0 and lp.grad[0, 0] != 0 and lp.grad[0, 2] != 0


def test_unknown_correction_names_the_choices():
    from posttrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="tis"):
        load_config(None, ['algorithm.behaviour_correction="tsi"'])
    with pytest.raises(ConfigError, match="cap"):
        load_config(None, ['algorithm.behaviour_correction="tis"', "algorithm.behaviour_correction_params={cop=2}"])
