import pytest
import torch

from posttrain.diagnostics import group_stats


def test_group_stats_hand_example():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]])
    adv = torch.tensor([[0.0, 0.0], [-0.7071, 0.7071], [0.0, 0.0]])
    s = group_stats(rewards, adv)
    # group 0 all correct, group 1 mixed, group 2 all wrong
    assert s["solve_all"] == pytest.approx(1 / 3)
    assert s["solve_partial"] == pytest.approx(1 / 3)
    assert s["solve_none"] == pytest.approx(1 / 3)
    assert s["zero_std_frac"] == pytest.approx(2 / 3)  # groups 0 and 2
    assert s["zero_adv_frac"] == pytest.approx(4 / 6)  # the four samples of groups 0 and 2
    assert s["reward_mean"] == pytest.approx(0.5)  # 3 / 6


def test_threshold_correct_override_and_token_advantages():
    # format-bonus rewards: 1.1 correct, 0.1 wrong; threshold 0.5 separates them
    rewards = torch.tensor([[1.1, 0.1, 0.1], [0.1, 0.1, 0.1]])
    s = group_stats(rewards, threshold=0.5)
    assert (s["solve_partial"], s["solve_none"], s["solve_all"]) == (0.5, 0.5, 0.0)
    assert "zero_adv_frac" not in s
    # the verifier's verdicts take precedence over the threshold
    correct = torch.tensor([[True, True, True], [False, False, False]])
    s = group_stats(rewards, correct_PG=correct)
    assert (s["solve_all"], s["solve_none"]) == (0.5, 0.5)
    # non-binary rewards: group 0 is solve_partial but not zero-std; group 1 is zero-std
    assert s["zero_std_frac"] == 0.5
    # token-level advantages [P, G, T]: a sample is zero when all its tokens are
    adv = torch.zeros(2, 3, 4)
    adv[0, 0, 2] = 0.3
    assert group_stats(rewards, adv)["zero_adv_frac"] == pytest.approx(5 / 6)


def test_rejects_bad_shape():
    with pytest.raises(ValueError):
        group_stats(torch.zeros(6))
