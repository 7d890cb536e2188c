"""Tests for posttrain.algorithms.selection: hand-computed examples, invariants, edge cases."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from posttrain.algorithms import selection as sel
from posttrain.algorithms.registry import UnknownNameError

T = torch.tensor


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- registry


def test_registry_names_and_select_contract():
    assert sel.names() == ["all_correct", "dynamic_sampling", "none", "rest_grpo"]
    r = T([[1.0, 0.0], [1.0, 1.0]])
    for name in sel.names():
        keep = sel.select(name, r, unused_extra=3)  # undeclared kwargs are ignored
        assert keep.dtype == torch.bool and keep.shape == (2,)
    with pytest.raises(UnknownNameError, match="dynamic_sampling"):
        sel.select("dynamic_sampling_typo", r)
    with pytest.raises(ValueError, match=r"\[P, G\]"):
        sel.select("none", T([1.0, 0.0]))


def test_every_filter_handles_empty_batch_and_singletons():
    empty = torch.zeros(0, 4)
    for name in sel.names():
        assert sel.select(name, empty).shape == (0,)
        assert sel.select(name, torch.zeros(3, 0)).shape == (3,)  # G = 0 does not crash
        assert sel.select(name, T([[1.0], [0.0]])).shape == (2,)  # G = 1


# --------------------------------------------------------------------------- DAPO


def test_dynamic_sampling_hand_example():
    # groups: mixed [1,0,0,1] (spread 1) kept; all-correct and all-wrong (spread 0) dropped;
    # [0.5,0.5,0.5,0.2] spread 0.3 kept
    r = T([[1, 0, 0, 1], [1, 1, 1, 1], [0, 0, 0, 0], [0.5, 0.5, 0.5, 0.2]])
    assert sel.select("dynamic_sampling", r).tolist() == [True, False, False, True]
    # HINT's skip_zero_groups tolerance 1e-4: spread 5e-5 counts as zero
    assert sel.dynamic_sampling(T([[0.0, 5e-5]]), tol=1e-4).tolist() == [False]


def test_dynamic_sampling_never_keeps_zero_variance_groups():
    g = gen(1)
    for _ in range(20):
        r = torch.randint(0, 2, (16, 4), generator=g).float()
        keep = sel.dynamic_sampling(r)
        zero_var = r.std(dim=1) == 0
        assert not (keep & zero_var).any()
        assert (keep | zero_var).all()  # and every group with spread is kept


def test_dynamic_sampling_float_roundoff_equal_rewards_dropped():
    # np.std([0.1]*3) = 1.4e-17 > 0 in verl; max - min is exactly 0 here
    assert sel.dynamic_sampling(T([[0.1, 0.1, 0.1]])).tolist() == [False]


def test_dynamic_sampling_singleton_groups():
    r = T([[1.0], [0.0]])
    assert sel.dynamic_sampling(r).tolist() == [True, True]  # verl keeps len == 1 groups
    assert sel.dynamic_sampling(r, keep_singletons=False).tolist() == [False, False]


def test_accumulator_fills_and_truncates():
    state = sel.DynamicSamplingState()
    # batch 0 keeps groups 1 and 3 -> 2 kept, need 3
    state, why = sel.dynamic_sampling_step(state, T([False, True, False, True]), train_batch_size=3)
    assert why == "continue" and state.kept == ((0, 1), (0, 3)) and state.num_gen_batches == 1
    # batch 1 keeps groups 0 and 2 -> 4 kept >= 3: full, surplus (1, 2) dropped
    state, why = sel.dynamic_sampling_step(state, T([True, False, True, False]), train_batch_size=3)
    assert why == "full"
    assert state.kept == ((0, 1), (0, 3), (1, 0)) and state.num_kept == 3 and state.num_gen_batches == 2


def test_accumulator_stops_at_exactly_the_limit():
    state = sel.DynamicSamplingState()
    reasons = []
    for _ in range(3):
        state, why = sel.dynamic_sampling_step(
            state, T([True, False]), train_batch_size=100, max_num_gen_batches=3
        )
        reasons.append(why)
    assert reasons == ["continue", "continue", "limit"]
    assert state.num_gen_batches == 3 and state.num_kept == 3


def test_accumulator_full_wins_over_limit_and_zero_means_unlimited():
    state = sel.DynamicSamplingState(kept=((0, 0),), num_gen_batches=1)
    _, why = sel.dynamic_sampling_step(state, T([True]), train_batch_size=2, max_num_gen_batches=2)
    assert why == "full"  # full on the limit batch is still "full"
    state = sel.DynamicSamplingState()
    for _ in range(50):
        state, why = sel.dynamic_sampling_step(state, T([False]), train_batch_size=1, max_num_gen_batches=0)
        assert why == "continue"


def test_accumulator_is_pure_and_checks_inputs():
    state = sel.DynamicSamplingState()
    new, _ = sel.dynamic_sampling_step(state, T([True]), train_batch_size=4)
    assert state.kept == () and state.num_gen_batches == 0 and new.num_kept == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        new.num_gen_batches = 5  # type: ignore[misc]
    # empty generation batch still counts as a batch
    new2, why = sel.dynamic_sampling_step(new, torch.zeros(0, dtype=torch.bool), train_batch_size=4)
    assert why == "continue" and new2.num_gen_batches == 2 and new2.num_kept == 1
    with pytest.raises(ValueError, match="bool"):
        sel.dynamic_sampling_step(state, T([1.0]), train_batch_size=4)
    with pytest.raises(ValueError, match="positive"):
        sel.dynamic_sampling_step(state, T([True]), train_batch_size=0)


# --------------------------------------------------------------------------- ReST-GRPO


def test_rest_grpo_filter_hand_example():
    # [1,1,1,1]: sigma_p = 0 < 0.05 -> dropped (catalog 3.4)
    # [1,0,0,1]: sigma_p = 0.5 -> kept
    # [0.5,0.55,0.5,0.55]: mean 0.525, deviations +-0.025, sigma_p = 0.025 < 0.05 -> dropped
    # [0.4,0.5,0.6,0.5]: deviations -0.1,0,0.1,0 -> var 0.02/4 = 0.005, sigma_p = 0.0707 -> kept
    r = T([[1, 1, 1, 1], [1, 0, 0, 1], [0.5, 0.55, 0.5, 0.55], [0.4, 0.5, 0.6, 0.5]])
    assert sel.select("rest_grpo", r).tolist() == [False, True, False, True]
    # population, not unbiased: [0, 0.1]: sigma_p = 0.05 (kept, >=), sigma_u = 0.0707
    assert sel.rest_grpo(T([[0.0, 0.1]]), min_std=0.05).tolist() == [True]
    assert sel.rest_grpo(T([[0.0, 0.1]]), min_std=0.06).tolist() == [False]


def test_rest_partial_state_mask():
    # kept and best >= 0.9: [1,0,0,1] yes; [0.8,0,0,0.8] kept (sigma_p 0.4) but best 0.8 < 0.9: no
    r = T([[1, 0, 0, 1], [0.8, 0, 0, 0.8], [1, 1, 1, 1]])
    assert sel.rest_partial_state_mask(r).tolist() == [True, False, False]


def test_rest_prefix_weights_catalog_numbers():
    # alpha^k for k = 0..3: 1, 0.95, 0.9025, 0.857375; sum 3.709875; 1/3.709875 = 0.269551
    w = sel.rest_prefix_weights(4, alpha=0.95)
    assert torch.allclose(w, T([0.269551, 0.256073, 0.243270, 0.231106]), atol=1e-6)
    assert math.isclose(float(w.sum()), 1.0, rel_tol=1e-6)
    assert sel.rest_prefix_weights(0).shape == (0,)
    with pytest.raises(ValueError):
        sel.rest_prefix_weights(3, alpha=1.0)


def test_rest_sample_prefixes_counts_range_and_determinism():
    # 4 lines -> ceil(0.5 * 4) = 2 prefixes drawn (catalog 3.4); 5 lines -> ceil(2.5) = 3
    a = sel.rest_sample_prefixes(4, generator=gen(7))
    b = sel.rest_sample_prefixes(4, generator=gen(7))
    assert a.shape == (2,) and torch.equal(a, b)
    assert ((a >= 1) & (a <= 4)).all()
    assert sel.rest_sample_prefixes(5, generator=gen(0)).shape == (3,)
    assert sel.rest_sample_prefixes(0, generator=gen(0)).shape == (0,)
    # with many draws the empirical frequencies follow alpha^k (prefix 1 most frequent)
    many = sel.rest_sample_prefixes(2000, generator=gen(3), alpha=0.5, ratio=1.0)
    assert (many == 1).float().mean() > 0.4  # p(1) = 0.5


def test_line_prefixes():
    assert sel.line_prefixes("a\nb\nc\n\n") == ["a\n", "a\nb\n", "a\nb\nc\n"]
    assert sel.line_prefixes("x") == ["x\n"]


# --------------------------------------------------------------------------- NGRPO


def test_all_correct_filter_hand_example():
    # all max (1) dropped; all-wrong kept (NGRPO's virtual sample gives it -0.447212 each);
    # mixed kept
    r = T([[1, 1, 1, 1], [0, 0, 0, 0], [1, 0, 0, 1]])
    assert sel.select("all_correct", r).tolist() == [False, True, True]
    assert sel.all_correct(T([[2.0, 2.0]]), max_reward=2.0).tolist() == [False]
    assert sel.all_correct(T([[1.0], [0.0]])).tolist() == [False, True]  # G = 1


# --------------------------------------------------------------------------- Shuffle-R1


def test_pts_catalog_example():
    # r = [1, 0.5, 0, 0.2]: mean 0.425, sigma_u = 0.434933
    # A = [1.3220, 0.1724, -0.9772, -0.5173]; order by A desc [0, 1, 3, 2]
    # pairs (0,2) w = 1.3220 + 0.9772 = 2.2992, (1,3) w = 0.1724 + 0.5173 = 0.6898
    # keep int(2 * (1 - 0.5)) = 1 pair -> (0, 2)
    out = sel.pairwise_trajectory_sampling(T([[1.0, 0.5, 0.0, 0.2]]))
    assert torch.allclose(out.advantages, T([[1.3220, 0.1724, -0.9772, -0.5173]]), atol=1e-4)
    assert out.pairs.tolist() == [[[0, 2]]]
    assert torch.allclose(out.weights, T([[2.2992]]), atol=1e-4)
    full = sel.pairwise_trajectory_sampling(T([[1.0, 0.5, 0.0, 0.2]]), prune_ratio=0.0)
    assert full.pairs.tolist() == [[[0, 2], [1, 3]]]
    assert torch.allclose(full.weights, T([[2.2992, 0.6898]]), atol=1e-4)


def test_pts_weight_variants_and_ties():
    # [1,0,0,1]: A = +-0.866025 (sigma_u 0.57735); stable sort desc -> [0, 3, 1, 2]
    # pairs (0,2), (3,1)
    out = sel.pairwise_trajectory_sampling(T([[1.0, 0.0, 0.0, 1.0]]), prune_ratio=0.0, weight="max")
    assert out.pairs.tolist() == [[[0, 2], [3, 1]]]
    assert torch.allclose(out.weights, T([[0.866025, 0.866025]]), atol=1e-5)
    mean = sel.pairwise_trajectory_sampling(T([[1.0, 0.0, 0.0, 1.0]]), prune_ratio=0.0, weight="mean")
    assert torch.allclose(mean.weights, T([[0.866025, 0.866025]]), atol=1e-5)
    # pos = |max(A_a, A_b)|: pair (0, 2) of [1,0.5,0,0.2] -> |1.3220|
    pos = sel.pairwise_trajectory_sampling(T([[1.0, 0.5, 0.0, 0.2]]), weight="pos")
    assert torch.allclose(pos.weights, T([[1.3220]]), atol=1e-4)
    with pytest.raises(ValueError):
        sel.pairwise_trajectory_sampling(T([[1.0, 0.0]]), weight="min")  # type: ignore[arg-type]


def test_pts_edge_cases():
    one = sel.pairwise_trajectory_sampling(T([[1.0], [0.0]]))  # G = 1: no pairs
    assert one.pairs.shape == (2, 0, 2) and one.weights.shape == (2, 0)
    # singleton advantage uses mean 0, std 1, like the code: A = r / (1 + eps)
    assert torch.allclose(one.advantages, T([[1.0], [0.0]]), atol=1e-5)
    empty = sel.pairwise_trajectory_sampling(torch.zeros(0, 4))
    assert empty.pairs.shape == (0, 1, 2)
    # odd G = 3 leaves the median unpaired: r = [0, 1, 0.5] -> order [1, 2, 0] -> pair (1, 0)
    odd = sel.pairwise_trajectory_sampling(T([[0.0, 1.0, 0.5]]), prune_ratio=0.0)
    assert odd.pairs.tolist() == [[[1, 0]]]
    # zero-variance group: A = 0 everywhere, pair weight 0
    flat = sel.pairwise_trajectory_sampling(T([[1.0, 1.0, 1.0, 1.0]]))
    assert flat.weights.tolist() == [[0.0]]


def test_shuffle_probabilities_catalog_example():
    # weights 2.2992 and 1.7321: 2.2992 / 4.0313 = 0.5703, 1.7321 / 4.0313 = 0.4297
    p = sel.shuffle_probabilities(T([2.2992, 1.7321]))
    assert torch.allclose(p, T([0.5703, 0.4297]), atol=1e-4)
    # power 2: 4 / (4 + 1) = 0.8
    assert torch.allclose(sel.shuffle_probabilities(T([2.0, 1.0]), power=2.0), T([0.8, 0.2]))
    assert torch.allclose(sel.shuffle_probabilities(T([0.0, 0.0])), T([0.5, 0.5]))


def test_advantage_batch_shuffle_shape_determinism_and_bias():
    w = T([5.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0])
    a = sel.advantage_batch_shuffle(w, generator=gen(11))
    b = sel.advantage_batch_shuffle(w, generator=gen(11))
    # 8 pairs, 8 rounds, 8 // 8 = 1 pair a round -> 8 indices
    assert a.shape == (8,) and torch.equal(a, b)
    # positive pairs are drawn before zero-weight ones within a round
    assert not ((a == 4) | (a == 5)).any()
    # each round draws without replacement: 4 rounds of 2
    c = sel.advantage_batch_shuffle(w, generator=gen(2), replay_times=4)
    assert c.shape == (8,)
    for r in c.view(4, 2):
        assert r[0] != r[1]
    # the heavy pair appears more often than a light one over many rounds
    many = sel.advantage_batch_shuffle(w, generator=gen(5), replay_times=400, pairs_per_round=1)
    assert (many == 0).sum() > (many == 1).sum()


def test_advantage_batch_shuffle_edge_cases():
    assert sel.advantage_batch_shuffle(torch.zeros(0), generator=gen()).shape == (0,)
    assert sel.advantage_batch_shuffle(T([1.0, 2.0]), generator=gen(), replay_times=1).tolist() == [0, 1]
    # fewer positive pairs than a round needs: the round is filled with zero-weight pairs
    out = sel.advantage_batch_shuffle(T([1.0, 0.0, 0.0]), generator=gen(), replay_times=2, pairs_per_round=3)
    assert out.shape == (6,) and out[0] == 0 and out[3] == 0
    assert sorted(out[:3].tolist()) == [0, 1, 2]


# --------------------------------------------------------------------------- RoRecomp


def test_rorecomp_catalog_example():
    # r = [1,1,0,0], len = [100,300,200,400]
    # correct lengths {100, 300}: median 200 -> 100 < 200: idx 0 is short-correct
    # wrong lengths {200, 400}: median 300 -> 400 > 300: idx 3 is long-wrong
    # priority {0, 3}, buffer {1, 2}
    pri = sel.rorecomp_priority_mask(T([[1.0, 1.0, 0.0, 0.0]]), T([[100, 300, 200, 400]]))
    assert pri.tolist() == [[True, False, False, True]]


def test_rorecomp_top_k_and_edge_cases():
    r = T([[1.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
    lens = T([[50, 10, 30, 70, 90, 80]])
    # k=1: shortest correct idx 1 (10), longest wrong idx 4 (90)
    assert sel.rorecomp_priority_mask(r, lens, top_k=1).nonzero()[:, 1].tolist() == [1, 4]
    # median, inclusive: correct {50,10,30} median 30 -> 10, 30 (idx 1, 2); wrong {70,90,80} median 80 -> 90, 80
    # (idx 4, 5)
    assert sel.rorecomp_priority_mask(r, lens).nonzero()[:, 1].tolist() == [1, 2, 4, 5]
    assert sel.rorecomp_priority_mask(torch.zeros(0, 4), torch.zeros(0, 4)).shape == (0, 4)
    with pytest.raises(ValueError, match="match"):
        sel.rorecomp_priority_mask(T([[1.0, 0.0]]), T([[1, 2, 3]]))


def test_rorecomp_prioritizes_a_lone_correct_answer_and_an_equal_length_group():
    # issue 38, D8: a strict median split (len < median) never picks a response equal to its half's median, so it
    # dropped a group's only correct answer and every response of an equal-length group.
    # r = [1, 0, 0, 0], len = [5, 3, 4, 6]: correct {5}, median 5 -> 5 <= 5: row 0 (strict: 5 < 5 is false);
    # wrong {3, 4, 6}, median 4 -> 4 >= 4 and 6 >= 4: rows 2, 3 (strict: row 3 only)
    lone = sel.rorecomp_priority_mask(T([[1.0, 0.0, 0.0, 0.0]]), T([[5, 3, 4, 6]]))
    assert lone.tolist() == [[True, False, True, True]]
    # r = [1, 1, 0, 0], every length 7: correct {7, 7} median 7, wrong {7, 7} median 7 -> all four
    # (strict: none, so the group's outcome signal went only to the compensation buffer)
    flat = sel.rorecomp_priority_mask(T([[1.0, 1.0, 0.0, 0.0]]), T([[7, 7, 7, 7]]))
    assert flat.all()
    # a lone wrong answer among correct ones is the longest wrong: kept too. r = [1, 1, 1, 0], len = [2, 4, 6, 3]:
    # correct {2, 4, 6} median 4 -> rows 0, 1; wrong {3} -> row 3
    assert sel.rorecomp_priority_mask(T([[1.0, 1.0, 1.0, 0.0]]), T([[2, 4, 6, 3]])).tolist() == [
        [True, True, False, True]]


def test_compensation_buffer_push_draw():
    buf = sel.compensation_push(sel.CompensationBuffer(), [1, 2, 3])
    buf = sel.compensation_push(buf, [4, 5], capacity=4)  # oldest (1) evicted
    assert buf.items == (2, 3, 4, 5)
    ids, left = sel.compensation_draw(buf, batch_size=3, generator=gen(4))
    ids2, left2 = sel.compensation_draw(buf, batch_size=3, generator=gen(4))
    assert ids == ids2 and left == left2  # deterministic with a seeded generator
    assert len(ids) == 3 and len(set(ids)) == 3
    assert sorted(ids + left.items) == [2, 3, 4, 5]
    assert buf.items == (2, 3, 4, 5)  # input untouched
    ids, left = sel.compensation_draw(left, batch_size=10, generator=gen())
    assert len(ids) == 1 and left.items == ()
    assert sel.compensation_draw(left, batch_size=2, generator=gen()) == ((), left)


# --------------------------------------------------------------------------- HINT


def test_hint_reroll_mask():
    # only the all-zero group needs a re-roll; a group with a negative format penalty is not 0
    r = T([[0, 0, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1], [0, -0.5, 0, 0]])
    assert sel.hint_reroll_mask(r).tolist() == [True, False, False, False]
    assert sel.hint_reroll_mask(T([[0.0], [1.0]])).tolist() == [True, False]  # G = 1
    assert sel.hint_reroll_mask(torch.zeros(0, 4)).shape == (0,)
    assert sel.hint_reroll_mask(torch.zeros(2, 0)).tolist() == [False, False]


def test_hint_prompt_text():
    q, h = "What is 2+3?", "Add the numbers."
    expected = (
        "What is 2+3?\nHere are some key pieces of information to assist your reasoning without "
        "revealing the solution directly:\nAdd the numbers."
    )
    assert sel.hint_prompt(q, h) == expected
    assert sel.hint_prompt(q, h, preamble=" | ") == "What is 2+3? | Add the numbers."


# --------------------------------------------------------------------------- pass-rate history


def test_pass_rate_history_update_pooled_and_pure():
    h0 = sel.PassRateHistory()
    # prompt "a" on two rows: 3 of 4 correct, then 1 of 4 -> pooled 4 / 8 = 0.5
    # prompt 7: 0 of 4 -> 0.0
    r = T([[1, 1, 1, 0], [0, 7, 0, 0], [0, 0, 0, 0]])  # 7 > 0 counts as correct
    h1 = sel.update(h0, ["a", "a", 7], r)
    assert h1.rates == {"a": (0.5,), 7: (0.0,)}
    assert h1.attempts == {"a": 8, 7: 4} and h1.successes == {"a": 4, 7: 0}
    assert h1.ema == {"a": 0.5, 7: 0.0}
    assert h0.rates == {}  # the input is not modified
    with pytest.raises(TypeError):
        h1.rates["a"] = (1.0,)  # type: ignore[index]
    # second step: "a" 4/4 -> 1.0; EMA 0.9 * 0.5 + 0.1 * 1.0 = 0.55
    h2 = sel.update(h1, ["a"], T([[1, 1, 1, 1]]))
    assert h2.rates["a"] == (0.5, 1.0) and math.isclose(h2.ema["a"], 0.55)
    assert h2.rates[7] == (0.0,) and h2.attempts["a"] == 12
    # window keeps the newest rates
    h3 = sel.update(h2, ["a"], T([[0, 0, 0, 0]]), window=2)
    assert h3.rates["a"] == (1.0, 0.0)


def test_pass_rate_history_edge_cases():
    h = sel.PassRateHistory()
    assert sel.update(h, [], torch.zeros(0, 4)) == h
    assert sel.update(h, ["x"], T([[1.0]])).rates == {"x": (1.0,)}  # G = 1
    with pytest.raises(ValueError, match="prompt ids"):
        sel.update(h, ["x", "y"], T([[1.0]]))
    with pytest.raises(ValueError, match="window"):
        sel.update(h, ["x"], T([[1.0]]), window=0)


def _history_from(rates: dict[str | int, list[float]]) -> sel.PassRateHistory:
    h = sel.PassRateHistory()
    n_epochs = max(len(v) for v in rates.values())
    for e in range(n_epochs):
        ids = [pid for pid, v in rates.items() if e < len(v)]
        # one completion per prompt: pass rate = the reward itself (0 or 1)
        h = sel.update(h, ids, T([[rates[pid][e]] for pid in ids]))
    return h


def test_historical_variance_catalog_numbers_and_ranking():
    # [0,1,0,1]: mean 0.5, every deviation 0.5 -> sigma_p 0.5
    # [1,1,1,1]: 0
    # [0,0,1,1,1]: mean 0.6, var (2*0.36 + 3*0.16)/5 = 0.24 -> sigma_p 0.489898
    h = _history_from({"p": [0, 1, 0, 1], "q": [1, 1, 1, 1], "r": [0, 0, 1, 1, 1]})
    scores = sel.pass_rate_std(h)
    assert math.isclose(scores["p"], 0.5)
    assert scores["q"] == 0.0
    assert math.isclose(scores["r"], 0.489898, abs_tol=1e-6)
    assert sel.rank_by_historical_variance(h) == ["p", "r", "q"]
    assert sel.rank_by_historical_variance(h, top_n=1) == ["p"]


def test_historical_variance_ties_keep_history_order_and_single_observation():
    h = _history_from({"b": [1, 0], "a": [0, 1], "c": [1]})
    # b and a both 0.5 (tie keeps insertion order); c has one observation -> 0
    assert sel.rank_by_historical_variance(h) == ["b", "a", "c"]
    assert sel.rank_by_historical_variance(sel.PassRateHistory()) == []


def test_rorecomp_priority_mask_equals_a_per_group_loop():
    # the vectorised rule against the plain reading: per group and half, numpy's median or a stable sort
    import numpy as np

    g = torch.Generator().manual_seed(3)
    r = (torch.rand(40, 7, generator=g) > 0.5).float()
    lens = torch.randint(1, 6, (40, 7), generator=g).float()  # few distinct lengths: many ties
    for top_k in (None, 1, 2, 5):
        want = torch.zeros(40, 7, dtype=torch.bool)
        for p in range(40):
            for half, short in ((r[p] > 0, True), (r[p] <= 0, False)):
                idx = half.nonzero().flatten().tolist()
                if not idx:
                    continue
                ls = [float(lens[p, i]) for i in idx]
                if top_k is None:
                    med = float(np.median(ls))
                    want[p, [i for i, x in zip(idx, ls, strict=True) if (x <= med if short else x >= med)]] = True
                else:
                    order = sorted(range(len(idx)), key=lambda j: ls[j] if short else -ls[j])  # stable
                    want[p, [idx[j] for j in order[:top_k]]] = True
        assert torch.equal(sel.rorecomp_priority_mask(r, lens, top_k=top_k), want), top_k
