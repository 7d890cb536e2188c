import math

import pytest
import torch

from posttrain.diagnostics import (
    RankDynamicsState,
    effective_rank,
    effective_rank_dynamics,
    rank_dynamics_update,
)


def test_identity_like_matrix_has_full_effective_rank():
    d = 6
    eye = torch.eye(d)
    # [I; -I] has zero row mean, so centring keeps it; all singular values sqrt(2) -> ER = d
    assert float(effective_rank(torch.cat([eye, -eye]))) == pytest.approx(d, abs=1e-4)
    # I alone, uncentred: d equal singular values -> d (centred it loses one direction: d - 1)
    assert float(effective_rank(eye, center=False)) == pytest.approx(d, abs=1e-4)
    assert float(effective_rank(eye)) == pytest.approx(d - 1, abs=1e-4)
    # scale invariance
    assert float(effective_rank(7.0 * torch.cat([eye, -eye]))) == pytest.approx(d, abs=1e-4)


def test_rank_one_and_degenerate_matrices():
    g = torch.Generator().manual_seed(0)
    h = torch.outer(torch.randn(20, generator=g), torch.randn(16, generator=g))
    assert float(effective_rank(h)) == pytest.approx(1.0, abs=1e-3)
    assert float(effective_rank(torch.ones(5, 4))) == 0.0  # equal rows: no spread
    assert float(effective_rank(torch.randn(1, 4))) == 0.0  # one row, centred


def test_two_unequal_singular_values():
    # singular values 3 and 1 -> p = (0.75, 0.25), H = 0.562335, ER = exp(H) = 1.754765
    h = torch.diag(torch.tensor([3.0, 1.0]))
    assert float(effective_rank(h, center=False)) == pytest.approx(1.754765, abs=1e-5)


def test_per_sequence_with_mask():
    d = 4
    eye = torch.eye(d)
    seq0 = torch.cat([eye, -eye])  # 8 valid rows, ER = 4
    seq1 = torch.cat([torch.outer(torch.arange(1.0, 4.0), torch.ones(d)), torch.randn(5, d) * 100])
    hidden = torch.stack([seq0, seq1])
    mask = torch.tensor([[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]])  # seq 1: 3 collinear rows + padding
    er = effective_rank(hidden, mask)
    assert er.shape == (2,)
    torch.testing.assert_close(er, torch.tensor([4.0, 1.0]), atol=1e-3, rtol=0)


def test_rank_dynamics_is_deviation_from_running_mean():
    # x = 1, 2, 4, 7
    # d_2 = 2 - 1 = 1;  d_3 = 4 - (1+2)/2 = 2.5;  d_4 = 7 - (1+2+4)/3 = 4.6667
    # dd_3 = 2.5 - 1 = 1.5;  dd_4 = 4.6667 - 2.5 = 2.1667
    # ERV = (1 + 2.5 + 4.6667) / 3 = 2.7222;  ERA = (1.5 + 2.1667) / 2 = 1.8333
    state = RankDynamicsState()
    state = rank_dynamics_update(state, 1.0)
    assert math.isnan(state.erv) and math.isnan(state.era)
    first = state
    for x in (2.0, 4.0, 7.0):
        state = rank_dynamics_update(state, x)
    assert first.count == 1  # pure: the earlier state is untouched
    assert state.erv == pytest.approx(49 / 18)
    assert state.era == pytest.approx(11 / 6)
    assert state.last_diff == pytest.approx(14 / 3) and state.last_diff2 == pytest.approx(13 / 6)
    assert state.last_value == 7.0 and state.count == 4


def test_effective_rank_dynamics_over_prefixes():
    # rows e_1..e_5 of R^8, uncentred: the prefix of t + 1 rows has ER t + 1
    # stride 1 -> prefixes t = 1..4 -> x = 2, 3, 4, 5
    # d = 3 - 2, 4 - 2.5, 5 - 3 = 1, 1.5, 2 -> ERV 1.5;  dd = 0.5, 0.5 -> ERA 0.5
    hidden = torch.eye(8)[:5]
    er, erv, era = effective_rank_dynamics(hidden, stride=1, center=False)
    assert er == pytest.approx(5.0, abs=1e-4)
    assert erv == pytest.approx(1.5, abs=1e-4)
    assert era == pytest.approx(0.5, abs=1e-4)
    # stride 2 -> prefixes t = 2, 4 -> x = 3, 5 -> ERV = 2, ERA undefined
    er, erv, era = effective_rank_dynamics(hidden, stride=2, center=False)
    assert erv == pytest.approx(2.0, abs=1e-4) and math.isnan(era)
